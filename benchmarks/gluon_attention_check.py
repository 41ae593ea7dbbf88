"""H200 check of the Gluon decode-attention prototype against the tl kernel and the reference.

    PYTHONPATH=$PWD python3 benchmarks/gluon_attention_check.py [--sweep] [--batches 1 64 128] [--variants v0 v3]
    PYTHONPATH=$PWD python3 benchmarks/gluon_attention_check.py --diagnose [--diag-batches 64 128]

Inputs at V4-Flash decode widths (H=64, D=512, W=128 window rows of a 256-row ring, top-k
K=512 of an 8192-entry pool = 32K context), some -1 indices in kv_idx / cmp_idx, random sink.
Two entry sets per batch size: ``csa`` (cmp_len = 0: the hot CSA layer the tl kernel was
profiled on) and ``mixed`` (cmp_len random per row in [0, Nc]: a dense prefix too, which
also exercises blocks straddling the segments and the ragged end).

Per case: max abs error of the tl launcher and the Gluon launcher against the fp32 reference
(``dsv4_ops.reference.sparse_attention`` on fp32 copies) and against each other, then both
timed with CUDA graphs on L2-cold input copies (``benchmarks/timing.kernel_time``). One line
a case: ``case B=.. tl_us=.. gluon_us=.. err_tl=.. err_gluon=..`` (the default variant and
config). ``--sweep`` adds every variant of ``--variants`` (default: all) at its
``SWEEP_CONFIGS`` (BLOCK_N x NUM_STAGES) x splits {1, 2} at ``--sweep-batches`` (64 128), each
checked against the reference before it is timed; configs that fail (e.g. more shared memory
than an SM has) print their error's first line and the sweep goes on. Variants run in the given
order and every line is flushed, so a kernel that hangs leaves the earlier lines printed.

``--diagnose`` runs only this: the default config of v0 and v3 (``--diag-variants``) timed with each of its DIAG switches
(``lowering/gluon/sparse_attention.py``: no row copies after the prologue, no P @ rows, no
softmax, no index loads, no copies and no index loads, one block, no block) at
``--diag-batches`` x ``--modes``, one line each: ``diag VARIANT MODE B=.. NAME: us=.. delta=..`` (delta
against the default of that case). The switches make the results wrong: nothing is checked.

Exit code 1 if a Gluon result is further from the reference than 2 x the tl kernel's error +
1e-2, or if the default Gluon config failed to run at all.
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.timing import kernel_time, l2_bytes, rotation_copies  # noqa: E402
from dsv4_ops import reference as ref  # noqa: E402
from lowering.gluon.sparse_attention import DIAG_VARIANTS, sparse_attention_gluon  # noqa: E402
from lowering.triton.sparse_attention import sparse_attention as sparse_attention_tl  # noqa: E402

H, D, W, RING, K, NC = 64, 512, 128, 256, 512, 8192
SCALE = D ** -0.5
COPY_BUDGET = 8 * 2**30  # bytes of input copies for the L2-cold timing


def log(msg: str) -> None:
    print(msg, flush=True)


def make_inputs(B: int, mode: str, seed: int, dev: torch.device) -> tuple:
    g = torch.Generator(device=dev).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=dev, dtype=torch.float32)

    def randint(lo, hi, *shape):
        return torch.randint(lo, hi, shape, generator=g, device=dev, dtype=torch.int32)

    q = randn(B, 1, H, D).bfloat16()
    kv = randn(B, RING, D).bfloat16()
    cmp = randn(B, NC, D).bfloat16()
    kv_idx = randint(0, RING, B, 1, W)
    cmp_idx = randint(0, NC, B, 1, K)
    # -1 holes (skipped entries), and a few out-of-range ones (skipped like -1 by the contract)
    kv_idx[torch.rand(kv_idx.shape, generator=g, device=dev) < 0.1] = -1
    cmp_idx[torch.rand(cmp_idx.shape, generator=g, device=dev) < 0.1] = -1
    cmp_idx[..., :3] = NC + 5
    if B > 1:
        kv_idx[1] = -1  # one query with no window rows at all
    if mode == "csa":
        cmp_len = torch.zeros(B, 1, dtype=torch.int32, device=dev)
    else:
        cmp_len = randint(0, NC + 1, B, 1)
        cmp_len[0] = NC  # the longest row
    sink = randn(H)
    return q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink


def reference(inputs) -> torch.Tensor:
    q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink = inputs
    outs = []
    for b in range(0, q.shape[0], 16):  # the reference expands the pool per query: bound its memory
        s = slice(b, b + 16)
        outs.append(ref.sparse_attention(q[s].float(), kv[s].float(), kv_idx[s], cmp[s].float(), cmp_idx[s],
                                         cmp_len[s], sink.float(), SCALE))
    return torch.cat(outs)


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    d = (a.float() - b.float()).abs()
    return float("nan") if d.isnan().any() else float(d.max())


def timed(fn, copies) -> float:
    return kernel_time([lambda c=c: fn(*c) for c in copies], torch.device("cuda")).us


def copies_for(B: int, mode: str, first) -> list:
    """``first`` plus enough independent copies that a timed pass misses L2."""
    q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink = first
    rows = W + K + int(cmp_len.clamp(0, NC).float().mean())
    touched = B * rows * D * 2
    alloc = sum(t.numel() * t.element_size() for t in first)
    n = rotation_copies(touched, alloc, l2_bytes(q.device), COPY_BUDGET)
    return [first] + [make_inputs(B, mode, 1000 + i, q.device) for i in range(n - 1)]


def gluon_fn(**cfg):
    return lambda *a: sparse_attention_gluon(*a, SCALE, **cfg)


def tl_fn(*a):
    return sparse_attention_tl(*a, SCALE)


def first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text.splitlines()[0] if text else type(e).__name__


def run_case(B: int, mode: str, failures: list, variant: str = "v3") -> list | None:
    dev = torch.device("cuda")
    t0 = time.time()
    inputs = make_inputs(B, mode, seed=B, dev=dev)
    want = reference(inputs)
    out_tl = tl_fn(*inputs)
    torch.cuda.synchronize()
    err_tl = err(out_tl, want)
    try:
        out_g = gluon_fn(variant=variant)(*inputs)
        torch.cuda.synchronize()
        err_g, err_x = err(out_g, want), err(out_g, out_tl)
    except Exception as e:  # report and go on: one broken config must not hide the others
        log(f"case {mode} B={B}: gluon FAILED: {first_line(e)}")
        traceback.print_exc(limit=3)
        failures.append(f"{mode} B={B}: gluon failed ({first_line(e)})")
        return None
    bound = 2 * err_tl + 1e-2
    if not err_g <= bound:  # also catches NaN
        failures.append(f"{mode} B={B}: err_gluon {err_g:.4g} > bound {bound:.4g}")
    copies = copies_for(B, mode, inputs)
    tl_us = timed(tl_fn, copies)
    try:
        g_us = timed(gluon_fn(variant=variant), copies)
    except Exception as e:
        log(f"case {mode} B={B}: gluon timing FAILED: {first_line(e)}")
        g_us = float("nan")
    log(f"case {mode} B={B} variant={variant} tl_us={tl_us:.1f} gluon_us={g_us:.1f} err_tl={err_tl:.3g} err_gluon={err_g:.3g} "
        f"err_tl_vs_gluon={err_x:.3g} copies={len(copies)} ({time.time() - t0:.0f}s)")
    return copies


# (BLOCK_N, NUM_STAGES) a variant is swept at, each at splits 1 and 2: the session-13 sweep's best
# (64 x 2) and the smaller blocks with a deeper ring (32 x 4)
SWEEP_CONFIGS = {
    "v0": [(32, 4), (64, 2)],
    "v3": [(32, 4), (64, 2)],
    "ws": [(32, 4), (64, 2)],  # the warp-specialised kernel (sparse_attention_ws.py): no DIAG switches
}

# --diagnose: (name, diag switches) of the v0 default config, each timed against the default
DIAG_RUNS = [
    ("default", {}),
    ("no_gather", dict(no_gather=True)),
    ("no_pv", dict(no_pv=True)),
    ("no_softmax", dict(no_softmax=True)),
    ("no_index", dict(no_index=True)),
    ("no_gather+no_index", dict(no_gather=True, no_index=True)),
    ("max_blocks=1", dict(max_blocks=1)),
    ("max_blocks=0", dict(max_blocks=0)),
]


def diagnose(B: int, mode: str, variant: str) -> None:
    """One line a DIAG_RUNS entry of ``variant``'s default config; a config that fails prints its
    error's first line."""
    dev = torch.device("cuda")
    inputs = make_inputs(B, mode, seed=B, dev=dev)
    copies = copies_for(B, mode, inputs)
    base = None
    for name, diag in DIAG_RUNS:
        try:
            fn = gluon_fn(diag=diag, variant=variant)
            fn(*inputs)  # compile outside the timing
            torch.cuda.synchronize()
            us = timed(fn, copies)
        except Exception as ex:
            log(f"diag {variant} {mode} B={B} {name}: FAILED {first_line(ex)}")
            torch.cuda.synchronize()
            continue
        if name == "default":
            base = us
        delta = f"{us - base:+.1f}" if base is not None else "n/a"
        log(f"diag {variant} {mode} B={B} {name}: us={us:.1f} delta={delta}")


