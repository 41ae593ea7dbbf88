"""``python3 benchmarks/bench_ops.py``: time every case of the grid, Triton op vs reference.

Per case: plan memory (skip what would not fit the budget, with the reason), build the
inputs (a few copies for L2-cold timing of small cases), check the op -- through its public,
validating wrapper -- against the reference once, time ``torch.ops.dsv4.<op>`` (the Triton
path on CUDA) and ``dsv4_ops.reference.ops.<op>`` on the same inputs, print one progress
line and rewrite the JSON, so a run cut short keeps every finished row.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import sys
import time
from pathlib import Path

import torch

from . import cases as C
from . import report
from . import roofline as rl
from ..timing import kernel_time, l2_bytes, rotation_copies

FULL_GRID = dict(batches=[1, 16, 64, 128], contexts=[8192, 32768, 131072])
QUICK_GRID = dict(batches=[1, 64], contexts=[32768])
TINY_GRID = dict(batches=[1, 3], contexts=[256])
ROTATION_BYTES = 8e9  # at most this much memory for extra input copies (L2-cold timing)
TOLERANCE = 2e-2  # bf16 outputs (the CPU suite's table)
MIN_INDEX_AGREEMENT = 0.99  # top-k sets may differ at near-ties: fp32 sums in another order


def context(s: str) -> int:
    """``32768``, ``32K`` or ``32k``."""
    s = s.strip().lower()
    return int(s[:-1]) * 1024 if s.endswith("k") else int(s)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="reduced grid: batch 1, 64 x context 32K (~3 min on an H200)")
    p.add_argument("--out", default="out/bench_ops", help="directory for bench_ops.json / .md / .png "
                                                          "(default: %(default)s)")
    p.add_argument("--batches", type=int, nargs="+", help="override the grid's batch sizes")
    p.add_argument("--contexts", type=context, nargs="+", help="override the grid's contexts (e.g. 8K 32K)")
    p.add_argument("--shapes", nargs="+", choices=["flash", "pro"], default=["flash", "pro"],
                   help="V4-Flash (H=64, top-k 512) and/or V4-Pro (H=128, top-k 1024)")
    p.add_argument("--kernels", nargs="+", choices=C.KERNELS, default=list(C.KERNELS))
    p.add_argument("--kv-cache-dtype", nargs="+", choices=C.CACHES, default=["bf16"],
                   help=f"KV-cache dtype(s) of the ops that read the cache ({', '.join(C.FP8_KERNELS)}): one row "
                        "per dtype; fp8 = FlashMLA's V4 layout (584 B per KV entry, 132 B per indexer key at V4 "
                        "widths). The other ops run once, bf16 (default: %(default)s)")
    p.add_argument("--mem-gb", type=float, default=60.0, help="memory budget per case (default: %(default)s)")
    p.add_argument("--target-ms", type=float, default=100.0,
                   help="device time of the samples of one measurement (CUDA: 10 replays of a tenth each)")
    p.add_argument("--no-ref", action="store_true", help="do not time the reference")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--device", default=None, help="default: cuda (required unless --tiny)")
    p.add_argument("--tiny", action="store_true", help="tiny widths, for a CPU smoke run: --tiny --device cpu")
    p.add_argument("--from-json", metavar="JSON", help="measure nothing: rewrite the table and plot of an earlier "
                                                        "run's bench_ops.json into --out (e.g. where matplotlib is)")


def describe(case: C.Case) -> dict:
    return dict(kernel=case.kernel, variant=case.variant, label=case.label, shape=case.shape, cache=case.cache,
                batch=case.batch, ctx=case.ctx, params=case.params, bytes=case.cost.bytes, flops=case.cost.flops,
                floor_us=rl.floor_us(case.cost), bound=rl.bound(case.cost), status="ok", reason=None,
                time_us=None, ref_us=None, ref_reason=None, speedup=None, fraction=None, ref_fraction=None)


# ---- correctness check: op (public wrapper: validates the inputs) vs reference --------------
def _max_err(got: torch.Tensor, want: torch.Tensor) -> tuple[float, bool]:
    """Max |got - want| and whether every element is within TOLERANCE (NaN fails); one batch row
    at a time, so a multi-GB pool never needs fp32 copies."""
    err, ok = 0.0, True
    for g, w in zip(got.unbind(0), want.unbind(0)):
        d = (g.float() - w.float()).abs()
        err = max(err, float(d.max())) if d.numel() else err
        ok &= bool((d <= TOLERANCE + TOLERANCE * w.float().abs()).all())
    return err, ok


def index_agreement(got: torch.Tensor, want: torch.Tensor) -> float:
    """Share of the reference's picked indices (``>= 0``) that the op also picked, per row as a set."""
    g, w = got.reshape(-1, got.shape[-1]).long(), want.reshape(-1, want.shape[-1]).long()
    n = int(max(g.max(), w.max(), 0)) + 2  # column 0 stands for the -1 sentinel
    mark = torch.zeros(w.shape[0], n, dtype=torch.bool, device=w.device)
    mark.scatter_(1, w + 1, True)
    hits = (mark.gather(1, g + 1) & (g >= 0)).sum()
    return float(hits) / max(int((w >= 0).sum()), 1)


