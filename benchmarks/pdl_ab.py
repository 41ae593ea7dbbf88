"""PDL pairs on and off (``lowering/pdl.py``), the same cases in one process: the cache readers of
``bench_ops.py`` (``sparse_attention`` CSA / HCA, ``indexer_topk``; bf16 and FP8 caches), each
timed as ``bench_ops`` times it (``timing.kernel_time``: CUDA-graph replays over L2-cold input
copies), alternately paired and unpaired, two rounds each; the table gives each side's best
median, the gain and the floor fraction. Each case first checks that both give the same bits.

    PYTHONPATH=$PWD python3 benchmarks/pdl_ab.py [--batches 1 64 128] [--contexts 32K 128K] [--out DIR]
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernel_bench import cases as C  # noqa: E402
from benchmarks.kernel_bench.run import ROTATION_BYTES, context, describe  # noqa: E402
from benchmarks.timing import kernel_time, l2_bytes, rotation_copies  # noqa: E402
from lowering import pdl  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 128])
    ap.add_argument("--contexts", type=context, nargs="+", default=[32768, 131072])
    ap.add_argument("--kernels", nargs="+", default=["sparse_attention", "indexer_topk"], choices=C.FP8_KERNELS)
    ap.add_argument("--caches", nargs="+", default=["bf16", "fp8"], choices=C.CACHES)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="out/pdl_ab")
    args = ap.parse_args()
    dev = torch.device("cuda")
    if not pdl.enabled(dev):
        print(f"PDL pairs are off here ({pdl.ENV}=0, or not an sm_90+ NVIDIA GPU): nothing to compare")
        return 1
    import dsv4_ops  # noqa: F401  (registers the ops)

    cases = C.grid([C.FLASH], tuple(args.kernels), args.batches, args.contexts, tuple(args.caches))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, start = [], time.time()
    print(f"{'case':<24} {'B':>4} {'ctx':>7} {'cache':>5} {'floor us':>9} {'paired':>8} {'unpaired':>9} "
          f"{'gain':>6} {'fraction':>8}", flush=True)
    for i, case in enumerate(cases):
        alloc = C.alloc_bytes(case)
        copies = rotation_copies(case.cost.bytes, alloc, l2_bytes(dev), int(ROTATION_BYTES))
        torch.manual_seed(case.seed)
        inputs = [case.make(dev) for _ in range(copies)]
        op = getattr(torch.ops.dsv4, case.kernel)
        times = {True: [], False: []}
        results = {}
        for paired in (True, False):
            pdl._enabled = paired
            results[paired] = op(*inputs[0])
        same = torch.equal(results[True], results[False])
        for _ in range(args.rounds):
            for paired in (True, False):
                pdl._enabled = paired
                times[paired].append(kernel_time([functools.partial(op, *a) for a in inputs], dev).us)
        pdl._enabled = True
        row = {**describe(case), "copies": copies, "same_bits": same,
               "paired_us": min(times[True]), "unpaired_us": min(times[False]), "samples": times}
        row["gain_us"] = row["unpaired_us"] - row["paired_us"]
        row["fraction"] = row["floor_us"] / row["paired_us"]
        rows.append(row)
        print(f"{case.label:<24} {case.batch:>4} {case.ctx:>7} {case.cache:>5} {row['floor_us']:>9.1f} "
              f"{row['paired_us']:>8.1f} {row['unpaired_us']:>9.1f} {row['gain_us']:>6.1f} "
              f"{row['fraction']:>8.1%}{'' if same else '  RESULTS DIFFER'}  [{i + 1}/{len(cases)}, "
              f"{time.time() - start:.0f} s]", flush=True)
        del inputs, results
        torch.cuda.empty_cache()
        (out / "pdl_ab.json").write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "rows": rows},
                                                    indent=1))
    return 0 if all(r["same_bits"] for r in rows) else 2


if __name__ == "__main__":
    sys.exit(main())
