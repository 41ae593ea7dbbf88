#!/usr/bin/env bash
# Pack the GPU box's compile caches (Inductor's and Triton's, /tmp/dsv4_cache) into PATH for the next session:
#   bash tools/pack_compile_cache.sh PATH
# Only up to $CACHE_MAX_MB (default 22) packed: what a later device call can carry beside the tree and the wheels
# (64 MiB a call). Both caches write a file under another name and rename it, so packing while a compile runs takes
# whole files. gpu_check.sh packs after every mode, gpu_detached.sh at every poll.
set -uo pipefail
out=${1:?usage: $0 PATH}
[ -d /tmp/dsv4_cache ] || exit 0
# the caches only grow while a check runs: once packed over the limit, every later pack is too (each costs the
# device seconds of compressing them, inside a poll's billed time)
[ -f "$out.over_limit" ] && exit 0
# a Triton kernel loads from its metadata (.json) and binary (.cubin); tests read its PTX; its other IRs stay behind
tar czf "$out.$$.tmp" --exclude='*.ttir' --exclude='*.ttgir' --exclude='*.llir' --exclude='*.source' \
  -C /tmp/dsv4_cache . 2>/dev/null
[ $? -le 1 ] || { rm -f "$out.$$.tmp"; exit 0; }  # 1: a file changed while read (a compile running), the rest is whole
mb=$(( $(stat -c %s "$out.$$.tmp") / 1000000 ))
if [ $mb -le "${CACHE_MAX_MB:-22}" ]; then mv "$out.$$.tmp" "$out"; echo "compile cache: $mb MB packed"
else rm -f "$out.$$.tmp"; touch "$out.over_limit"; echo "compile cache: $mb MB packed, over ${CACHE_MAX_MB:-22} MB: not kept"; fi