def compare(kernel: str, got, want) -> dict:
    if kernel == "indexer_topk":
        agree = index_agreement(got, want)
        return dict(ok=agree >= MIN_INDEX_AGREEMENT, index_agreement=agree)
    if isinstance(got, (tuple, list)):
        ok = all(torch.equal(g, w) for g, w in zip(got, want))
        return dict(ok=ok, exact=ok)
    if got.is_floating_point():
        err, ok = _max_err(got, want)
        return dict(ok=ok, max_abs_err=err)
    ok = torch.equal(got, want)
    return dict(ok=ok, exact=ok)


def check(case: C.Case, args: tuple) -> dict:
    import dsv4_ops.ops as public
    from dsv4_ops.reference import ops as reference

    def fresh():  # the mutated argument is cloned, so op and reference start from the same state
        return tuple(a.clone() if i == case.mutated else a for i, a in enumerate(args))

    got_args, want_args = fresh(), fresh()
    got = getattr(public, case.kernel)(*got_args)
    want = getattr(reference, case.kernel)(*want_args)
    if case.mutated is not None:
        got, want = got_args[case.mutated], want_args[case.mutated]
    return compare(case.kernel, got, want)


# ---- one case ---------------------------------------------------------------------------
def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def _free(device: torch.device, collect: bool = False) -> None:
    """Return cached GPU memory between phases, so each phase has the budget to itself;
    ``collect`` also breaks reference cycles (an exception's frames may hold tensors)."""
    if device.type == "cuda":
        if collect:
            gc.collect()  # ~0.1 s: once per case
        torch.cuda.empty_cache()


def measure(case: C.Case, device: torch.device, budget: float, target_ms: float, with_ref: bool,
            strict: bool = False) -> dict:
    from dsv4_ops.reference import ops as reference

    row = describe(case)
    if case.skip:
        return {**row, "status": "skipped", "reason": case.skip}
    alloc = C.alloc_bytes(case)
    if alloc + case.work_bytes > budget:
        return {**row, "status": "skipped",
                "reason": f"inputs {_gb(alloc)} + op scratch {_gb(case.work_bytes)} exceed the budget {_gb(budget)}"}
    copies, l2_cold = 1, None  # CPU smoke runs: no cache to defeat
    if device.type == "cuda":
        l2 = l2_bytes(device)
        copies = rotation_copies(case.cost.bytes, alloc, l2, int(min(ROTATION_BYTES, budget / 4)))
        l2_cold = copies * case.cost.bytes >= 2 * l2
    row.update(copies=copies, l2_cold=l2_cold, input_bytes=alloc)
    ref_need = copies * alloc + case.ref_work_bytes
    if not with_ref:
        row["ref_reason"] = "--no-ref"
    elif ref_need > budget:
        row["ref_reason"] = f"reference needs ~{_gb(ref_need)} > budget {_gb(budget)}"
    inputs = []
    try:
        torch.manual_seed(case.seed)
        inputs = [case.make(device) for _ in range(copies)]
        if row["ref_reason"] is None:
            try:
                row["check"] = check(case, inputs[0])
            except torch.cuda.OutOfMemoryError as e:  # the reference is the big one: time the op anyway
                row["ref_reason"] = f"out of memory: {str(e).splitlines()[0]}"
            _free(device)
        op = getattr(torch.ops.dsv4, case.kernel)
        t = kernel_time([functools.partial(op, *a) for a in inputs], device, target_ms)
        row.update(time_us=t.us, method=t.method, samples=t.samples, fraction=row["floor_us"] / t.us)
        _free(device)
        if row["ref_reason"] is None:
            ref = getattr(reference, case.kernel)
            try:
                r = kernel_time([functools.partial(ref, *a) for a in inputs], device, target_ms)
                row.update(ref_us=r.us, ref_method=r.method, speedup=r.us / t.us,
                           ref_fraction=row["floor_us"] / r.us)
            except torch.cuda.OutOfMemoryError as e:
                row["ref_reason"] = f"out of memory: {str(e).splitlines()[0]}"
    except torch.cuda.OutOfMemoryError as e:
        row.update(status="skipped", reason=f"out of memory: {str(e).splitlines()[0]}")
    except Exception as e:  # keep the rest of the run; the row says what went wrong
        if strict:
            raise
        row.update(status="error", reason=f"{type(e).__name__}: {e}")
    finally:
        del inputs
        _free(device, collect=True)
    return row


