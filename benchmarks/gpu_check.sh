#!/usr/bin/env bash
# The GPU check on the GPU box (device tool):  bash benchmarks/gpu_check.sh [tests|quick|bench|spec|ops|all]
#   tests = gpu tests + Triton kernel tests + demo;  quick = gpu tests + demo + model benchmark;
#   bench = model benchmark;  spec = speculative-step benchmark;  ops = per-kernel benchmark (--quick grid).
# One device call runs at most 10 minutes: `quick` then `spec` + `ops` fit in two calls; `all` does not.
# Uses the machine's torch (2.11+cu130); carried wheels in .whl/ (transformers>=5.23, expecttest)
# go to /tmp/site. Logs and results land in $OUT (or ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
what=${1:-all}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
rc=0
if [ "$what" = tests ] || [ "$what" = all ] || [ "$what" = quick ]; then
  python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 || rc=1
  if [ "$what" != quick ]; then
    python3 -m pytest -q tests/test_triton_interp.py -p no:cacheprovider 2>&1 | tee "$OUT/triton_tests.log" | tail -3 || rc=1
  fi
  python3 -m dsv4_ops demo --max-new-tokens 32 2>&1 | grep -v Warning | tee "$OUT/demo.log" || rc=1
fi
if [ "$what" = quick ]; then what=bench; fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 benchmarks/bench_model.py --out "$OUT/bench_model.json" 2>&1 | grep -v Warning | tee "$OUT/bench_model.log" || rc=1
fi
if [ "$what" = spec ] || [ "$what" = all ]; then
  (cd benchmarks && python3 bench_spec.py --out "$OUT/bench_spec.json") 2>&1 | grep -v Warning | tee "$OUT/bench_spec.log" || rc=1
fi
if [ "$what" = ops ]; then
  python3 -m dsv4_ops bench --quick --out "$OUT/bench_ops" 2>&1 | grep -v Warning | tee "$OUT/bench_ops.log" || rc=1
fi
exit $rc
