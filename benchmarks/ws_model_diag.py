"""Where the V4-width test model's decode goes wrong with the ws attention kernel (session 19 open question).

    PYTHONPATH=$PWD DSV4_OPS_GLUON_VARIANT=ws python3 benchmarks/ws_model_diag.py [--steps 8]

``tests/ops/test_sparse_attention_sm90.py::test_model_at_v4_attention_widths_decodes_with_the_gluon_kernel``
failed on the H200 with the ws kernel routed (Gluon vs Triton decode logits 1.62e-01 against the
bound 2e-2; v3: 1.90e-02), deterministically, while every direct call of the kernel on the model's
first two steps' inputs matched the float64 oracle as closely as v3 did. This script runs the
same model and decode (eager) with a spy on the Gluon launcher, and for every call prints: the
output the model got against a fresh launch on the same inputs (a difference means the kernel's
result depended on something other than its inputs, e.g. memory it should not touch), and both
variants' error against the float64 oracle, with the call's shapes, strides and scalars.

Answer (H200, session 20; ``benchmarks/results/h200_session20_*``): every one of the 24 calls gave
the model a fresh launch's bits, as close to the oracle as v3, with and without the q barrier
session 20 added. The failure was the test's own noise (``benchmarks/model_test_noise.py``).
"""
import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import dsv4_ops.lowering.gluon.sparse_attention as ga  # noqa: E402  (the module the op calls)
from dsv4_ops import Generator  # noqa: E402
from model_util import random_model  # noqa: E402
from ops.test_sparse_attention_sm90 import GENERATOR_OPTIONS, V4_ATTENTION, model_test_decode, oracle  # noqa: E402

calls = []
real = ga.sparse_attention_gluon


def spy(*args, **kw):
    inputs = [a.clone() if torch.is_tensor(a) else a for a in args[:8]]
    out = real(*args, **kw)
    calls.append((inputs, kw.get("variant"), out.clone()))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    ga.sparse_attention_gluon = spy
    m = random_model(V4_ATTENTION, dtype=torch.bfloat16, device="cuda")
    model_test_decode(Generator(m, compile=False, kv_cache_dtype="auto", **GENERATOR_OPTIONS), args.steps)
    print(f"{len(calls)} Gluon calls over {args.steps} decode steps", flush=True)
    for i, (a, variant, got) in enumerate(calls):
        q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale = a
        want = oracle(*a)
        again = real(*a, variant=variant)
        errs = {v: float((real(*a, variant=v).double() - want).abs().max()) for v in ("v3", "ws")}
        cfg = ga.gluon_config(q.shape[0], kv_idx.shape[-1] + (cmp_idx.shape[-1] or cmp.shape[1]), variant=variant)
        rng = {n: (int(t.min()), int(t.max())) if t.numel() else () for n, t in (("kv_idx", kv_idx), ("cmp_idx", cmp_idx))}
        print(f"call {i} ({cfg['variant']}, {cfg['NUM_SPLITS']} splits): model's output vs a fresh launch "
              f"{float((got.float() - again.float()).abs().max()):.3g}, vs oracle {float((got.double() - want).abs().max()):.3g}; "
              f"fresh launches vs oracle {errs}", flush=True)
        print("    " + ", ".join(f"{n} {tuple(t.shape)}/{t.stride()}" for n, t in
                                  zip(("q", "kv", "kv_idx", "cmp", "cmp_idx", "cmp_len"), a)),
              f"cmp_len {cmp_len.flatten().tolist()} {rng}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