def sweep(B: int, mode: str, variants: list, failures: list) -> None:
    dev = torch.device("cuda")
    inputs = make_inputs(B, mode, seed=B, dev=dev)
    want = reference(inputs)
    err_tl = err(tl_fn(*inputs), want)
    copies = copies_for(B, mode, inputs)
    log(f"sweep {mode} B={B}: tl_us={timed(tl_fn, copies):.1f} err_tl={err_tl:.3g}")
    for variant in variants:
        for block_n, stages in SWEEP_CONFIGS[variant]:
            for splits in (1, 2):
                cfg = dict(block_n=block_n, num_stages=stages, num_splits=splits, variant=variant)
                name = f"sweep {mode} B={B} variant={variant} BLOCK_N={block_n} NUM_STAGES={stages} splits={splits}"
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 128])
    ap.add_argument("--modes", nargs="+", default=["csa", "mixed"], choices=["csa", "mixed"])
    ap.add_argument("--sweep", action="store_true", help="also sweep the Gluon configs at B=64 and 128")
    ap.add_argument("--variants", nargs="+", default=list(SWEEP_CONFIGS), choices=list(SWEEP_CONFIGS),
                    help="kernel variants the sweep runs (lowering/gluon/sparse_attention.py VARIANTS); "
                         "in this order, so a variant that hangs leaves the earlier lines printed")
    ap.add_argument("--variant", default="v3", choices=list(SWEEP_CONFIGS),
                    help="the variant the cases (--batches, at its default config) run")
    ap.add_argument("--sweep-batches", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--diagnose", action="store_true",
                    help="only time the v0 default against each of its DIAG switches (results wrong, unchecked)")
    ap.add_argument("--diag-batches", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--diag-variants", nargs="+", default=list(DIAG_VARIANTS), choices=list(DIAG_VARIANTS))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        log("no CUDA device")
        return 2
    log(f"device {torch.cuda.get_device_name()} torch {torch.__version__} triton "
        f"{__import__('triton').__version__}")
    if args.diagnose:
        for B in args.diag_batches:
            for mode in args.modes:
                for variant in args.diag_variants:
                    try:
                        diagnose(B, mode, variant)
                    except Exception as e:  # inputs or copies: report, go on
                        log(f"diag {variant} {mode} B={B}: FAILED {first_line(e)}")
                    torch.cuda.empty_cache()
        return 0
    failures: list[str] = []
    for B in args.batches:
        for mode in args.modes:
            log(f"... case {mode} B={B}")
            try:
                run_case(B, mode, failures, args.variant)
            except Exception as e:  # the tl side or the reference: report, go on
                log(f"case {mode} B={B}: FAILED {first_line(e)}")
                traceback.print_exc(limit=3)
                failures.append(f"{mode} B={B}: {first_line(e)}")
            torch.cuda.empty_cache()
    if args.sweep:
        for B in args.sweep_batches:
            for mode in args.modes:
                try:
                    sweep(B, mode, args.variants, failures)
                except Exception as e:
                    log(f"sweep {mode} B={B}: FAILED {first_line(e)}")
                torch.cuda.empty_cache()
    if failures:
        log("FAILURES:\n  " + "\n  ".join(failures))
        return 1
    log("all Gluon results within bounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
