#!/usr/bin/env bash
# The GPU check on the GPU box (the device tool runs it in the checkout):  bash tools/gpu_check.sh MODE [MODE ...]
#
#   tests   the `gpu` tests (pytest -m gpu, xdist), the Triton kernels' tests on this GPU, then the demo; with $TESTS
#           (test files) those files only, gpu and cpu tests alike (the kernel tests: *_kernels.py and *_paged.py);
#           with $FLASHMLA (its source, as for ops) it is built first, so the FlashMLA comparison test runs too
#                                                                                       -> gpu_tests.log, demo.log
#   model   BENCHMARKS.md's model tables: the Flash slice's public decode at batch 1, 8 x 4K and its 4K prefill with
#           HF transformers eager at 1 x 4K, the step inside generate at batch 1 x 4K and 32K, then the bench config's
#           grid (benchmarks/bench_model.py, bench_spec.py); with TTFT=1 also time to first token at 1K-128K through
#           every public path (benchmarks/bench_ttft.py, $POINTS: its --points, $CHUNKS: its --prefill-chunks;
#           TTFT=only: that alone)
#                                                                                       -> bench_flash.*, bench_model.*
#   hf      HF `generate` unpatched vs dsv4_ops.hf.enable vs Generator (benchmarks/bench_hf.py), then on the Flash
#           slice the first calls of new shapes after warm-up (--parts stalls)     -> bench_hf.*, bench_hf_stalls.json
#   aoti    dsv4_ops.export + AOTIGenerator at batch 1 x 4K, then the C++ runner on that package -> bench_aoti.*
#   spec    speculative decoding through Generator(spec_steps=k).generate (benchmarks/bench_spec.py) on a trained
#           model: $TRAINED, or first `python -m dsv4_ops.train_tiny --preset gpu --steps 220` (4 min on an H100; a step
#           count, not a time limit: every run trains the same steps, whatever the machine's speed) into build/trained-gpu,
#           with its quality numbers (benchmarks/trained_tiny_quality.py; SPEC_QUALITY=0: none), $SPEC_GRID its runs (bench_spec arguments,
#           ';' between runs; default "--ks 1 2 3 4"); then, unless SPEC_RANDOM=0, on the bench config (random weights)
#                                                           -> bench_spec.*, train_gpu.log, trained_quality.log, bench_spec_trained_*.json
#   serve   the OpenAI-compatible server on the Flash slice (benchmarks/serve_random.py, random weights) under
#           benchmarks/bench_serve.py: random lengths at concurrency 1, 8, 64, and a 4K shared prefix at concurrency 8
#           with the prefix cache on and off, and the engine's batch-1 decode step for the TPOT comparison; then the
#           serving Engine vs the static Generator (bench_engine.py) with the caches in $CACHES (default "bf16 fp8"),
#           $PARTS (its --parts), $REQUESTS, $ADMIT_WAIT and $ADMIT_ORDER (values: one engine run each); SERVER=0: the
#           engine alone
#                                        -> bench_serve.log, bench_serve_*.json, serve_step_*.json, bench_engine_*
#   ops     the per-op grid at 2-3 shapes per op against its floor (benchmarks/bench_ops.py), each op's eager host
#           cost per call (benchmarks/bench_op_overhead.py -> bench_op_overhead.json), and the FP8 sparse
#           attention next to FlashMLA's V4 kernel when $FLASHMLA names its source (benchmarks/bench_flashmla.py);
#           OVERHEAD=only: the host costs alone
#   ab      $BASE (another checkout's root, e.g. an older commit's tree): the Flash slice's batch-1 step inside
#           generate and the attention + indexer grid at 32K, for $BASE and for this tree, in turns ($ROUNDS, default
#           1)                                                                          -> ab.log, ab_*.json
#   profile kernels of the Flash slice's batch-1 public decode at 4K and 32K (tools/profile_step.py); PROFILE=prefill: of
#           its prefill, 1 x 4096 (the default chunk buckets, then one 4096-token step) and 8 x 1024 tokens
#   sweep   launch-config sweep of the Triton kernels, $SWEEP = its --only list (tools/sweep_kernels.py)
#   ncu     Nsight Compute of the hot Triton kernels, or of the Gluon attention with NCU=gluon (tools/ncu_*.py)
#   tp      2 GPUs: the tensor-parallel demo and benchmarks/bench_tp.py
#
# Every mode tees its log into $OUT (or ./out); $OUT/gpu.txt names the machine and versions. The device tool returns
# at most 8 files a call; one call runs at most 10 minutes. Its copy of the checkout has no current .git: write
# `git describe --always --dirty > .commit` before the call, and gpu.txt names it ("-dirty": the working tree's
# uncommitted edits travelled too, and the numbers are theirs). Wheels carried in .whl/ (a transformers with V4,
# expecttest) are installed to /tmp/site first. The package (and its CUDA extension) is built in place once.
# A carried .compile_cache.tar.gz (what SAVE_COMPILE_CACHE=PATH packed last time) spares the compiles it holds.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-out}"); mkdir -p "$OUT"
[ $# -gt 0 ] || set -- tests
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
# compiles cost most of a session's device time; their caches (Inductor's, Triton's) can travel between sessions:
# a carried .compile_cache.tar.gz is unpacked first, and with $SAVE_COMPILE_CACHE (a path) packed again after each mode
export TORCHINDUCTOR_CACHE_DIR=/tmp/dsv4_cache/inductor TRITON_CACHE_DIR=/tmp/dsv4_cache/triton
if [ -f .compile_cache.tar.gz ]; then mkdir -p /tmp/dsv4_cache && tar xzf .compile_cache.tar.gz -C /tmp/dsv4_cache; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
{ [ -f .commit ] && echo "commit $(cat .commit) (.commit)" || git log -1 --format='commit %H %s'; } 2>/dev/null \
  | tee -a "$OUT/gpu.txt"
# the CUDA extension (csrc/): built in place, as `pip install -e .` does on the GPU box
python3 setup.py -q build_ext --inplace > "$OUT/build_ext.log" 2>&1 || { echo "build_ext failed:"; tail -20 "$OUT/build_ext.log"; }
xdist=$(python3 -c "import xdist" 2>/dev/null && echo yes)
# build_flashmla: the FlashMLA peer of $FLASHMLA built in place (about a minute), for `ops` and `tests`
build_flashmla() {
  (cd "$FLASHMLA" && bash build.sh > "$OUT/flashmla_build.log" 2>&1) || { tail -5 "$OUT/flashmla_build.log"; return 1; }
}
# line-buffered: a mode cut by the device call's time limit keeps the lines it printed
quiet() { grep --line-buffered -v -e Warning -e warnings.warn -e "Online softmax" -e "split the reduction" \
  -e "important use case" -e "^softmax\.$" -e '^\s*$'; }
# flash_b1 TREE NAME: the Flash slice's batch-1 step inside generate at 4K and 32K, with TREE's code
flash_b1() {
  local path=${PYTHONPATH/$PWD/$1}
  (cd "$1" && PYTHONPATH=$path python3 benchmarks/bench_spec.py --config flash-slice --batches 1 --ks \
    --context 4096 32768 --samples 5 --new-tokens 8 264 --out "$OUT/$2.json") 2>&1 | quiet | grep -e "plain decode" -e rror
}
# attn_grid TREE NAME: the attention and indexer ops' grid at V4-Flash widths, bf16 and FP8 caches, with TREE's code
attn_grid() {
  local path=${PYTHONPATH/$PWD/$1}
  (cd "$1" && PYTHONPATH=$path python3 benchmarks/bench_ops.py --kernels sparse_attention indexer_topk \
    --shapes flash --batches 1 64 128 --contexts 32K --kv-cache-dtype bf16 fp8 --no-ref --no-plot \
    --out "$OUT/$2") 2>&1 | quiet | grep -e "^|" -e rror
}
# with $SAVE_COMPILE_CACHE (a path), the compile caches are packed there after every mode (a run cut short keeps what
# its finished modes compiled)
save_compile_cache() { [ -z "${SAVE_COMPILE_CACHE:-}" ] || bash tools/pack_compile_cache.sh "$SAVE_COMPILE_CACHE"; }
rc=0
for what in "$@"; do
  [ "$what" = "$1" ] || save_compile_cache
  echo "=== $what ($(date +%T))"
  case $what in
    tests)
      if [ -n "${TESTS:-}" ]; then
        python3 -m pytest -q -m "gpu or not gpu" $TESTS -p no:cacheprovider 2>&1 \
          | tee "$OUT/gpu_tests.log" | grep -e passed -e failed -e Error -e FAIL | tail -20 || rc=1
        continue
      fi
      # tests that poison shared memory run in one process (under xdist another worker's kernels clear the poison
      # between the fill and the launch), and so do those that take most of the GPU's memory (beside them 7 workers ran
      # out of an H100's 80 GB); the parity tests run HF on the CPU: one thread pool per worker. Then the Triton
      # kernels' own tests (interpreted on CPU) with the kernels compiled for this GPU.
      if [ -n "${FLASHMLA:-}" ]; then build_flashmla && export FLASHMLA_DIR=$FLASHMLA || rc=1; fi
      kernel_tests=$(ls tests/ops/*/test_*_kernels.py tests/ops/*/test_*_paged.py tests/test_triton_interp*.py 2>/dev/null)
      { python3 -m pytest -q -m "gpu and (smem_poison or whole_gpu)" tests -p no:cacheprovider || rc=1
        OMP_NUM_THREADS=$(( $(nproc) / 6 > 0 ? $(nproc) / 6 : 1 )) python3 -m pytest -q ${xdist:+-n ${WORKERS:-8} --dist worksteal} \
          -m "gpu and not smem_poison and not whole_gpu" tests -p no:cacheprovider --durations=15 || rc=1
        python3 -m pytest -q ${xdist:+-n ${WORKERS:-8}} -m "not gpu" $kernel_tests -p no:cacheprovider || rc=1; } 2>&1 \
        | tee "$OUT/gpu_tests.log" | grep -e passed -e failed -e FAILED -e ERROR -e "^[0-9.]*s " | tail -60
      python3 -m dsv4_ops demo 2>&1 | quiet | tee "$OUT/demo.log" | tail -20 || rc=1 ;;
    model)
      ttft() { python3 benchmarks/bench_ttft.py --config flash-slice ${POINTS:+--points $POINTS} \
                 ${CHUNKS:+--prefill-chunks $CHUNKS} --out "$OUT/bench_ttft.json"; }
      if [ "${TTFT:-0}" = only ]; then ttft 2>&1 | quiet | tee "$OUT/bench_ttft.log"; continue; fi
      { python3 benchmarks/bench_model.py --config flash-slice --batches 1 8 --contexts 4096 --modes graphs \
          --hf-points 1x4096 --hf-budget-s 300 --prefill-chunk 2048 --out "$OUT/bench_flash.json" || rc=1
        flash_b1 "$PWD" bench_flash_step || rc=1
        python3 benchmarks/bench_model.py --out "$OUT/bench_model.json" || rc=1
        if [ "${TTFT:-0}" = 1 ]; then ttft || rc=1; fi; } 2>&1 | quiet | tee "$OUT/bench_model.log" ;;
    hf) { python3 benchmarks/bench_hf.py --out "$OUT/bench_hf.json" || rc=1
          python3 benchmarks/bench_hf.py --config flash-slice --parts stalls --out "$OUT/bench_hf_stalls.json" || rc=1
        } 2>&1 | quiet | tee "$OUT/bench_hf.log" ;;
    aoti) # torch 2.11: loading an AOTI package needs the system libstdc++ (newer than the one torch was linked with)
      pre=/usr/lib/x86_64-linux-gnu/libstdc++.so.6
      { LD_PRELOAD=$pre python3 benchmarks/bench_model.py --aoti --batches 1 --contexts 4096 --prefill-chunk 0 --aoti-dir /tmp/dsv4_aoti \
          --out "$OUT/bench_aoti.json" &&
        make -s runner RUNNER_PY=python3 &&
        prompt=$(python3 -c "print(','.join(str(i % 1000) for i in range(4096)))") &&
        for i in 1 2; do LD_PRELOAD=$pre build/dsv4_run /tmp/dsv4_aoti/bench_b1.pt2 --prompt "$prompt" \
          --max-new-tokens 256 >/dev/null; done; } 2>&1 | quiet | tee "$OUT/bench_aoti.log" || rc=1 ;;
    spec) trained=${TRAINED:-build/trained-gpu}
          { if [ ! -f "$trained/model.safetensors" ]; then
              python3 -m dsv4_ops.train_tiny --preset gpu --device cuda --steps 220 --out "$trained" \
                > "$OUT/train_gpu.log" 2>&1 || { rc=1; tail -5 "$OUT/train_gpu.log"; }
            fi
            if [ "${SPEC_QUALITY:-1}" = 1 ]; then  # SPEC_QUALITY=0: the timings only
              python3 benchmarks/trained_tiny_quality.py --model "$trained" --device cuda > "$OUT/trained_quality.log" 2>&1 \
                || rc=1
            fi
            IFS=';' read -ra grid <<< "${SPEC_GRID:---ks 1 2 3 4}"  # SPEC_GRID: bench_spec arguments, ';' between runs
            for spec_args in "${grid[@]}"; do
              python3 benchmarks/bench_spec.py --model "$trained" --context 1024 $spec_args \
                --out "$OUT/bench_spec_trained_$(echo "$spec_args" | tr -dc '0-9').json" || rc=1
            done
            if [ "${SPEC_RANDOM:-1}" = 1 ]; then python3 benchmarks/bench_spec.py --out "$OUT/bench_spec.json" || rc=1; fi
          } 2>&1 | quiet | tee "$OUT/bench_spec.log" ;;
    serve) # serve_on PORT NAME [server flags]: start a server, wait for /health (compiles first), run the loads, stop it
          serve_on() {
            local port=$1 name=$2; shift 2
            python3 benchmarks/serve_random.py --config flash-slice --port "$port" --step-out "$OUT/serve_step_$name.json" \
              "$@" > "$OUT/serve_$name.log" 2>&1 &
            local pid=$!
            for _ in $(seq 600); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health')" 2>/dev/null && break
              kill -0 $pid 2>/dev/null || break; sleep 1; done
            grep -e "decode step" -e rror "$OUT/serve_$name.log"
            if [ "$name" = prefix_on ]; then
              python3 benchmarks/bench_serve.py --url "http://127.0.0.1:$port" --model flash-slice --concurrency 1 8 64 \
                --num-requests 64 --out "$OUT/bench_serve_random.json" || rc=1
            fi
            python3 benchmarks/bench_serve.py --url "http://127.0.0.1:$port" --model flash-slice --workload shared-prefix \
              --prefix-len 4096 --input-len 16 128 --output-len 32 128 --num-requests 32 --concurrency 8 \
              --out "$OUT/bench_serve_prefix_$name.json" || rc=1
            kill $pid; wait $pid 2>/dev/null
          }
          if [ "${SERVER:-1}" = 1 ]; then
            { serve_on 8000 prefix_on; serve_on 8001 prefix_off --no-prefix-cache; } 2>&1 | quiet | tee "$OUT/bench_serve.log"
          fi
          for cache in ${CACHES-bf16 fp8}; do  # the serving engine vs the static Generator ($CACHES: which caches)
             python3 benchmarks/bench_engine.py --config flash-slice --kv-cache-dtype $cache ${PARTS:+--parts $PARTS} \
               ${REQUESTS:+--requests $REQUESTS} ${ADMIT_WAIT:+--admit-wait $ADMIT_WAIT} ${ADMIT_ORDER:+--admit-order $ADMIT_ORDER} \
               --out "$OUT/bench_engine_$cache${ADMIT_WAIT:+_wait${ADMIT_WAIT// /_}}.json" 2>&1 | quiet || rc=1
           done | tee "$OUT/bench_engine.log" ;;
    ops) { [ "${OVERHEAD:-}" = only ] || python3 benchmarks/bench_ops.py --quick --out "$OUT/bench_ops" || rc=1
           python3 benchmarks/bench_op_overhead.py --device cuda --out "$OUT/bench_op_overhead.json" || rc=1
           if [ -n "${FLASHMLA:-}" ]; then
             build_flashmla || rc=1
             python3 benchmarks/bench_flashmla.py --flashmla "$FLASHMLA" --out "$OUT/bench_flashmla.json" || rc=1
           fi; } 2>&1 | quiet | tee "$OUT/bench_ops.log" | grep -e "^|" -e rror -e FlashMLA ;;
    ab) base=$(realpath "${BASE:?set BASE to the other tree}")
        for round in $(seq "${ROUNDS:-1}"); do
          for tree in "$base" "$PWD"; do
            name=$([ "$tree" = "$PWD" ] && echo head || echo base)
            echo "--- round $round: $name"
            flash_b1 "$tree" "ab_flash_${name}_r$round" || rc=1
            attn_grid "$tree" "ab_ops_${name}_r$round" || rc=1
          done
        done 2>&1 | tee "$OUT/ab.log" ;;
    profile) if [ "${PROFILE:-decode}" = prefill ]; then  # where time to first token goes: 1 x 4K, then 8 x 1K
               { python3 tools/profile_step.py --config flash-slice --parts prefill --out "$OUT/profile_prefill_1x4k.json" &&
                 python3 tools/profile_step.py --config flash-slice --parts prefill --prefill-chunk 4096 \
                   --out "$OUT/profile_prefill_1x4k_chunk4096.json" &&
                 python3 tools/profile_step.py --config flash-slice --parts prefill --batch 8 --context 1024 \
                   --out "$OUT/profile_prefill_8x1k.json"; } 2>&1 | quiet | tee "$OUT/profile.log" | grep "^prefill" || rc=1
               continue
             fi
             { python3 tools/profile_step.py --config flash-slice --batch 1 --context 4096 --out "$OUT/profile_flash_4k.json" &&
               python3 tools/profile_step.py --config flash-slice --batch 1 --context 32768 --out "$OUT/profile_flash_32k.json"; } \
             2>&1 | quiet | tee "$OUT/profile.log" | grep -v "^ " || rc=1 ;;
    sweep) python3 tools/sweep_kernels.py --only ${SWEEP:-attention scores topk} --batches 1 64 --out "$OUT/sweep.json" 2>&1 \
             | quiet | tee "$OUT/sweep.log" | grep -e best -e rror || rc=1 ;;
    ncu) if [ "${NCU:-triton}" = gluon ]; then
           ncu --clock-control none -k regex:sparse_attention_gluon --launch-skip 3 --launch-count 1 --set full \
               --import-source no -f -o "$OUT/ncu" python3 tools/ncu_gluon.py --caches bf16 fp8 > "$OUT/ncu.log" 2>&1 || rc=1
         else
           ncu --clock-control none -k 'regex:sparse_attention_kernel|combine_kernel|indexer_scores_kernel|topk_row_kernel' \
               --launch-skip 4 --launch-count 4 --set full -f -o "$OUT/ncu" python3 tools/ncu_kernels.py > "$OUT/ncu.log" 2>&1 || rc=1
         fi
         ncu -i "$OUT/ncu.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
         ncu -i "$OUT/ncu.ncu-rep" --page source --print-source sass --csv 2>/dev/null | gzip > "$OUT/ncu_sass.csv.gz"
         python3 tools/ncu_summary.py --top 40 "$OUT/ncu_sass.csv.gz" > "$OUT/ncu_summary.txt" || rc=1
         grep -e "Duration" -e "Memory Throughput" -e "DRAM Throughput" -e "Compute (SM) Throughput" "$OUT/ncu_details.txt" | head -40 ;;
    tp) n=$(nvidia-smi -L | wc -l)
        if [ "$n" -lt 2 ]; then echo "tp needs 2 GPUs, this machine has $n"; rc=1; continue; fi
        { NCCL_NVLS_ENABLE=0 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m dsv4_ops.parallel.demo &&
          NCCL_NVLS_ENABLE=0 python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_tp.py \
            --out "$OUT/bench_tp.json"; } 2>&1 | quiet | tee "$OUT/bench_tp.log" || rc=1 ;;
    *) echo "unknown mode $what (tests|model|hf|aoti|spec|serve|ops|ab|profile|sweep|ncu|tp)"; rc=2 ;;
  esac
done
save_compile_cache
exit $rc
