"""Per-kernel decode benchmark of the torch.ops.dsv4 ops: Triton path vs the plain-PyTorch
reference vs the roofline floor. Same as ``python -m dsv4_ops bench``; the logic lives in
``dsv4_ops/bench/`` (this is only an entry point).

    python benchmarks/bench_ops.py [--quick] [--out DIR]        # on the GPU box
    python benchmarks/bench_ops.py --tiny --device cpu           # CPU smoke run
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without PYTHONPATH

from dsv4_ops.bench.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
