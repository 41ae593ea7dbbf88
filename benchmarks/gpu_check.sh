#!/usr/bin/env bash
# The GPU check on the GPU box (device tool):  bash benchmarks/gpu_check.sh MODE [MODE ...]
#   tests   = every `gpu` test (full log: $OUT/gpu_tests.log) + the Triton kernel tests on real kernels
#             ($OUT/triton_tests.log); pytest-xdist when present
#   demo    = python -m dsv4_ops demo (eager / compiled / CUDA graphs)
#   bench   = model benchmark through the public Generator (benchmarks/bench_model.py: graphs at batch 1, 8, 64 x
#             4K, 32K, eager + compiled at 1 x 4K, HF transformers eager; ~4-5 min cold)
#   bench-b1 = the Generator decode row at batch 1 x 4K only (the AOTI comparison point)
#   flash   = the same benchmark on the "Flash slice" (bench_model.py --config flash-slice: 68 GB bf16, 256 experts
#             top-6) at batch 1, 8, 64 x 4K, eager + compiled at 1 x 4K; not yet timed on the H200
#   aoti    = dsv4_ops.export + AOTIGenerator at batch 1 x 4K (bench_model.py --aoti; LD_PRELOAD set), then the C++
#             runner build/dsv4_run on the same package (prefill 4K, 255 decode steps, CUDA graph), twice
#   hf      = HF generate unpatched vs dsv4_ops.hf.enable (eager, compiled) vs Generator, B=1 and 32
#             (benchmarks/bench_hf.py)
#   spec    = speculative decoding through Generator(spec_steps=k).generate (benchmarks/bench_spec.py; ~5 min cold)
#   moe     = routed experts of 1-8 tokens at Flash widths: dsv4::moe_gemv vs the grouped GEMM path vs the bytes
#             floor, after a launch-config sweep at batch 1 (benchmarks/bench_moe.py --sweep), + the moe_gemv GPU tests
#   flash-spec = the Flash slice's decode step inside generate at batch 1 (plain, k = 1, 3; bench_spec.py, ctx 2K)
#   flash-hf = the Flash slice's public decode at batch 1, 8 x 4K, then HF transformers eager on the same config
#             (built in bf16 on the GPU) at 1 x 4K: prefill time and decode step
#   load    = an official-format (FP8 + FP4, ue8m0, 16 shards) Flash-slice checkpoint written to /tmp, then
#             dsv4_ops.load_pretrained onto the GPU: seconds, peak host RSS, peak GPU memory (benchmarks/bench_load.py)
#   flash-32k = the Flash slice's public decode at batch 1, 8 x 32K (the rows the batch-1 / 8 expert path changed)
#   gpu-tests = the `gpu` tests only (the first half of `tests`)
#   files-tests = the test files named in $TESTS, gpu and cpu tests alike, on the GPU
#   fp8-tests = the FP8-cache tests on the GPU: the model tests' cuda half and the FP8 kernels compiled (not
#             interpreted) against the reference, bit for bit
#   fp8-kernels = the FP8 kernels compiled (not interpreted) against the reference only (tests/test_triton_interp_fp8.py)
#   flash-b1 = the Flash slice's decode step inside generate at batch 1 x 4K and 32K (bench_spec.py, plain only)
#   flash-fp8 = the Flash slice's public decode with kv_cache_dtype bf16 vs fp8 at batch 1 x 4K and 32K
#   kv-capacity = the longest context whose pool allocates and runs, bf16 vs fp8 (benchmarks/kv_capacity.py,
#             Flash slice, batch 64, 8-token prefill chunks so the indexer's scores [B, chunk, ctx/4] stay small)
#   kv-capacity-64 = the same with 64-token prefill chunks (the indexer's token groups; session 8 without them: 1.57x)
#   profile = kernels of the public decode call and of one k=3 speculative step (benchmarks/profile_step.py)
#   profile-flash = the same for the Flash slice's batch-1 public decode at 4K and at 32K (kernels by name)
#   ops     = per-kernel benchmark, quick grid (benchmarks/bench_ops.py --quick); ops-full = whole grid
#   gemv    = dense decode projections at Flash widths, 1-8 tokens: dsv4::gemv vs cuBLAS vs the bytes floor, after a
#             launch-config sweep at one token (benchmarks/bench_gemv.py --sweep), + the gemv tests on the GPU
#   ops-fp8 = per-kernel benchmark of the cache readers with a bf16 vs an FP8 KV cache (issue #15): sparse_attention
#             CSA + HCA and indexer_topk, Flash widths, batch 1, 64, 128 x context 32K, 128K (36 cases)
#   sweep-sinkhorn = the Sinkhorn kernel's matrices per program and warps at T = 1, 64 (decode) and 1024, 65536 (prefill)
#   sweep-topk-b1 = the top-k pass at batch 1 and 8 over 8258 scores (the Flash slice's 32K pool): row kernel vs split
#             (both sweeps print every config's line: a call returns 8 files, and session 10 lost a sweep log that way)
#   sweep-fp8 = the FP8 readers (attention CSA / HCA, indexer scores) at batch 64 x 32K by decode (E4M3_HW) and stages
#   sweep-topk-rows = the top-k pass at 16, 64, 128 rows x 8192 scores: row kernel vs split top-k
#   gluon-check = the Gluon decode attention (lowering/gluon) against the reference and the tl kernel at B = 1, 64,
#             128, then every variant's configs swept at B = 64, 128 (benchmarks/gluon_attention_check.py --sweep)
#   gluon-ws = the warp-specialised attention (variant ws, opt-in): the model test's decode call by call with it routed
#             (benchmarks/ws_model_diag.py: the model's output vs a fresh launch, ws and v3 vs the oracle), the race check
#             (benchmarks/attention_repeatability.py), the sm_90 attention tests with it routed, then the v3 / ws sweep
#   smem-poison = the Gluon attention kernels (v3, ws, the FP8 reader) with every SM's shared memory filled with NaN
#             before each launch (tests/smem_poison.py): a read of shared memory before its writers stored it fails
#   gluon-diagnose = where the Gluon kernel's time goes: the default vs each stage left out (no gather, no P @ rows,
#             no softmax, no index loads, one block, no block) at B = 64, 128 (--diagnose; results not checked)
#   attn-check = after a change to the Gluon attention: its sm_90 tests (the poisoned-shared-memory ones alone first),
#             the FP8 reader's exactness + times, the gpu-marked FP8-cache model / route / trace tests, and the
#             public op's grid for bf16 and FP8 caches at B = 1, 64, 128 x 32K, 128K (~6 min)
#   gluon-fp8-check = the Gluon FP8-cache decode attention (lowering/gluon/sparse_attention_fp8.py, never run before):
#             an exact one-entry check, then CSA / dense-prefix / float-window cases against the tl kernel and the
#             reference at B = 1, 64, 128 (benchmarks/gluon_fp8_attention_check.py; ~4-6 min)
#   sweep-indexer-fused = the whole indexer_topk at 64, 128 rows x 8192, 32768 keys (32K, 128K context): unfused
#             (scores, then the separate top-k) vs the fused top-k by chunk 1024-8192 and warps, every line printed
#   pdl     = Inductor's PDL (Generator(pdl=True)): tests/test_generator_pdl.py + tests/test_cuda_graphs.py, then the
#             Generator's decode at batch 1, 64 x 4K without it (graphs) and with it (graphs-pdl)
#   topk-cuda = the CUDA top-k (csrc/kernels/topk_rows.cu, built by nvcc on first use): its GPU tests, then its time
#             against the Triton top-k's stages at 1, 64, 128 rows x 8192, 32768 scores (benchmarks/topk_diag.py)
#   topk-ab = the CUDA top-k against another version of its source, $TOPK_BASE (e.g. `git show
#             HEAD~1:csrc/kernels/topk_rows.cu > ab/base.cu`, an untracked file travels), on the bench cases' scores
#             and Gaussian rows, in turns (benchmarks/topk_ab.py; picks checked equal first)
#   indexer-diag = the public indexer_topk at B = 64, 128 x 32K, 128K, bf16 and FP8 keys, split into its scores pass
#             and its CUDA top-k (alone, on the op's own scores and on Gaussian rows), the top-k's stages and how many
#             select passes its rows took, FP8 keys also with the decoded dot (the e4m3 dot's error, the picks both
#             make) (benchmarks/indexer_diag.py); indexer-sweep = the same + the scores pass by
#             CHUNK x stages x warps x BLOCK_N (each config's scores checked against the default's)
#   gather-bw = how fast the H200 reads the attention's random 1 KB rows, and contiguous ones
#             (benchmarks/gather_bandwidth.py: the achievable gather floor at B = 64, 128)
#   sweep   = launch-config sweep of attention, indexer scores and top-k (benchmarks/sweep_kernels.py);
#             sweep-indexer = the indexer part only; sweep-attention = the attention part only (B=64, 128),
#             sweep-attention-small = its split count at B=1, 16
#   tp      = 2 GPUs (nvidia-h200-x2): the torchrun demo (dsv4_ops.parallel.demo, tiny), then decode at batch 1 and 64
#             on the Flash slice with all 256 experts, sharded over 2 GPUs vs 1 (benchmarks/bench_tp.py), NCCL with
#             NVLink multicast off
#   ncu     = Nsight Compute profile (--set full) of attention, combine, indexer scores and top-k at
#             B=64 x 32K (benchmarks/ncu_kernels.py): report + details page + per-instruction SASS CSV
#             + where the samples fall (benchmarks/ncu_summary.py)
#   ncu-gluon = the same for the routed Gluon FP8 ws attention (CSA B=128 x 32K, the public op;
#             benchmarks/ncu_gluon.py): details page, SASS CSV and its summary (40 instructions);
#             ncu-gluon-bf16 = the same for the bf16 ws attention
# Every mode tees its log into $OUT (or ./out) next to its JSON; $OUT/gpu.txt names the machine. The device
# tool returns at most 8 files per call: `tests bench` (5 files) or `spec profile` (5) fit; `ops` adds 4.
# One device call runs at most 10 minutes. Commit each run's logs under benchmarks/results/ (h200_<what>.log).
# Uses the machine's torch (2.11+cu130); carried wheels in .whl/ (transformers>=5.23, expecttest) go to /tmp/site.
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
# ncu_gluon NAME SKIP ARGS...: Nsight Compute (--set full) of one sparse_attention_gluon launch of
# benchmarks/ncu_gluon.py ARGS after SKIP of them; report, details page, SASS CSV and its 40-line summary as $OUT/NAME*
ncu_gluon() {
  local name=$1 skip=$2; shift 2
  ncu --clock-control none -k regex:sparse_attention_gluon --launch-skip "$skip" --launch-count 1 --set full \
      --import-source no -f -o "$OUT/$name" python3 benchmarks/ncu_gluon.py "$@" > "$OUT/$name.log" 2>&1 \
      || { rc=1; tail -20 "$OUT/$name.log"; }
  ncu -i "$OUT/$name.ncu-rep" --page details > "$OUT/${name}_details.txt" 2>&1
  ncu -i "$OUT/$name.ncu-rep" --page source --print-source sass --csv 2>/dev/null | gzip > "$OUT/${name}_sass.csv.gz"
  python3 benchmarks/ncu_summary.py --top 40 "$OUT/${name}_sass.csv.gz" > "$OUT/${name}_summary.txt" || rc=1
  grep -e "sparse_attention_gluon" -e "Duration" -e "Memory Throughput" -e "DRAM Throughput" \
       -e "Compute (SM) Throughput" -e "Registers Per" -e "Shared Memory Configuration Size" \
       "$OUT/${name}_details.txt" | head -40
}
# line-buffered: a mode cut by the device call's time limit keeps the lines it printed (session 9 lost one)
quiet() { grep --line-buffered -v -e Warning -e warnings.warn -e "Online softmax" -e "split the reduction" -e "important use case" -e "^softmax\.$" -e '^\s*$'; }
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
    hf) python3 benchmarks/bench_hf.py --out "$OUT/bench_hf.json" 2>&1 | quiet | tee "$OUT/bench_hf.log" || rc=1 ;;
    bench) python3 benchmarks/bench_model.py --out "$OUT/bench_model.json" 2>&1 | quiet | tee "$OUT/bench_model.log" || rc=1 ;;
    flash) python3 benchmarks/bench_model.py --config flash-slice --contexts 4096 --out "$OUT/bench_flash_slice.json" \
             2>&1 | quiet | tee "$OUT/bench_flash_slice.log" || rc=1 ;;
    bench-b1) # the Generator's CUDA-graphed decode at batch 1 x 4K only (the AOTI comparison point)
          python3 benchmarks/bench_model.py --batches 1 --contexts 4096 --compare-at --hf-points \
            --out "$OUT/bench_model_b1.json" 2>&1 | quiet | tee "$OUT/bench_model_b1.log" || rc=1 ;;
    aoti) # export + AOTIGenerator at batch 1 x 4K, then the C++ runner on the same package. torch 2.11: loading
          # an AOTI package needs the system libstdc++ (newer than the one torch was linked against)
          pre=/usr/lib/x86_64-linux-gnu/libstdc++.so.6; [ -f $pre ] || pre=
          LD_PRELOAD=$pre python3 benchmarks/bench_model.py --aoti --batches 1 --contexts 4096 --aoti-dir /tmp/dsv4_aoti \
            --out "$OUT/bench_model_aoti.json" 2>&1 | quiet | tee "$OUT/bench_model_aoti.log" || rc=1
          { make runner RUNNER_PY=python3 >/dev/null &&
            prompt=$(python3 -c "import torch; g = torch.Generator().manual_seed(1001); print(','.join(map(str, torch.randint(0, 129280, (4096,), generator=g).tolist())))") &&
            for i in 1 2; do LD_PRELOAD=$pre build/dsv4_run /tmp/dsv4_aoti/bench_b1.pt2 --prompt "$prompt" --max-new-tokens 256 >/dev/null; done; } \
            2>&1 | tee -a "$OUT/bench_model_aoti.log" || rc=1 ;;
    moe) { python3 benchmarks/bench_moe.py --sweep --out "$OUT/bench_moe.json" &&
           python3 -m pytest -q -m gpu tests/ops/test_moe_gemv.py -p no:cacheprovider; } 2>&1 | quiet \
           | tee "$OUT/bench_moe.log" | grep -v "^\[sweep\] [0-9]" || rc=1 ;;
    flash-spec) python3 benchmarks/bench_spec.py --config flash-slice --batches 1 --ks 1 3 --context 2048 --samples 3 \
           --out "$OUT/bench_spec_flash_b1.json" 2>&1 | quiet | tee "$OUT/bench_spec_flash_b1.log" || rc=1 ;;
    flash-32k) python3 benchmarks/bench_model.py --config flash-slice --batches 1 8 --contexts 32768 --compare-at \
           --iters 30 --out "$OUT/bench_flash_32k.json" 2>&1 | quiet | tee "$OUT/bench_flash_32k.log" || rc=1 ;;
    fp8-tests) # the model file's CUDA tests only (its CPU-compiled recompile test runs in CI and took most of a
           # device call in session 11), then the FP8 kernels compiled
           { python3 -m pytest -q -m "gpu or not gpu" tests/test_fp8_cache_model.py -k "cuda or v4_attention" \
               -p no:cacheprovider && python3 -m pytest -q tests/test_triton_interp_fp8.py -p no:cacheprovider; } 2>&1 \
           | tee "$OUT/fp8_tests.log" | grep -e passed -e failed -e Error || rc=1 ;;
    fp8-kernels) python3 -m pytest -q -m "gpu or not gpu" tests/test_triton_interp_fp8.py -p no:cacheprovider 2>&1 \
           | tee "$OUT/fp8_kernels.log" | tail -3 || rc=1 ;;
    # 256 steps between the two generate lengths: the step is a difference of two calls that each
    # prefill the context, and at 32K a 0.3% jitter of the 1.35 s prefill over 64 steps is 0.06 ms
    flash-b1) python3 benchmarks/bench_spec.py --config flash-slice --batches 1 --ks --context 4096 32768 --samples 5 \
           --new-tokens 8 264 \
           --out "$OUT/bench_spec_flash_b1_ctx.json" 2>&1 | quiet | tee "$OUT/bench_spec_flash_b1_ctx.log" || rc=1 ;;
    flash-fp8) python3 benchmarks/bench_model.py --config flash-slice --batches 1 --contexts 4096 32768 --iters 30 \
                 --prefill-samples 2 --kv-cache-dtype bf16 fp8 --out "$OUT/bench_flash_fp8_b1.json" 2>&1 | quiet \
                 | tee "$OUT/bench_flash_fp8.log" || rc=1 ;;
    kv-capacity-64) # the same with 64-token prefill chunks: the indexer scores them in token groups once
           # [B, 64, ctx/4] fp32 passes 4 GiB (lowering/triton/indexer.py SCORES_BUDGET_BYTES)
           python3 benchmarks/kv_capacity.py --config flash-slice --batches 64 --fill 64 --prefill-chunk 64 --step 131072 \
           --out "$OUT/kv_capacity_chunk64.json" 2>&1 | quiet | tee "$OUT/kv_capacity_chunk64.log" || rc=1 ;;
    kv-capacity) python3 benchmarks/kv_capacity.py --config flash-slice --batches 64 --fill 64 --prefill-chunk 8 --step 131072 \
           --out "$OUT/kv_capacity.json" 2>&1 | quiet | tee "$OUT/kv_capacity.log" || rc=1 ;;
    files-tests) # TESTS="tests/a.py tests/b.py": those files, gpu and cpu tests, on the GPU (kernels compiled)
           python3 -m pytest -q -m "gpu or not gpu" ${TESTS:?set TESTS to the test files} -p no:cacheprovider 2>&1 \
           | tee "$OUT/files_tests.log" | grep -e passed -e failed -e Error -e FAIL | tail -20 || rc=1 ;;
    gpu-tests) OMP_NUM_THREADS=$(( $(nproc) / 6 > 0 ? $(nproc) / 6 : 1 )) python3 -m pytest -q ${xdist:+-n 6} -m gpu tests \
        -p no:cacheprovider --durations=12 2>&1 | tee "$OUT/gpu_tests.log" | tail -32 || rc=1 ;;
    flash-hf) python3 benchmarks/bench_model.py --config flash-slice --batches 1 8 --contexts 4096 --hf-points 1x4096 \
           --hf-budget-s 600 --out "$OUT/bench_flash_hf.json" 2>&1 | quiet | tee "$OUT/bench_flash_hf.log" || rc=1 ;;
    load) python3 benchmarks/bench_load.py --dir /tmp/dsv4_flash_ckpt --out "$OUT/bench_load.json" 2>&1 | quiet \
           | tee "$OUT/bench_load.log" || rc=1; rm -rf /tmp/dsv4_flash_ckpt ;;
    spec) python3 benchmarks/bench_spec.py --out "$OUT/bench_spec.json" 2>&1 | quiet | tee "$OUT/bench_spec.log" || rc=1 ;;
    profile-flash) # where the Flash slice's batch-1 step goes at 4K and at 32K (what grows with the context)
           { python3 benchmarks/profile_step.py --config flash-slice --batch 1 --context 4096 --out "$OUT/profile_flash_4k.json" &&
             python3 benchmarks/profile_step.py --config flash-slice --batch 1 --context 32768 --out "$OUT/profile_flash_32k.json"; } \
           2>&1 | quiet | tee "$OUT/profile_flash.log" | grep -v "^ " || rc=1 ;;
    profile) python3 benchmarks/profile_step.py --batch 1 --context 4096 --spec 3 --out "$OUT/profile_b1.json" 2>&1 \
               | quiet | tee "$OUT/profile.log" || rc=1 ;;
    sweep-sinkhorn) python3 benchmarks/sweep_kernels.py --only sinkhorn --batches 1 64 --out "$OUT/sweep_sinkhorn.json" 2>&1 \
           | quiet | tee "$OUT/sweep_sinkhorn.log" | grep -e "] *\[" -e best -e Error || rc=1 ;;
    sweep-topk-b1) # the top-k of a batch-1 / 8 decode step over the Flash slice's 32K pool (8258 entries: max_seq_len
           # 32K + 264, as flash-b1 runs it): one program per row vs the split top-k
           python3 benchmarks/sweep_kernels.py --only topk --batches 1 8 --ctx 33032 --out "$OUT/sweep_topk_b1.json" 2>&1 \
           | quiet | tee "$OUT/sweep_topk_b1.log" | grep -e "] *\[" -e best -e Error || rc=1 ;;
    sweep-fp8) # the FP8 readers at batch 64 x 32K: attention (Flash CSA, HCA) and indexer scores, by decode and stages
           python3 benchmarks/sweep_kernels.py --only fp8 --batches 64 --out "$OUT/sweep_fp8.json" 2>&1 \
           | quiet | tee "$OUT/sweep_fp8.log" | grep -e "] *\[" -e best -e Error || rc=1 ;;
    sweep-topk-rows) # the top-k pass at 16, 64, 128 rows over 8192 scores (32K context): row kernel vs split
           python3 benchmarks/sweep_kernels.py --only topk --batches 16 64 128 --out "$OUT/sweep_topk_rows.json" 2>&1 \
           | quiet | tee "$OUT/sweep_topk_rows.log" | grep -e "] *\[" -e best -e Error || rc=1 ;;
    pdl) # Inductor's PDL for the compiled steps' kernels (Generator(pdl=True); off by default): its GPU tests and the
         # CUDA-graph ones, then the Generator's decode without and with it at batch 1, 64 x 4K (bench_model.py)
      { python3 -m pytest -q -p no:cacheprovider tests/test_generator_pdl.py tests/test_cuda_graphs.py \
          tests/ops/test_topk_rows_cuda.py tests/ops/test_sparse_attention_sm90.py -k "pdl or graph or model" 2>&1 \
          | grep -v -e DEBUG -e "^\s*$" | tail -25
        python3 benchmarks/bench_model.py --batches 1 64 --contexts 4096 --modes graphs graphs-pdl --compare-at \
          --hf-points --out "$OUT/bench_model_pdl.json" 2>&1 | quiet | grep -e "decode" -e "prefill" -e "|"; } 2>&1 \
        | tee "$OUT/pdl.log" || rc=1 ;;
    topk-cuda) { python3 -m pytest -q -p no:cacheprovider tests/ops/test_topk_rows_cuda.py 2>&1 | tail -5 \
           && python3 benchmarks/topk_diag.py --rows 1 64 128 --n 8192 32768; } 2>&1 | tee "$OUT/topk_cuda.log" || rc=1 ;;
    topk-ab) python3 benchmarks/topk_ab.py --base "${TOPK_BASE:?set TOPK_BASE to the other topk_rows.cu}" 2>&1 \
           | tee "$OUT/topk_ab.log" || rc=1 ;;
    indexer-diag) python3 benchmarks/indexer_diag.py --batches 64 128 --contexts 32768 131072 2>&1 \
           | tee "$OUT/indexer_diag.log" | grep -e "what=op" -e "what=scores" -e "what=topk " || rc=1 ;;
    indexer-sweep) python3 benchmarks/indexer_diag.py --batches 64 128 --contexts 32768 131072 --sweep 2>&1 \
           | tee "$OUT/indexer_sweep.log" | grep -v scores_sweep || rc=1 ;;
    gather-bw) python3 benchmarks/gather_bandwidth.py 2>&1 | tee "$OUT/gather_bandwidth.log" || rc=1 ;;
    gluon-check) python3 benchmarks/gluon_attention_check.py --sweep 2>&1 | tee "$OUT/gluon_check.log" \
           | grep -v "^\.\.\." | tail -60 || rc=1 ;;
    gluon-ws) { DSV4_OPS_GLUON_VARIANT=ws python3 benchmarks/ws_model_diag.py 2>&1 | quiet
           python3 benchmarks/attention_repeatability.py --repeats 20 2>&1 | tail -3
           DSV4_OPS_GLUON_VARIANT=ws python3 -m pytest -q -s -p no:cacheprovider tests/ops/test_sparse_attention_sm90.py 2>&1 \
             | grep -e passed -e failed -e "rel err"
           python3 benchmarks/gluon_attention_check.py --sweep --variants v3 ws --variant ws --modes csa 2>&1 \
             | grep -v "^\.\.\."; } 2>&1 | tee "$OUT/gluon_ws.log" || rc=1 ;;
    smem-poison) python3 -m pytest -q -p no:cacheprovider -k shared_memory tests/ops/test_sparse_attention_sm90.py \
           tests/ops/test_sparse_attention_sm90_fp8.py 2>&1 | tee "$OUT/smem_poison.log" | tail -15 || rc=1 ;;
    gluon-diagnose) python3 benchmarks/gluon_attention_check.py --diagnose 2>&1 | tee "$OUT/gluon_diagnose.log" \
           | grep -v "^\.\.\." || rc=1 ;;
    gluon-fp8-check) python3 benchmarks/gluon_fp8_attention_check.py 2>&1 | tee "$OUT/gluon_fp8_check.log" \
           | grep -v "^\.\.\." | tail -60 || rc=1 ;;
    sweep-indexer-fused) # indexer_topk at 64, 128 rows x 32K, 128K context: unfused vs fused top-k by chunk
           python3 benchmarks/sweep_kernels.py --only fused --batches 64 128 --target-ms 20 \
               --out "$OUT/sweep_indexer_fused.json" 2>&1 \
           | quiet | tee "$OUT/sweep_indexer_fused.log" | grep -e "] *\[" -e best -e rule -e rror || rc=1 ;;
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
    ncu-gluon) # the routed Gluon attentions at B=128 x 32K, CSA: stall reasons per instruction (the FP8 ws kernel,
               # its second launch: the two bf16 launches and its first are skipped)
         ncu_gluon ncu_gluon 3 --caches bf16 fp8 ;;
    ncu-gluon-bf16) # the same for the bf16 ws kernel (its second launch; the first compiles)
         ncu_gluon ncu_gluon_bf16 1 --caches bf16 ;;
    tp) n=$(nvidia-smi -L | wc -l)
        if [ "$n" -lt 2 ]; then echo "tp needs 2 GPUs, this machine has $n"; rc=1; continue; fi
        { NCCL_NVLS_ENABLE=0 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m dsv4_ops.parallel.demo &&
          NCCL_NVLS_ENABLE=0 python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_tp.py \
            --out "$OUT/bench_tp.json"; } 2>&1 | quiet | tee "$OUT/bench_tp.log" || rc=1 ;;
    ops) python3 benchmarks/bench_ops.py --quick --out "$OUT/bench_ops" 2>&1 | quiet | tee "$OUT/bench_ops.log" | tail -30 || rc=1 ;;
    ops-full) python3 benchmarks/bench_ops.py --out "$OUT/bench_ops" 2>&1 | quiet | tee "$OUT/bench_ops.log" | tail -60 || rc=1 ;;
    gemv) { python3 -m pytest -q -m "gpu or not gpu" tests/ops/test_gemv.py -p no:cacheprovider &&
            python3 benchmarks/bench_gemv.py --sweep --out "$OUT/bench_gemv.json"; } 2>&1 | quiet \
            | tee "$OUT/bench_gemv.log" | grep -v "^\[sweep\] [0-9]" || rc=1 ;;
    attn-check) # after a change to the Gluon attention (session 25's calls 3-4 in one): the poisoned-shared-memory tests
          # alone (-k shared_memory: other processes' kernels would clear the poison), the other sm_90 attention tests
          # under xdist, the FP8 reader's exactness and times, the gpu-marked FP8-cache model / route / trace tests,
          # then the public op's grid for both cache dtypes (7 files)
          { python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" -k shared_memory \
              tests/ops/test_sparse_attention_sm90.py tests/ops/test_sparse_attention_sm90_fp8.py 2>&1 | tail -3
            python3 -m pytest -q -p no:cacheprovider ${xdist:+-n 8} -m "gpu or not gpu" -k "not shared_memory" \
              tests/ops/test_sparse_attention_sm90.py tests/ops/test_sparse_attention_sm90_fp8.py 2>&1 | tail -5
            python3 -m pytest -q -p no:cacheprovider ${xdist:+-n 4} -m gpu tests/test_fp8_cache_model.py \
              tests/test_gluon_route_switch.py tests/test_triton_op_trace.py 2>&1 | tail -5; } \
            | tee "$OUT/attn_tests.log" | grep -e passed -e failed -e rror || rc=1
          python3 benchmarks/gluon_fp8_attention_check.py --variants ws --batches 1 64 128 2>&1 \
            | tee "$OUT/attn_fp8_check.log" | grep -v "^\.\.\." | tail -20 || rc=1
          python3 benchmarks/bench_ops.py --kernels sparse_attention --shapes flash --batches 1 64 128 --contexts 32K 128K \
              --kv-cache-dtype bf16 fp8 --out "$OUT/bench_ops_attn" 2>&1 | quiet | tee "$OUT/bench_ops_attn.log" \
            | tail -28 || rc=1 ;;
    ops-fp8) python3 benchmarks/bench_ops.py --kernels sparse_attention indexer_topk --shapes flash --batches 1 64 128 \
               --contexts 32K 128K --kv-cache-dtype bf16 fp8 --out "$OUT/bench_ops_fp8" 2>&1 | quiet \
               | tee "$OUT/bench_ops_fp8.log" | tail -40 || rc=1 ;;
    *) echo "unknown mode $what (tests|gpu-tests|fp8-tests|fp8-kernels|flash-b1|flash-fp8|kv-capacity|kv-capacity-64|moe|flash-spec|flash-hf|flash-32k|load|demo|bench|flash|bench-b1|aoti|spec|profile|profile-flash|tp|ops|ops-full|ops-fp8|gemv|sweep|sweep-fp8|sweep-topk-rows|sweep-indexer-fused|gluon-check|gluon-ws|gluon-diagnose|gluon-fp8-check|attn-check|topk-cuda|topk-ab|gather-bw|pdl|indexer-diag|indexer-sweep|sweep-indexer|sweep-attention|sweep-attention-small|ncu|ncu-gluon|hf|files-tests|smem-poison|sweep-sinkhorn|sweep-topk-b1|ncu-gluon-bf16)"; rc=2 ;;
  esac
done
exit $rc
