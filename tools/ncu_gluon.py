"""The routed Gluon decode attentions (bf16 ``ws``, FP8 ``ws``), each launched a fixed number of times, for
Nsight Compute: where a 32-row block's time goes inside the warp-specialised kernels.

    ncu --clock-control none -k regex:sparse_attention_gluon --launch-skip 3 --launch-count 1 --set full \
        --import-source no -o out/gluon python3 tools/ncu_gluon.py     # the FP8 kernel's second launch

Runs the public ``dsv4_ops.sparse_attention`` on the per-kernel benchmark's V4-Flash CSA inputs
(``benchmarks/kernel_bench/cases.py``) at ``--batch`` (default 128: one split, 20 blocks a program) and
``--ctx`` 32K, first with a bf16 cache, then with the FP8 cache; ``--rounds`` times each (the first
round compiles). ``tools/gpu_check.sh ncu`` (NCU=gluon) runs this under ncu and summarises the report
(``ncu-gluon-bf16``: ``--caches bf16``, the bf16 kernel's second launch).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dsv4_ops  # noqa: E402
from benchmarks.kernel_bench import cases as C  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--caches", nargs="+", default=list(C.CACHES), choices=C.CACHES)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("ncu_gluon: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    torch.manual_seed(0)
    for cache in args.caches:
        inputs = C.sparse_attention_case(C.FLASH, "csa", args.batch, args.ctx, "flash", cache).make(dev)
        for _ in range(args.rounds):
            dsv4_ops.sparse_attention(*inputs)
        torch.cuda.synchronize()
        print(f"ncu_gluon: {cache} cache, batch {args.batch}, ctx {args.ctx}: {args.rounds} calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
