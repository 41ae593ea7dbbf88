"""H200 check of the Gluon FP8-cache decode attention against the tl kernel and the reference.

    PYTHONPATH=$PWD python3 benchmarks/gluon_fp8_attention_check.py [--sweep] [--batches 1 64 128]

Inputs at V4-Flash decode widths (H=64, D=512, W=128 window entries in a 128-entry FP8 ring of
one page, top-k K=512 of an 8192-entry FP8 pool in 64-entry pages = 32K context), built from
random values by the project's own quantiser (``fp8_cache.quantize_kv``, FlashMLA's MODEL1
layout), some -1 and out-of-range indices, random sink. Cases per batch size:

- ``csa``: FP8 mode 2 (FP8 window + FP8 pool), cmp_len = 0 (the hot CSA layer);
- ``mixed``: mode 2 with a dense prefix (cmp_len random per row in [0, Nc]): blocks straddle the
  segments, ragged ends;
- ``csa_mode1``: FP8 mode 1 (a bf16 float window [B, 256, D], the FP8 pool).

Per case: max abs error of the tl kernel (``lowering.triton.sparse_attention.sparse_attention``
on the same FP8 caches) and of the Gluon kernel against the fp32 reference
(``dsv4_ops.reference.sparse_attention`` on the dequantised caches) and against each other,
then both timed with CUDA graphs on L2-cold input copies (``benchmarks/timing.kernel_time``).
One line a case: ``case .. B=.. tl_us=.. gluon_us=.. err_tl=.. err_gluon=..``.

Before the cases, ``exact``: one valid entry per query (window or pool, every page slot and
scale in play, values down to e4m3 subnormals) and a sink of -1e30, so the softmax weight is
exactly 1 and the output is the decoded row itself: the Gluon output must equal the
dequantised row (bf16) value for value (a -0.0 comes out +0.0), as the tl kernel's does (modes 2 and 1, splits 1 and 2).

``--variants`` (default: v0 ws): the kernels checked and timed, each on every case and in the
exact check (``v0``: the session-13 reader; ``ws``: ``sparse_attention_fp8_ws.py``, decoder warps
beside the MMA warps); the case line then reads ``gluon_<variant>_us`` and ``err_<variant>``.

``--sweep``: per variant, its configs (v0: BLOCK_N x NUM_STAGES x decode store, ``SWEEP_CONFIGS``;
ws: NUM_STAGES byte blocks x E_STAGES decoded blocks, ``SWEEP_CONFIGS_WS``) x splits {1, 2} at
``--sweep-batches`` (64 128), each checked against the reference before it is timed; a config
that fails prints the first line of its error and the sweep goes on.

Exit code 1 if a Gluon result is further from the reference than 2 x the tl kernel's error +
1e-2, if the exact check differs, or if the default Gluon config failed to run at all.
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.timing import l2_bytes, rotation_copies  # noqa: E402
from dsv4_ops import reference as ref  # noqa: E402
from dsv4_ops.reference import fp8_cache as fp8  # noqa: E402
from lowering.gluon import sparse_attention_fp8_ws as ws  # noqa: E402
from lowering.gluon.sparse_attention_fp8 import sparse_attention_gluon_fp8  # noqa: E402
from lowering.triton.sparse_attention import sparse_attention as sparse_attention_tl  # noqa: E402
# the bf16 check's helpers: log, the max abs error, the CUDA-graph timer, the tl launch, an error's first line
from benchmarks.gluon_attention_check import err, first_line, log, timed, tl_fn  # noqa: E402

H, D, ROPE, W, K, NC, PAGE = 64, 512, 64, 128, 512, 8192, 64
RING_FLOAT = 256  # mode 1: the float window ring's rows
SCALE = D ** -0.5
COPY_BUDGET = 8 * 2**30  # bytes of input copies for the L2-cold timing
MODES = ["csa", "mixed", "csa_mode1"]
VARIANTS = ["v0", "ws"]  # lowering/gluon/sparse_attention_fp8.py VARIANTS


def fp8_cache(values: torch.Tensor, page: int) -> torch.Tensor:
    """``[B, N, D]`` values -> an FP8 page cache ``uint8 [B, N / page, page, 584]`` (the project's quantiser)."""
    data, scales = fp8.quantize_kv(values, ROPE)
    lay = fp8.KVLayout(D, ROPE, page)
    return fp8.from_entries(torch.cat([data, scales], -1), page, lay.data_bytes).contiguous()


def dequant(cache: torch.Tensor) -> torch.Tensor:
    return fp8.read_kv(cache, D)  # fp32 [B, N, D], exact


def spread(g, *shape, dev) -> torch.Tensor:
    """Random values over many binades (per-64 block scales vary; small values give e4m3 subnormals)."""
    x = torch.randn(*shape, generator=g, device=dev)
    e = torch.randint(-12, 6, shape, generator=g, device=dev).float()
    return x * torch.exp2(e)


def make_inputs(B: int, mode: str, seed: int, dev: torch.device) -> tuple:
    g = torch.Generator(device=dev).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=dev, dtype=torch.float32)

    def randint(lo, hi, *shape):
        return torch.randint(lo, hi, shape, generator=g, device=dev, dtype=torch.int32)

    q = randn(B, 1, H, D).bfloat16()
    if mode == "csa_mode1":
        kv = randn(B, RING_FLOAT, D).bfloat16()
        kv_idx = randint(0, RING_FLOAT, B, 1, W)
    else:
        kv = fp8_cache(randn(B, W, D), W)
        kv_idx = randint(0, W, B, 1, W)
    cmp = fp8_cache(randn(B, NC, D), PAGE)
    cmp_idx = randint(0, NC, B, 1, K)
    kv_idx[torch.rand(kv_idx.shape, generator=g, device=dev) < 0.1] = -1
    cmp_idx[torch.rand(cmp_idx.shape, generator=g, device=dev) < 0.1] = -1
    cmp_idx[..., :3] = NC + 5  # out of range: skipped like -1
    if B > 1:
        kv_idx[1] = -1  # one query with no window rows at all
    if mode == "mixed":
        cmp_len = randint(0, NC + 1, B, 1)
        cmp_len[0] = NC
    else:
        cmp_len = torch.zeros(B, 1, dtype=torch.int32, device=dev)
    sink = randn(H)
    return q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink


