#!/usr/bin/env bash
# The GPU check on the GPU box (device tool):  bash benchmarks/gpu_check.sh MODE [MODE ...]
#   tests   = every `gpu` test + the Triton kernel tests on real kernels (pytest-xdist when present)
#   demo    = python -m dsv4_ops demo (eager / compiled / CUDA graphs)
#   bench   = model benchmark (benchmarks/bench_model.py, with HF transformers eager)
#   spec    = speculative-step benchmark (benchmarks/bench_spec.py)
#   profile = kernels of one CUDA-graphed decode and k=3 speculative step (benchmarks/profile_step.py)
#   ops     = per-kernel benchmark, quick grid (python -m dsv4_ops bench --quick); ops-full = whole grid
#   sweep   = launch-config sweep of attention, indexer scores and top-k (benchmarks/sweep_kernels.py);
#             sweep-indexer = the indexer part only; sweep-attention = the attention part only (B=64, 128),
#             sweep-attention-small = its split count at B=1, 16
#   ncu     = Nsight Compute profile (--set full) of attention, combine, indexer scores and top-k at
#             B=64 x 32K (benchmarks/ncu_kernels.py): report + details page + per-instruction SASS CSV
#             + where the samples fall (benchmarks/ncu_summary.py)
# One device call runs at most 10 minutes: `tests bench` fits in one call, `spec profile ops` in
# another (H200, cold caches). Uses the machine's torch (2.11+cu130); carried wheels in .whl/
# (transformers>=5.23, expecttest) go to /tmp/site. Logs and results land in $OUT (or ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
[ $# -gt 0 ] || set -- tests bench
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
xdist=$(python3 -c "import xdist" 2>/dev/null && echo yes)
quiet() { grep -v -e Warning -e warnings.warn -e "Online softmax" -e "split the reduction" -e "important use case" -e "^softmax\.$" -e '^\s*$'; }
rc=0
for what in "$@"; do
  echo "=== $what ($(date +%T))"
  case $what in
    tests)
      # the parity tests run HF on the CPU: one thread pool per worker, not 4 x all cores
      OMP_NUM_THREADS=$(( $(nproc) / 6 > 0 ? $(nproc) / 6 : 1 )) python3 -m pytest -q ${xdist:+-n 6} -m gpu tests \
        -p no:cacheprovider --durations=12 2>&1 | tee "$OUT/gpu_tests.log" | tail -32 || rc=1
      python3 -m pytest -q tests/test_triton_interp.py tests/test_triton_interp_more.py -p no:cacheprovider 2>&1 \
        | tee "$OUT/triton_tests.log" | tail -3 || rc=1 ;;
    demo) python3 -m dsv4_ops demo --max-new-tokens 32 2>&1 | quiet | tee "$OUT/demo.log" || rc=1 ;;
    bench) python3 benchmarks/bench_model.py --out "$OUT/bench_model.json" 2>&1 | quiet | tee "$OUT/bench_model.log" || rc=1 ;;
    spec) (cd benchmarks && python3 bench_spec.py --out "$OUT/bench_spec.json") 2>&1 | quiet | tee "$OUT/bench_spec.log" || rc=1 ;;
    profile) (cd benchmarks && python3 profile_step.py --batch 1 --context 4096 --spec 3 --out "$OUT/profile_b1.json") 2>&1 \
               | quiet | tee "$OUT/profile.log" || rc=1 ;;
    sweep-indexer) { python3 benchmarks/sweep_kernels.py --batches 64 --only scores topk --out "$OUT/sweep_ix_b64.json" &&
             python3 benchmarks/sweep_kernels.py --batches 1 --only scores topk --out "$OUT/sweep_ix_b1.json"; } 2>&1 \
             | quiet | tee "$OUT/sweep_ix.log" | grep -e best -e rror || rc=1 ;;
    sweep) { python3 benchmarks/sweep_kernels.py --batches 64 --out "$OUT/sweep_b64.json" &&
             python3 benchmarks/sweep_kernels.py --batches 1 --only scores topk --out "$OUT/sweep_b1.json"; } 2>&1 \
             | quiet | tee "$OUT/sweep.log" | grep -e best -e rror || rc=1 ;;
    sweep-attention) python3 benchmarks/sweep_kernels.py --batches 64 128 --only attention --out "$OUT/sweep_attn.json" 2>&1 \
             | quiet | tee "$OUT/sweep_attn.log" | grep -e best -e rror || rc=1 ;;
    sweep-attention-small) python3 benchmarks/sweep_kernels.py --batches 1 16 --only attention --out "$OUT/sweep_attn_small.json" \
             2>&1 | quiet | tee "$OUT/sweep_attn_small.log" | grep -e best -e rror || rc=1 ;;
    ncu) kernels='regex:sparse_attention_kernel|combine_kernel|indexer_scores_kernel|topk_row_kernel'
         ncu --clock-control none -k "$kernels" --launch-skip 4 --launch-count 4 --set full -f -o "$OUT/ncu_kernels" \
             python3 benchmarks/ncu_kernels.py > "$OUT/ncu.log" 2>&1 || { rc=1; tail -20 "$OUT/ncu.log"; }
         ncu -i "$OUT/ncu_kernels.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
         ncu -i "$OUT/ncu_kernels.ncu-rep" --page source --print-source sass --csv 2>/dev/null | gzip > "$OUT/ncu_sass.csv.gz"
         python3 benchmarks/ncu_summary.py "$OUT/ncu_sass.csv.gz" > "$OUT/ncu_summary.txt" || rc=1
         grep -e "sparse_attention_kernel\|combine_kernel\|indexer_scores_kernel\|topk_row_kernel" -e "Duration" \
              -e "Memory Throughput" -e "DRAM Throughput" -e "Compute (SM) Throughput" "$OUT/ncu_details.txt" | head -40 ;;
    ops) python3 -m dsv4_ops bench --quick --out "$OUT/bench_ops" 2>&1 | quiet | tail -30 || rc=1 ;;
    ops-full) python3 -m dsv4_ops bench --out "$OUT/bench_ops" 2>&1 | quiet | tail -60 || rc=1 ;;
    *) echo "unknown mode $what (tests|demo|bench|spec|profile|ops|ops-full|sweep|sweep-indexer|sweep-attention|sweep-attention-small|ncu)"; rc=2 ;;
  esac
done
exit $rc
