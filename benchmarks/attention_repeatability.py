"""H200 race check of the Gluon decode attention: the same inputs, many launches, the same bits.

    PYTHONPATH=$PWD python3 benchmarks/attention_repeatability.py [--repeats 40] [--batches 2 64 128]

Each kernel variant is deterministic by construction (a fixed order of blocks, splits and
accumulations), so two launches on identical inputs must give identical bits. A launch that reads
a ring slot before its rows have landed, or after the next block overwrote them, gives different
bits from run to run and is caught here even where its error would hide inside bf16's tolerance.
Per variant (``v3``; ``ws`` with each way of publishing a landed block, ``ws_noinc`` = per-thread
``cp.async.mbarrier.arrive.noinc``, ``ws`` = the writers wait, fence, then arrive) and case: the
number of launches whose output differs from the first, the largest difference, and the first
launch's error against the fp32 reference. Before every launch a 256 MB buffer is rewritten, so
the launch reads its rows from HBM, not L2: a late copy is then late by a whole HBM round trip
(the first check of each case runs on L2-warm inputs, as a unit test does, and can miss it).
Exit code 1 if any launch differs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gluon_attention_check import err, make_inputs, reference  # noqa: E402
from lowering.gluon import sparse_attention_ws as ws  # noqa: E402
from lowering.gluon.sparse_attention import sparse_attention_gluon  # noqa: E402

SCALE = 512 ** -0.5
# name -> (variant, ws.PUBLISH while it runs)
KERNELS = {"v3": ("v3", ws.PUBLISH), "ws_noinc": ("ws", 0), "ws": ("ws", 1)}


def run(kernel: str, inputs, splits):
    variant, publish = KERNELS[kernel]
    saved, ws.PUBLISH = ws.PUBLISH, publish  # read by gluon_config at each launch
    try:
        return sparse_attention_gluon(*inputs, SCALE, num_splits=splits, variant=variant)
    finally:
        ws.PUBLISH = saved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--batches", type=int, nargs="+", default=[2, 64, 128])
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    bad = 0
    flush = torch.empty(64 * 2**20, dtype=torch.float32, device="cuda")  # 256 MB > the H200's 50 MB L2
    for B in args.batches:
        for mode in ("csa", "mixed"):
            inputs = make_inputs(B, mode, seed=B + 7, dev=torch.device("cuda"))
            want = reference(inputs)
            for kernel in args.kernels:
                for splits in (None, 1, 2):
                    first = run(kernel, inputs, splits).clone()
                    differ, worst = 0, 0.0
                    for _ in range(args.repeats):
                        flush.zero_()  # evict the inputs from L2
                        out = run(kernel, inputs, splits)
                        if not torch.equal(out, first):
                            differ += 1
                            worst = max(worst, float((out.float() - first.float()).abs().max()))
                    torch.cuda.synchronize()
                    bad += differ
                    print(f"{kernel:8s} {mode:5s} B={B:<4d} splits={splits!s:4s} launches differing from the first: "
                          f"{differ}/{args.repeats} (max diff {worst:.3g}); err vs fp32 reference "
                          f"{err(first, want):.3g}", flush=True)
    print("every launch repeated its first bits" if bad == 0 else f"{bad} launches differed", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