def reference(inputs) -> torch.Tensor:
    q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink = inputs
    outs = []
    for b in range(0, q.shape[0], 16):  # the reference expands the pool per query: bound its memory
        s = slice(b, b + 16)
        kvf = dequant(kv[s]) if kv.dim() == 4 else kv[s].float()
        outs.append(ref.sparse_attention(q[s].float(), kvf, kv_idx[s], dequant(cmp[s]), cmp_idx[s], cmp_len[s],
                                         sink.float(), SCALE))
    return torch.cat(outs)


def copies_for(B: int, mode: str, first) -> list:
    """``first`` plus enough independent copies that a timed pass misses L2."""
    q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink = first
    rows = W + K + int(cmp_len.clamp(0, NC).float().mean())
    touched = B * rows * (D + 72)  # FP8 entry bytes
    alloc = sum(t.numel() * t.element_size() for t in first)
    n = rotation_copies(touched, alloc, l2_bytes(q.device), COPY_BUDGET)
    return [first] + [make_inputs(B, mode, 1000 + i, q.device) for i in range(n - 1)]


def gluon_fn(**cfg):
    return lambda *a: sparse_attention_gluon_fp8(*a, SCALE, **cfg)


def exact_check(failures: list) -> None:
    """One valid entry a query, sink -1e30: out == the decoded row (bf16), value for value (+-0 equal)."""
    dev = torch.device("cuda")
    B = 64
    g = torch.Generator(device=dev).manual_seed(7)
    q = torch.randn(B, 1, H, D, generator=g, device=dev).mul(0.05).bfloat16()
    win_vals = spread(g, B, W, D, dev=dev)
    pool_vals = spread(g, B, NC, D, dev=dev)
    win8, pool8 = fp8_cache(win_vals, W), fp8_cache(pool_vals, PAGE)
    win_f = dequant(win8).bfloat16()
    pool_f = dequant(pool8).bfloat16()
    sink = torch.full((H,), -1e30, device=dev)
    cmp_len = torch.zeros(B, 1, dtype=torch.int32, device=dev)
    rows = torch.arange(B, device=dev)
    for src in ("window", "pool"):
        for mode in (2, 1):
            kv = win8 if mode == 2 else win_f
            kv_idx = torch.full((B, 1, W), -1, dtype=torch.int32, device=dev)
            cmp_idx = torch.full((B, 1, K), -1, dtype=torch.int32, device=dev)
            if src == "window":
                pick = torch.randint(0, W, (B,), generator=g, device=dev, dtype=torch.int32)
                slot = torch.randint(0, W, (B,), generator=g, device=dev)
                kv_idx[rows, 0, slot] = pick
                want = win_f[rows, pick.long()]
            else:
                pick = torch.randint(0, NC, (B,), generator=g, device=dev, dtype=torch.int32)
                slot = torch.randint(0, K, (B,), generator=g, device=dev)
                cmp_idx[rows, 0, slot] = pick
                want = pool_f[rows, pick.long()]
            want = want[:, None, None, :].expand(B, 1, H, D)
            args = (q, kv, kv_idx, pool8, cmp_idx, cmp_len, sink)
            for variant, splits in ((v, s) for v in variants for s in (1, 2)):
                name = f"exact {variant} {src} mode={mode} splits={splits}"
                try:
                    got = sparse_attention_gluon_fp8(*args, SCALE, num_splits=splits, variant=variant)
                    got_tl = sparse_attention_tl(*args, SCALE, num_splits=splits)
                    torch.cuda.synchronize()
                except Exception as e:
                    log(f"{name}: FAILED {first_line(e)}")
                    failures.append(f"{name}: {first_line(e)}")
                    continue
                # values, not bits: an entry's -0.0 comes out +0.0 (0 + P * -0.0), in both kernels
                # (the H200 run of session 13 counted those as bit mismatches, max abs 0)
                bad = int((got.float() != want.float()).sum())
                bad_tl = int((got_tl.float() != want.float()).sum())
                log(f"{name}: gluon mismatches {bad} / {want.numel()} (tl kernel: {bad_tl}), max abs "
                    f"{err(got, want):.3g}")
                if bad:
                    failures.append(f"{name}: {bad} values differ from the decoded rows")


