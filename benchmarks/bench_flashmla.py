"""Our FP8 sparse decode attention next to FlashMLA's DeepSeek-V4 ("MODEL1") sm_90 kernel, same FP8 bytes.

    bash .peers/flashmla/build.sh      # once on the GPU box (~1 min): a copy of /work/shared/peers/flashmla
    python3 benchmarks/bench_flashmla.py --flashmla .peers/flashmla [--batches 1 64 128] [--topk 512] \
        [--window 128] [--ctx 32768] [--copies N] [--target-ms 100] [--out out/bench_flashmla.json]

One V4-Flash CSA decode step per batch row: 64 heads x 512 dims, bf16 queries, the 128-entry window
and the top-k 512 picks from the compressed pool of a ``--ctx`` context (ratio 4: 8192 entries at
32K), a per-head sink. The inputs are ``kernel_bench/cases.py``'s FP8 ``sparse_attention`` case: the
caches are quantised ONCE, by our quantiser (``dsv4_ops/reference/fp8_cache.py``: the MODEL1 bytes),
into the model's pages (window: one page of 128 entries, pool: pages of 64). FlashMLA gets the same
entry bytes re-paged its way (``to_flashmla``): pages of 64 entries, each page padded to a multiple
of 576 B (37440 B, ours 37376 B), window as ``k_cache`` (global index ``b*128 + slot``), pool as
``extra_k_cache`` (``b*8192 + entry``), ``-1`` kept as skip, index lists padded with ``-1`` to a
multiple of 64 (its top-k block).

Per batch: each kernel is called once and timed by ``benchmarks/timing.py``'s ``kernel_time`` (CUDA
graph replays over rotated input copies, L2-cold; ours first, so its time survives a FlashMLA
failure), next to the roofline floor (``kernel_bench/roofline.py``). The two outputs must agree
(relative L2 error <= ``REL_TOL``, finite) on the timed inputs and on a copy of the indices with holes
(``HOLES`` of them ``-1``); each is also compared with the fp32 reference on the first rows (reported,
to tell which side is off). A table is printed; ``--out`` gets the JSON (rewritten per batch).

Exit status: 0 all agreed; 1 a disagreement or an error (the row says which; the other batches still
run); 2 nothing could run (no flash_mla build, no sm_90 GPU, dsv4 backend not Triton).
CPU smoke run (tests/project/test_bench_flashmla.py): ``--device cpu --flashmla tests/fake_flashmla`` (a
pure-PyTorch stand-in that reads FlashMLA's layout).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `benchmarks` and `dsv4_ops`

import dsv4_ops  # noqa: E402  (registers torch.ops.dsv4)
from dsv4_ops import lowering  # noqa: E402
from benchmarks.kernel_bench import cases as C  # noqa: E402
from benchmarks.kernel_bench import report  # noqa: E402
from benchmarks.kernel_bench import roofline as rl  # noqa: E402
from benchmarks.kernel_bench.run import ROTATION_BYTES, _meta  # noqa: E402
from benchmarks.timing import kernel_time, l2_bytes, rotation_copies  # noqa: E402
from dsv4_ops.reference import fp8_cache as fp8  # noqa: E402
from dsv4_ops.reference import ops as reference  # noqa: E402

PAGE = 64  # FlashMLA's page_block_size (its tests and the sm_90 MODEL1 kernel)
PAGE_ALIGN = 576  # FlashMLA's MODEL1 quantiser pads each page to a multiple of 576 B
TOPK_BLOCK = 64  # FlashMLA's sm_90 kernel takes index lists in blocks of 64 (topk % 64 == 0)
REL_TOL = 1e-2  # ||ours - FlashMLA|| / ||FlashMLA||: a few bf16 ulps (2^-8 = 0.0039 each)
HOLES = 0.1  # share of the indices set to -1 in the second check
REF_ROWS = 2  # batch rows compared with the fp32 reference (it dequantises the whole pool)
PEERS = "/work/shared/peers/flashmla"  # where the FlashMLA sources live on the machine the checkout is made on


def build_hint(folder: str) -> str:
    return (f"Build it on the GPU box first (about 1 minute):\n    bash {folder}/build.sh\n"
            f"{folder} must be a copy of {PEERS} carried with the checkout, e.g. made before the run with\n"
            f"    cp -r {PEERS} .peers/flashmla   (an ignored folder: add /.peers/ to .git/info/exclude; carry it)\n"
            f"then: python3 benchmarks/bench_flashmla.py --flashmla .peers/flashmla")


# ---- inputs and FlashMLA's layout (pure: tested on CPU) ---------------------------------------
def build_case(batch: int, topk: int = 512, window: int = 128, ctx: int = 32768, dims: C.Dims = C.FLASH) -> C.Case:
    """``cases.py``'s FP8 CSA ``sparse_attention`` case at ``dims`` with ``topk`` / ``window``."""
    d = dataclasses.replace(dims, topk=topk, window=window)
    case = C.sparse_attention_case(d, "csa", batch, ctx, d.name, cache="fp8")
    if case.skip:
        raise ValueError(case.skip)
    return case