def progress(i: int, n: int, elapsed: float, r: dict) -> str:
    head = (f"[{i:>3}/{n} {elapsed:7.1f}s] {r['label']:<22} {r['shape']:<9} {r['cache']:<4} B={r['batch']:<4} "
            f"ctx={report.ctx_label(r['ctx']):<5}")
    if r["status"] != "ok":
        return f"{head} {r['status']}: {r['reason']}"
    ref = f"ref {r['ref_us']:9.1f} us ({r['speedup']:6.1f}x)" if r["ref_us"] else f"ref -- ({r['ref_reason']})"
    bad = "" if (r.get("check") or {}).get("ok", True) else f"  MISMATCH {r['check']}"
    return (f"{head} {r['time_us']:9.2f} us  {ref}  floor {r['floor_us']:8.3f} us "
            f"= {r['fraction'] * 100:5.1f}% ({r['bound']}){bad}")


# ---- the run ------------------------------------------------------------------------------
def _meta(args, device: torch.device) -> dict:
    from dsv4_ops import lowering

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                torch=torch.__version__, triton=triton_version, cuda=torch.version.cuda, backend=lowering.BACKEND,
                date=datetime.datetime.now().isoformat(timespec="seconds"), argv=sys.argv[1:],
                hbm_bytes_per_s=rl.HBM_BYTES_PER_S, bf16_flops_per_s=rl.BF16_FLOPS_PER_S,
                l2_bytes=l2_bytes(device), mem_budget_bytes=args.mem_gb * 1e9)


def run(args: argparse.Namespace, strict: bool = False, log=print) -> int:
    """Run the grid ``args`` selects; 0 when every case ran or was skipped for a stated reason
    and every op agreed with its reference."""
    import dsv4_ops  # noqa: F401  (registers torch.ops.dsv4)
    from dsv4_ops import lowering

    if args.from_json:
        return render(Path(args.from_json), Path(args.out), plot=not args.no_plot, log=log)
    if args.device is None and not torch.cuda.is_available() and not args.tiny:
        log("bench_ops: no CUDA device. Run it on the GPU box, or smoke-test on CPU with --tiny --device cpu.")
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and lowering.BACKEND != "triton":
        log(f"bench_ops: the dsv4 backend is {lowering.BACKEND!r} (DSV4_OPS_BACKEND): torch.ops.dsv4 would not run "
            "the Triton kernels. Unset DSV4_OPS_BACKEND or set it to 'triton'.")
        return 2
    grid = TINY_GRID if args.tiny else QUICK_GRID if args.quick else FULL_GRID
    batches, contexts = args.batches or grid["batches"], args.contexts or grid["contexts"]
    dims = [(C.TINY[s] if args.tiny else {"flash": C.FLASH, "pro": C.PRO}[s]) for s in args.shapes]
    cases = C.grid(dims, tuple(args.kernels), batches, contexts, tuple(args.kv_cache_dtype))
    out = Path(args.out)
    meta = _meta(args, device)
    meta.update(batches=batches, contexts=contexts, shapes=args.shapes, kernels=list(args.kernels),
                kv_cache_dtypes=list(args.kv_cache_dtype))
    log(f"bench_ops on {meta['device']} (torch {meta['torch']}, triton {meta['triton']}): {len(cases)} cases, "
        f"budget {args.mem_gb:g} GB -> {out}/bench_ops.*")
    rows: list[dict] = []
    t0 = time.perf_counter()
    for i, case in enumerate(cases, 1):
        start = time.perf_counter()
        row = measure(case, device, args.mem_gb * 1e9, args.target_ms, not args.no_ref, strict)
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
        log(progress(i, len(cases), time.perf_counter() - t0, row))
        report.write_json(out / "bench_ops.json", meta, rows)
        report.write_markdown(out / "bench_ops.md", meta, rows)
    plotted = False if args.no_plot else report.plot(out / "bench_ops.png", rows)
    log(f"wrote {out}/bench_ops.json, bench_ops.md{', bench_ops.png' if plotted else ''} "
        f"in {time.perf_counter() - t0:.0f} s")
    failed = [r for r in rows if r["status"] == "error" or not (r.get("check") or {}).get("ok", True)]
    for r in failed:
        log(f"FAILED: {r['label']} {r['shape']} {r['cache']} B={r['batch']} ctx={r['ctx']}: "
            f"{r['reason'] or r['check']}")
    return 1 if failed else 0


def render(src: Path, out: Path, plot: bool = True, log=print) -> int:
    data = json.loads(src.read_text())
    report.write_markdown(out / "bench_ops.md", data["meta"], data["rows"])
    plotted = plot and report.plot(out / "bench_ops.png", data["rows"])
    log(f"wrote {out}/bench_ops.md{', bench_ops.png' if plotted else ''} from {src}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_ops", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))