def run_case(B: int, mode: str, failures: list) -> None:
    dev = torch.device("cuda")
    t0 = time.time()
    inputs = make_inputs(B, mode, seed=B, dev=dev)
    want = reference(inputs)
    out_tl = tl_fn(*inputs)
    torch.cuda.synchronize()
    err_tl = err(out_tl, want)
    copies = copies_for(B, mode, inputs)
    tl_us = timed(tl_fn, copies)
    line = f"case {mode} B={B} tl_us={tl_us:.1f}"
    errs = f"err_tl={err_tl:.3g}"
    for variant in variants:
        try:
            out_g = gluon_fn(variant=variant)(*inputs)
            torch.cuda.synchronize()
            err_g, err_x = err(out_g, want), err(out_g, out_tl)
        except Exception as e:  # report and go on: one broken kernel must not hide the others
            log(f"case {mode} B={B}: gluon {variant} FAILED: {first_line(e)}")
            traceback.print_exc(limit=3)
            failures.append(f"{mode} B={B}: gluon {variant} failed ({first_line(e)})")
            continue
        bound = 2 * err_tl + 1e-2
        if not err_g <= bound:  # also catches NaN
            failures.append(f"{mode} B={B}: err_{variant} {err_g:.4g} > bound {bound:.4g}")
        try:
            g_us = timed(gluon_fn(variant=variant), copies)
        except Exception as e:
            log(f"case {mode} B={B}: gluon {variant} timing FAILED: {first_line(e)}")
            g_us = float("nan")
        line += f" gluon_{variant}_us={g_us:.1f}"
        errs += f" err_{variant}={err_g:.3g} err_tl_vs_{variant}={err_x:.3g}"
    log(f"{line} {errs} copies={len(copies)} ({time.time() - t0:.0f}s)")


# (BLOCK_N, NUM_STAGES, ONE_STORE) swept, each at splits 1 and 2 (decoded buffers: two where they
# fit, else one; ONE_STORE 1: the decode's one-store variant, fewer barriers, a few spills)
SWEEP_CONFIGS = [(32, 2, 0), (32, 3, 0), (32, 4, 0), (32, 5, 0), (64, 2, 0), (32, 4, 1), (64, 2, 1)]
# ws: (NUM_STAGES byte blocks, E_STAGES decoded blocks of 32 rows, ONE_STORE rows decoded and stored at once
# (0: a 64-channel block at a time), the decoder's registers); 32 x 3 x 3 is 230,656 B of 232,448
# (L3_ROW: the 3D decode's layout keeps a row's 8 blocks in one thread; session 21's second sweep ran without it)
SWEEP_CONFIGS_WS = [(2, 3, 16, 112, True), (2, 3, 16, 112, False), (1, 3, 16, 112, True), (3, 2, 16, 112, True),
                    (2, 3, 32, 128, True), (2, 3, 0, 96, False)]
variants = list(VARIANTS)  # main() sets it from --variants
DECODER_REGS, L3_ROW = ws.DECODER_REGS, ws.L3_ROW  # the defaults, restored after the sweep