def build_inputs(case: C.Case, device: torch.device | str) -> tuple:
    """One copy of our op's arguments ``(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale)``, seeded
    by the case: the caches quantised once, by the reference quantiser."""
    torch.manual_seed(case.seed)
    return case.make(torch.device(device))


def padded_page_bytes(page: int, entry_bytes: int) -> int:
    """FlashMLA's page stride: ``page`` entries rounded up to a multiple of 576 B."""
    return -(-page * entry_bytes // PAGE_ALIGN) * PAGE_ALIGN


def _row_entries(entries: int, page: int) -> int:
    """Entries a batch row gets in FlashMLA's pages: ours rounded up to whole pages of ``page``."""
    return max(1, -(-entries // page)) * page


def to_flashmla_cache(cache: Tensor, dim: int, page: int = PAGE) -> Tensor:
    """Our FP8 pages ``uint8 [B, P, p, E]`` -> FlashMLA's ``float8_e4m3fn [B * n / page, page, 1, E]``
    (``n`` = a row's entries rounded up to ``page``): the same entry bytes, row ``b``'s entry ``i`` in
    block ``b * n / page + i // page``, slot ``i % page``; each block is its ``page`` data rows then
    their scale rows (the layout both share), blocks ``padded_page_bytes`` apart (the padding and
    any tail entries zero)."""
    lay = fp8.KVLayout.of(cache, dim)
    B, E = cache.shape[0], lay.entry_bytes
    rows = fp8.to_entries(cache, lay.data_bytes)  # [B, N, E]: data | scales per entry
    n = _row_entries(rows.shape[1], page)
    rows = F.pad(rows, (0, 0, 0, n - rows.shape[1]))
    blocks = fp8.from_entries(rows, page, lay.data_bytes).reshape(B * n // page, page * E)
    buf = torch.zeros(blocks.shape[0], padded_page_bytes(page, E), dtype=torch.uint8, device=cache.device)
    buf[:, : page * E] = blocks
    return buf[:, : page * E].view(blocks.shape[0], page, 1, E).view(torch.float8_e4m3fn)


def to_flashmla_indices(idx: Tensor, entries: int, page: int = PAGE) -> Tensor:
    """Row-local indices ``[B, S, K]`` (``-1`` = skip) into a cache of ``entries`` entries a row ->
    FlashMLA's global ``b * n + i`` (``n`` as in ``to_flashmla_cache``), ``-1`` kept, padded with
    ``-1`` to a multiple of ``TOPK_BLOCK``; int32, contiguous."""
    B, n = idx.shape[0], _row_entries(entries, page)
    if B * n >= 2**31:
        raise ValueError(f"{B} rows x {n} entries overflow FlashMLA's int32 indices")
    base = (torch.arange(B, dtype=torch.int32, device=idx.device) * n).view(B, 1, 1)
    out = torch.where(idx >= 0, idx + base, -1).to(torch.int32)
    k = max(1, -(-idx.shape[-1] // TOPK_BLOCK)) * TOPK_BLOCK
    return F.pad(out, (0, k - idx.shape[-1]), value=-1).contiguous()


class FlashMLAInputs(NamedTuple):
    q: Tensor  # [B, 1, H, D] bf16 (ours)
    k_cache: Tensor  # the window, [B * 128 / 64, 64, 1, 584] e4m3, padded blocks
    indices: Tensor  # [B, 1, W rounded to 64] int32, global
    extra_k_cache: Tensor  # the compressed pool, same layout
    extra_indices: Tensor  # [B, 1, K rounded to 64] int32, global
    sink: Tensor  # [H] fp32 (ours)
    scale: float


def to_flashmla(args: tuple) -> FlashMLAInputs:
    """Our op's arguments (FP8 window and pool, CSA: ``cmp_len`` all 0) -> FlashMLA's."""
    q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale = args
    if not (fp8.is_fp8_cache(kv) and fp8.is_fp8_cache(cmp)):
        raise ValueError("to_flashmla: kv and cmp must be FP8 paged caches")
    if bool((cmp_len != 0).any()):
        raise ValueError("to_flashmla: FlashMLA has no dense prefix; cmp_len must be 0 (CSA)")
    D = q.shape[-1]
    return FlashMLAInputs(q, to_flashmla_cache(kv, D), to_flashmla_indices(kv_idx, fp8.entries(kv)),
                          to_flashmla_cache(cmp, D), to_flashmla_indices(cmp_idx, fp8.entries(cmp)), sink, scale)


def with_holes(args: tuple, share: float = HOLES, seed: int = 0) -> tuple:
    """The same arguments with a ``share`` of the window and top-k indices set to ``-1``."""
    g = torch.Generator().manual_seed(seed)
    out = list(args)
    for i in (2, 4):  # kv_idx, cmp_idx
        drop = (torch.rand(args[i].shape, generator=g) < share).to(args[i].device)
        out[i] = args[i].masked_fill(drop, -1)
    return tuple(out)


def _clone(args: tuple) -> tuple:
    return tuple(a.clone() if isinstance(a, Tensor) else a for a in args)


def _nbytes(*tensors: Tensor) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors if isinstance(t, Tensor))


def agreement(got: Tensor, want: Tensor) -> dict:
    """Max abs difference and relative L2 error of ``got`` against ``want`` (fp32); ``ok`` when the
    shapes match, both are finite and the relative error is at most ``REL_TOL``."""
    if got.shape != want.shape:
        return dict(ok=False, why=f"shapes differ: {tuple(got.shape)} vs {tuple(want.shape)}")
    a, b = got.float(), want.float()
    finite = bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())
    diff = a - b
    rel = float(diff.norm() / b.norm().clamp_min(1e-30))
    res = dict(max_abs_diff=float(diff.abs().max()), rel_err=rel, max_abs=float(b.abs().max()), finite=finite)
    res["ok"] = finite and rel <= REL_TOL
    if not res["ok"]:
        res["why"] = "non-finite output" if not finite else f"relative error {rel:.3g} > {REL_TOL:g}"
    return res


def vs_reference(args: tuple, outs: dict[str, Tensor], rows: int = REF_ROWS) -> dict:
    """Each output's first ``rows`` batch rows against the fp32 reference on the same FP8 bytes."""
    n = min(rows, args[0].shape[0])
    sub = tuple(a[:n] if isinstance(a, Tensor) and a.dim() > 1 else a for a in args)
    want = reference.sparse_attention(*sub).float()
    return {name: agreement(o[:n], want) for name, o in outs.items()}


# ---- the two kernels ------------------------------------------------------------------------
def import_flashmla(folder: str) -> tuple[Callable, Callable, str]:
    """``flash_mla_with_kvcache``, ``get_mla_metadata`` and the module's file, from ``folder`` (put
    first on sys.path); ImportError with the build instructions when that fails."""
    path = Path(folder).resolve()
    if not path.is_dir():
        raise ImportError(f"--flashmla {folder}: no such folder.\n{build_hint(folder)}")
    sys.path.insert(0, str(path))
    try:
        mod = importlib.import_module("flash_mla")
        return mod.flash_mla_with_kvcache, mod.get_mla_metadata, str(mod.__file__)
    except Exception as e:  # ImportError (no flash_mla/cuda*.so yet), OSError / undefined symbols of a stale build
        sys.path.remove(str(path))
        why = f"{type(e).__name__}: {e}"
        raise ImportError(f"flash_mla cannot be imported from {path}: {why}\n{build_hint(folder)}") from e


def flashmla_call(fn: Callable, x: FlashMLAInputs, sched) -> Tensor:
    """One FlashMLA sparse FP8 decode call (its MODEL1 API); returns ``out [B, 1, H, 512]`` bf16."""
    out, _lse = fn(x.q, x.k_cache, None, None, x.q.shape[-1], sched, None, softmax_scale=x.scale, causal=False,
                   is_fp8_kvcache=True, indices=x.indices, attn_sink=x.sink, extra_k_cache=x.extra_k_cache,
                   extra_indices_in_kvcache=x.extra_indices)
    return out


def _route(device: torch.device, call: Callable[[], Tensor]) -> tuple[Tensor, str]:
    """Run our public (validating) op once; which kernel served it."""
    try:
        from dsv4_ops.ops import attention_sm90 as sm90

        before = sm90.stats["launches"]
    except Exception:  # only a label: never fail the run for it
        sm90, before = None, None
    out = call()
    _sync(device)
    if device.type != "cuda" or lowering.BACKEND != "triton":
        return out, "reference"
    return out, "sm90 gluon" if sm90 is not None and sm90.stats["launches"] > before else "triton"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        try:
            torch.cuda.empty_cache()
        except RuntimeError:  # a sticky CUDA error (a kernel fault): the row already says so
            pass


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


# ---- one batch ------------------------------------------------------------------------------
def measure(B: int, args: argparse.Namespace, device: torch.device, fm: Callable, get_meta: Callable,
            log=print) -> dict:
    """Check and time both kernels at batch ``B``; the row says what failed (nothing raises)."""
    case = build_case(B, args.topk, args.window, args.ctx)
    floor = rl.floor_us(case.cost)
    row = dict(batch=B, params=case.params, bytes=case.cost.bytes, flops=case.cost.flops, floor_us=floor,
               bound=rl.bound(case.cost), status="ok", errors=[], ours_us=None, flashmla_us=None, ratio=None)
    ours_copies: list[tuple] = []
    fm_copies: list[FlashMLAInputs] = []
    try:
        t0 = time.perf_counter()
        ours = build_inputs(case, device)
        fm0 = to_flashmla(ours)
        _sync(device)
        row["build_s"] = time.perf_counter() - t0
        row["flashmla_page_bytes"] = fm0.k_cache.stride(0)
        copies = args.copies or 1
        if device.type == "cuda":
            l2 = l2_bytes(device)
            copies = args.copies or rotation_copies(case.cost.bytes, _nbytes(*ours) + _nbytes(*fm0), l2,
                                                    int(ROTATION_BYTES))
            row["l2_cold"] = copies * case.cost.bytes >= 2 * l2
        row["copies"] = copies
        outs, scheds = {}, []
        # ours first (its timing does not depend on FlashMLA working), then FlashMLA
        try:
            outs["ours"], row["ours_route"] = _route(device, lambda: dsv4_ops.sparse_attention(*ours))
            ours_copies = [ours] + [_clone(ours) for _ in range(copies - 1)]
            op = torch.ops.dsv4.sparse_attention
            t = kernel_time([functools.partial(op, *a) for a in ours_copies], device, args.target_ms)
            row.update(ours_us=t.us, ours_method=t.method, ours_samples=t.samples, ours_fraction=floor / t.us)
        except Exception as e:
            row["errors"].append(f"ours: {_err(e)}")
            log(traceback.format_exc())
        ours_copies = ours_copies[:1]
        _free(device)
        try:
            scheds = [get_meta()[0]]
            outs["flashmla"] = flashmla_call(fm, fm0, scheds[0])  # also fills its scheduling metadata
            _sync(device)  # a fault in FlashMLA's kernel surfaces here, labelled
            fm_copies = [fm0] + [to_flashmla(_clone(ours)) for _ in range(copies - 1)]
            for x in fm_copies[1:]:  # each copy its own metadata, filled outside the timed graph
                scheds.append(get_meta()[0])
                flashmla_call(fm, x, scheds[-1])
            _sync(device)
            t = kernel_time([functools.partial(flashmla_call, fm, x, s) for x, s in zip(fm_copies, scheds)],
                            device, args.target_ms)
            row.update(flashmla_us=t.us, flashmla_method=t.method, flashmla_samples=t.samples,
                       flashmla_fraction=floor / t.us)
        except Exception as e:
            row["errors"].append(f"FlashMLA: {_err(e)}")
            log(traceback.format_exc())
        fm_copies = fm_copies[:1]
        _free(device)
        if row["ours_us"] and row["flashmla_us"]:
            row["ratio"] = row["ours_us"] / row["flashmla_us"]
        if "ours" in outs and "flashmla" in outs:
            row["check"] = agreement(outs["ours"], outs["flashmla"])
            row["vs_reference"] = vs_reference(ours, outs)
            holes = with_holes(ours, seed=case.seed)
            got = dsv4_ops.sparse_attention(*holes)
            want = flashmla_call(fm, to_flashmla(holes), get_meta()[0])
            _sync(device)
            row["check_holes"] = agreement(got, want)
            for name in ("check", "check_holes"):
                if not row[name]["ok"]:
                    row["errors"].append(f"{name}: ours and FlashMLA disagree: {row[name]['why']} "
                                         f"(max abs diff {row[name].get('max_abs_diff')}; vs the fp32 reference: "
                                         + ", ".join(f"{k} rel err {v.get('rel_err')}"
                                                     for k, v in row["vs_reference"].items()) + ")")
    except Exception as e:
        row["errors"].append(_err(e))
        log(traceback.format_exc())
    finally:
        del ours_copies, fm_copies
        _free(device)
    if row["errors"]:
        row["status"] = "error"
    return row


# ---- report ---------------------------------------------------------------------------------
COLUMNS = ("batch", "ours µs", "FlashMLA µs", "ours/FlashMLA", "floor µs", "ours % floor", "FlashMLA % floor",
           "max abs diff", "rel err", "status")


def table_row(r: dict) -> str:
    def pct(x):
        return "–" if x is None else f"{x * 100:.1f}%"

    check = r.get("check") or {}
    cells = (str(r["batch"]), report._num(r["ours_us"]), report._num(r["flashmla_us"]),
             "–" if r["ratio"] is None else f"{r['ratio']:.3f}", report._num(r["floor_us"]),
             pct(r.get("ours_fraction")), pct(r.get("flashmla_fraction")),
             "–" if "max_abs_diff" not in check else f"{check['max_abs_diff']:.3g}",
             "–" if "rel_err" not in check else f"{check['rel_err']:.3g}", r["status"])
    return "| " + " | ".join(cells) + " |"


def details(r: dict) -> str:
    """Which kernel of ours ran, how each was timed, over how many input copies."""
    cold = {True: ", L2-cold", False: ", NOT L2-cold", None: ""}[r.get("l2_cold")]
    return (f"ours: {r.get('ours_route', '?')}, {r.get('ours_method', 'not timed')}; FlashMLA: "
            f"{r.get('flashmla_method', 'not timed')}; {r.get('copies', '?')} input copies{cold}; "
            f"holes check: {'ok' if (r.get('check_holes') or {}).get('ok') else 'FAILED or not run'}")


def table(rows: list[dict]) -> str:
    return "\n".join(["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)] + [table_row(r) for r in rows])


def _setup(args: argparse.Namespace, device: torch.device) -> str | None:
    """Why the run cannot start on ``device``, or None."""
    if device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return "no CUDA device: run it on the GPU box (H200), or smoke-test with --device cpu and a stand-in flash_mla"
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        return f"FlashMLA's MODEL1 decode kernel here is built for sm_90 (H100/H200); this GPU is sm_{cap[0]}{cap[1]}"
    if lowering.BACKEND != "triton":
        return (f"the dsv4 backend is {lowering.BACKEND!r} (DSV4_OPS_BACKEND): torch.ops.dsv4 would not run "
                "the Triton kernels. Unset DSV4_OPS_BACKEND or set it to 'triton'.")
    return None


def main(argv: list[str] | None = None, log=print) -> int:
    p = argparse.ArgumentParser(prog="bench_flashmla", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flashmla", required=True, metavar="DIR", help="FlashMLA folder (built: flash_mla/cuda*.so)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 128])
    p.add_argument("--topk", type=int, default=512, help="compressed entries picked per query (default: %(default)s)")
    p.add_argument("--window", type=int, default=128, help="window entries (default: %(default)s)")
    p.add_argument("--ctx", type=int, default=32768, help="context; the pool has ctx/4 entries (default: %(default)s)")
    p.add_argument("--out", default="out/bench_flashmla.json", help="JSON written per batch (default: %(default)s)")
    p.add_argument("--target-ms", type=float, default=100.0, help="device time of one measurement's samples")
    p.add_argument("--copies", type=int, default=None,
                   help="input copies a timed pass cycles through (default: enough to touch 2x L2, at most 128)")
    p.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke run with a stand-in flash_mla")
    args = p.parse_args(argv)
    if min(args.batches) < 1 or args.topk < 1 or args.window < 1 or args.ctx // 4 < args.topk or args.copies == 0:
        p.error("batches >= 1, topk >= 1, window >= 1, ctx/4 >= topk, copies >= 1")
    device = torch.device(args.device)
    why = _setup(args, device)
    if why:
        log(f"bench_flashmla: {why}")
        return 2
    try:
        fm, get_meta, fm_file = import_flashmla(args.flashmla)
    except ImportError as e:
        log(f"bench_flashmla: {e}")
        return 2
    meta = _meta(SimpleNamespace(mem_gb=ROTATION_BYTES / 1e9), device)
    meta.update(flashmla=fm_file, batches=args.batches, topk=args.topk, window=args.window, ctx=args.ctx,
                heads=C.FLASH.heads, head_dim=C.FLASH.head_dim, flashmla_page=PAGE, rel_tol=REL_TOL, holes=HOLES,
                timing=report.TIMING_CUDA if device.type == "cuda" else report.TIMING_CPU)
    log(f"bench_flashmla on {meta['device']}: FlashMLA from {fm_file}; V4-Flash CSA decode, window {args.window} + "
        f"top-k {args.topk} of {args.ctx // 4} entries, batches {args.batches}")
    rows = []
    out = Path(args.out)
    log(table([]))
    for B in args.batches:
        start = time.perf_counter()
        try:
            r = measure(B, args, device, fm, get_meta, log)
        except Exception as e:  # measure keeps its own errors; this is the last resort
            log(traceback.format_exc())
            r = dict(batch=B, status="error", errors=[_err(e)], ours_us=None, flashmla_us=None, ratio=None,
                     floor_us=None)
        r["seconds"] = time.perf_counter() - start
        rows.append(r)
        log(table_row(r) + "\n    " + details(r) + "".join(f"\n    {e}" for e in r["errors"]))
        report.write_json(out, meta, rows)
    log("\n" + table(rows))
    log(f"floor: {rl.HBM_BYTES_PER_S / 1e12:g} TB/s, {rl.BF16_FLOPS_PER_S / 1e12:g} TFLOP/s (roofline.py); "
        f"agreement: relative L2 error <= {REL_TOL:g}; wrote {out}")
    failed = [r for r in rows if r["errors"]]
    for r in failed:
        log(f"FAILED B={r['batch']}: " + "; ".join(r["errors"]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
