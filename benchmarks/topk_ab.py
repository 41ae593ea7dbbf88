"""Two builds of the CUDA top-k (``csrc/kernels/topk_rows.cu``) timed on the same rows, in turns.

    git show HEAD:csrc/kernels/topk_rows.cu > /tmp/base.cu
    PYTHONPATH=$PWD python3 benchmarks/topk_ab.py --base /tmp/base.cu [--flags 64] [--extra NAME=FILE ...]

The rows are what the kernel serves in the bench cases: the indexer's scores of ``bench_ops.py``'s
``indexer_topk`` inputs (``kernel_bench/cases.py``, Flash widths, bf16 keys) at B = 64, 128 x 32K,
128K context, and Gaussian rows of the same shape. Each case: both builds' picks must be equal (else
the line says so and no time is given), then ``--rounds`` rounds of base, candidate (and the
candidate with each of ``--flags``, its diagnostics' ``stop_after`` flags, e.g. 64 = ``DIAG_BITONIC``,
the bucket sort turned off; then each ``--extra`` build),
one after the other, so that drift between rounds shows as the spread. One line a case and build:
``topk_ab B=.. ctx=.. rows=scores|gaussian build=base|cand|cand+F us=r1/r2/.. median=..``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dsv4_ops  # noqa: E402,F401  (registers the ops)
from benchmarks.kernel_bench import cases  # noqa: E402
from benchmarks.timing import kernel_time  # noqa: E402
from lowering.cuda import topk_rows  # noqa: E402
from lowering.triton import indexer as ix  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, required=True, help="the other version of topk_rows.cu")
    ap.add_argument("--cand", type=Path, default=topk_rows.SOURCE, help="default: the checkout's")
    ap.add_argument("--extra", nargs="*", default=[], metavar="NAME=FILE", help="more versions, timed after cand")
    ap.add_argument("--flags", type=int, nargs="*", default=[], help="also the candidate with these stop_after flags")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device("cuda")
    major, minor = torch.cuda.get_device_capability(dev)
    builds = {"base": topk_rows.load(topk_rows.build(f"{major}{minor}", args.base)),
              "cand": topk_rows.load(topk_rows.build(f"{major}{minor}", args.cand))}
    for spec in args.extra:
        name, _, path = spec.partition("=")
        builds[name] = topk_rows.load(topk_rows.build(f"{major}{minor}", Path(path)))
    runs = [("base", 0), ("cand", 0)] + [("cand", f) for f in args.flags] + [(n, 0) for n in builds if n not in
                                                                              ("base", "cand")]
    for B in args.batches:
        for ctx in args.contexts:
            q, w, keys, visible, k = cases.indexer_topk_case(cases.FLASH, B, ctx, "flash", "bf16").make(dev)
            scores, scoring = ix.scores_launch(q, w, keys, visible)
            ix.indexer_scores_kernel[scoring.grid](*scoring.args, **scoring.meta)
            for name, rows in (("scores", scores), ("gaussian", torch.randn_like(scores))):
                tag = f"topk_ab B={B} ctx={ctx} rows={name}"
                want = topk_rows.topk_rows(rows, visible, k, lib=builds["base"])
                outs, ok = {}, True
                for build, flags in runs:
                    out = torch.empty_like(want)
                    outs[build, flags] = out
                    topk_rows.topk_rows(rows, visible, k, out=out, stop_after=flags, lib=builds[build])
                    if not torch.equal(out, want):
                        print(f"{tag} build={build}+{flags} picks differ from base's", flush=True)
                        ok = False
                if not ok:
                    continue
                times: dict = {run: [] for run in runs}
                for _ in range(args.rounds):
                    for build, flags in runs:
                        def call(build=build, flags=flags):
                            topk_rows.topk_rows(rows, visible, k, out=outs[build, flags], stop_after=flags,
                                                lib=builds[build])
                        times[build, flags].append(kernel_time([call], dev).us)
                for (build, flags), us in times.items():
                    label = build + (f"+{flags}" if flags else "")
                    print(f"{tag} build={label} us={'/'.join(f'{t:.2f}' for t in us)} "
                          f"median={statistics.median(us):.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
