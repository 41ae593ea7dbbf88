"""Per-kernel decode benchmark of the torch.ops.dsv4 ops: Triton path vs the plain-PyTorch
reference vs the roofline floor (DESIGN.md §6). The logic lives in ``benchmarks/kernel_bench/``,
the timer in ``benchmarks/timing.py``.

    python3 benchmarks/bench_ops.py [--quick] [--out DIR]      # on the GPU box (tools/gpu_check.sh ops)
    python3 benchmarks/bench_ops.py --kv-cache-dtype bf16 fp8 ...   # + FP8-cache rows
    python3 benchmarks/bench_ops.py --tiny --device cpu         # CPU smoke run (seconds)
    python3 benchmarks/bench_ops.py --from-json DIR/bench_ops.json --out DIR2   # table + plot again
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `benchmarks` and `dsv4_ops`

from benchmarks.kernel_bench.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
