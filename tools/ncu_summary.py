"""Where a kernel's time goes, from Nsight Compute's per-instruction SASS page.

    ncu -i out/ncu_kernels.ncu-rep --page source --print-source sass --csv | gzip > out/ncu_sass.csv.gz
    python tools/ncu_summary.py out/ncu_sass.csv.gz [--top 15]

For each kernel in the export: the warp-stall reasons over all sampled cycles, the share of
samples in each phase of the code (prologue before the first backward branch, the loop body,
the epilogue after it) and the most-sampled instructions with their main stall reason.
``tools/gpu_check.sh ncu`` writes the export; ``BENCHMARKS.md`` quotes this script's output.
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import sys


def kernels(path: str) -> dict[str, list[dict]]:
    """``{kernel name: [row, ...]}`` from the CSV ncu writes for ``--page source --csv``."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        text = f.read()
    out: dict[str, list[dict]] = {}
    for block in text.split('"Kernel Name",')[1:]:
        name, _, table = block.partition("\n")
        rows = list(csv.DictReader(io.StringIO(table)))
        out[name.strip().strip(",").strip('"')] = [r for r in rows if r.get("Address")]
    return out


def _samples(row: dict) -> int:
    return int(row.get("Warp Stall Sampling (All Samples)") or 0)


def _loop_bounds(rows: list[dict]) -> tuple[int, int]:
    """Index range of the hottest loop: the backward branch executed most often."""
    addr = [int(r["Address"], 16) for r in rows]
    best, span = 0, (len(rows), len(rows))
    for i, r in enumerate(rows):
        parts = r["Source"].split()
        if "BRA" in parts[:2] and parts[-1].startswith("0x"):
            target = int(parts[-1], 16)
            execs = int(r.get("Instructions Executed") or 0)
            if target < addr[i] and execs > best:
                best, span = execs, (addr.index(target) if target in addr else 0, i)
    return span


def summarize(name: str, rows: list[dict], top: int) -> str:
    total = sum(_samples(r) for r in rows) or 1
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    by_reason = collections.Counter()
    for r in rows:
        for k in reasons:
            by_reason[k] += int(r.get(k) or 0)
    lo, hi = _loop_bounds(rows)
    phase = [sum(_samples(r) for r in rows[:lo]), sum(_samples(r) for r in rows[lo:hi + 1]),
             sum(_samples(r) for r in rows[hi + 1:])]
    by_op = collections.Counter()
    for r in rows:
        parts = r["Source"].split()
        op = parts[1] if parts and parts[0].startswith("@") and len(parts) > 1 else (parts[0] if parts else "?")
        by_op[op.split(".")[0]] += _samples(r)
    lines = [f"## {name}: {total} samples, {len(rows)} SASS instructions",
             ("phases: " + ", ".join(f"{p} {100 * s / total:.1f}%" for p, s in
                                     zip(("prologue", "main loop", "epilogue"), phase)))
             if lo < len(rows) else "phases: no backward branch (straight-line code)",
             "opcodes: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in by_op.most_common(8)),
             "stall reasons: " + ", ".join(f"{k[6:]} {100 * v / total:.1f}%"
                                           for k, v in by_reason.most_common(6))]
    for r in sorted(rows, key=_samples, reverse=True)[:top]:
        main = max(reasons, key=lambda k: int(r.get(k) or 0))
        lines.append(f"  {100 * _samples(r) / total:5.1f}%  {r['Source'].strip()[:64]:<64} {main[6:]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", help="ncu --page source --print-source sass --csv output (optionally .gz)")
    p.add_argument("--top", type=int, default=12, help="instructions listed per kernel")
    args = p.parse_args(argv)
    found = kernels(args.csv)
    if not found:
        print(f"ncu_summary: no kernel tables in {args.csv}", file=sys.stderr)
        return 2
    print("\n\n".join(summarize(n, rows, args.top) for n, rows in found.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
