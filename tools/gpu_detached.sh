#!/usr/bin/env bash
# tools/gpu_check.sh on the GPU box, detached from the device call that starts it: one call runs at most 10 minutes,
# a GPU session's work takes longer, and a command cut at the limit loses what it was doing. The check runs in its
# own process session on a copy of the tree; each call waits for it a while and brings back what it wrote so far.
#
#   bash tools/gpu_detached.sh start MODE [MODE ...]   copy the tree to /root/q/tree, start gpu_check.sh MODE ... there
#                                                      (the environment passes on: TESTS, BASE, FLASHMLA, ...), then poll
#   bash tools/gpu_detached.sh poll                    a later call on the same (warm) machine: wait, then bring back
#
# Polling waits up to $WAIT seconds (default 540: inside one call) or until the check ends, then copies its logs into
# $OUT as logs.tar.gz (every file the check wrote; `tar xzf` it here) and its last lines as progress.log. The check's
# own $OUT is /root/q/out ($GPU_DETACHED_DIR: another folder); /root/q/rc holds its exit status once it ended. The tree's .commit names the commit
# (write it before the call: the device copy has no current .git). A machine given back (idle past its hold) loses
# the run: poll again soon after each call. A poll also brings back the compile caches the check packed after its
# last finished mode (compile_cache.tar.gz.part*; gpu_check.sh's save_compile_cache).
set -uo pipefail
Q=${GPU_DETACHED_DIR:-/root/q}
WAIT=${WAIT:-540}
OUT=${OUT:-out}
case ${1:-} in
  start)
    shift
    [ $# -gt 0 ] || { echo "usage: $0 start MODE [MODE ...]"; exit 2; }
    if [ -f $Q/pid ] && kill -0 "$(cat $Q/pid)" 2>/dev/null; then echo "a check is running already (pid $(cat $Q/pid))"; exit 1; fi
    rm -rf $Q && mkdir -p $Q/out && cp -a "$(dirname "$0")/.." $Q/tree || exit 1
    (cd $Q/tree && OUT=$Q/out SAVE_COMPILE_CACHE=$Q/compile_cache.tar.gz setsid bash -c 'bash tools/gpu_check.sh "$@"; echo $? > '$Q'/rc' _ "$@" \
      > $Q/out/gpu_check.log 2>&1 < /dev/null & echo $! > $Q/pid)
    echo "started gpu_check.sh $* (pid $(cat $Q/pid)) in $Q/tree" ;;
  poll) ;;
  *) echo "usage: $0 start MODE [MODE ...] | poll"; exit 2 ;;
esac
for _ in $(seq $((WAIT / 5))); do [ -f $Q/rc ] && break; sleep 5; done
mkdir -p "$OUT"
tar czf "$OUT/logs.tar.gz" -C $Q out
tail -40 $Q/out/gpu_check.log | tee "$OUT/progress.log"
# the compile caches for the next session: packed now while the check runs (else after its last mode), brought back when
# packed anew since the last poll, in parts of 15 MB (a call brings back 16 MiB a file); in the checkout,
# `cat compile_cache.tar.gz.part* > .compile_cache.tar.gz` and carry that next time
[ -f $Q/rc ] || bash "$(dirname "$0")/pack_compile_cache.sh" $Q/compile_cache.tar.gz
if [ -f $Q/compile_cache.tar.gz ] && [ $Q/compile_cache.tar.gz -nt $Q/cache_sent ]; then
  split -b 15000000 -d $Q/compile_cache.tar.gz "$OUT/compile_cache.tar.gz.part" && touch $Q/cache_sent
fi
if [ -f $Q/rc ]; then echo "gpu_check.sh ended, exit status $(cat $Q/rc)"; else echo "still running: poll again"; fi