def sweep(B: int, mode: str, failures: list) -> None:
    dev = torch.device("cuda")
    inputs = make_inputs(B, mode, seed=B, dev=dev)
    want = reference(inputs)
    err_tl = err(tl_fn(*inputs), want)
    copies = copies_for(B, mode, inputs)
    log(f"sweep {mode} B={B}: tl_us={timed(tl_fn, copies):.1f} err_tl={err_tl:.3g}")
    configs = []
    if "v0" in variants:
        configs += [(f"v0 BLOCK_N={n} NUM_STAGES={st} ONE_STORE={one}",
                     dict(variant="v0", block_n=n, num_stages=st, one_store=one)) for n, st, one in SWEEP_CONFIGS]
    if "ws" in variants:
        configs += [(f"ws BLOCK_N=32 NUM_STAGES={st} E_STAGES={e} ONE_STORE={one} DECODER_REGS={regs} L3_ROW={row}",
                     dict(variant="ws", num_stages=st, e_bufs=e, one_store=one, decoder_regs=regs, l3_row=row))
                    for st, e, one, regs, row in SWEEP_CONFIGS_WS]
    for label, base in configs:
        for splits in (1, 2):
            cfg = dict(base, num_splits=splits)
            ws.DECODER_REGS = cfg.pop("decoder_regs", DECODER_REGS)  # read by the launcher at each call
            ws.L3_ROW = cfg.pop("l3_row", L3_ROW)
            name = f"sweep {mode} B={B} {label} splits={splits}"
            try:
                fn = gluon_fn(**cfg)
                e = err(fn(*inputs), want)  # checked before it is timed
                torch.cuda.synchronize()
                us = timed(fn, copies)
            except Exception as ex:
                log(f"{name}: FAILED {first_line(ex)}")
                torch.cuda.synchronize()
                continue
            flag = "" if e <= 2 * err_tl + 1e-2 else "  WRONG"
            if flag:
                failures.append(f"{name}: err {e:.4g}")
            log(f"{name}: gluon_us={us:.1f} err_gluon={e:.3g}{flag}")
    ws.DECODER_REGS, ws.L3_ROW = DECODER_REGS, L3_ROW


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 64, 128], help="the cases' batches (none: sweep only)")
    ap.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    ap.add_argument("--sweep", action="store_true", help="also sweep the Gluon configs at --sweep-batches")
    ap.add_argument("--sweep-batches", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--no-exact", action="store_true", help="skip the bit-exact decode check")
    ap.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    ap.add_argument("--codes-swizzle", type=int, choices=[0, 1], default=None,
                    help="ws: the byte ring's rows swizzled against bank conflicts (default: the launcher's CODES_SWIZZLE)")
    args = ap.parse_args()
    variants[:] = args.variants
    if args.codes_swizzle is not None:
        ws.CODES_SWIZZLE = bool(args.codes_swizzle)  # read by the launcher at each call
        log(f"ws CODES_SWIZZLE={ws.CODES_SWIZZLE}")
    if not torch.cuda.is_available():
        log("no CUDA device")
        return 2
    log(f"device {torch.cuda.get_device_name()} torch {torch.__version__} triton "
        f"{__import__('triton').__version__}")
    failures: list[str] = []
    if not args.no_exact:
        try:
            exact_check(failures)
        except Exception as e:
            log(f"exact: FAILED {first_line(e)}")
            traceback.print_exc(limit=3)
            failures.append(f"exact: {first_line(e)}")
        torch.cuda.empty_cache()
    for B in args.batches:
        for mode in args.modes:
            log(f"... case {mode} B={B}")
            try:
                run_case(B, mode, failures)
            except Exception as e:  # the tl side or the reference: report, go on
                log(f"case {mode} B={B}: FAILED {first_line(e)}")
                traceback.print_exc(limit=3)
                failures.append(f"{mode} B={B}: {first_line(e)}")
            torch.cuda.empty_cache()
    if args.sweep:
        for B in args.sweep_batches:
            for mode in args.modes:
                if mode == "csa_mode1":
                    continue  # the sweep times mode 2 (the FP8 decode cache)
                try:
                    sweep(B, mode, failures)
                except Exception as e:
                    log(f"sweep {mode} B={B}: FAILED {first_line(e)}")
                torch.cuda.empty_cache()
    if failures:
        log("FAILURES:\n  " + "\n  ".join(failures))
        return 1
    log("all Gluon FP8 results within bounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
