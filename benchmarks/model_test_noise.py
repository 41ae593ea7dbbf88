"""How far the V4-width test model's decode logits move when its attention outputs move by bf16
rounding only: the noise floor of ``test_model_at_v4_attention_widths_decodes_with_the_gluon_kernel``.

    PYTHONPATH=$PWD python3 benchmarks/model_test_noise.py [--seeds 6]

The test compares the model's decode logits through the Gluon attention against the Triton
route's. Session 19 measured 1.9e-2 with v3 routed (bound 2e-2), 1.62e-1 with ws at some calls
and v3 at the others, while every call's output was as close to the float64 oracle with either
kernel. This script runs the same model and decode (eager) with the routes: Triton; Gluon v3; Gluon
ws; the session-19 mix (v3 at two splits, ws elsewhere); and v3 with the last bit of a random half
of every attention output flipped (one run per noise seed: outputs that differ from v3's by one
bf16 ulp, what a different but equally exact kernel produces). For each it prints the logits'
max relative error against the Triton route's and how many of the CSA layer's top-k picks differ
from the v3 route's (a pick flips when bf16 noise upstream reorders two near-equal indexer scores;
a flipped pick changes the attention output by a whole entry's share, far more than rounding).
Then two wrong attentions for scale: each call's output of the previous step (stale), and one
head of 64 zeroed.
"""
import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import dsv4_ops.lowering.gluon.sparse_attention as ga  # noqa: E402  (the module the op calls)
from dsv4_ops import Generator  # noqa: E402
from dsv4_ops.ops import attention_sm90 as sm90  # noqa: E402
from model_util import random_model  # noqa: E402
from ops.test_sparse_attention_sm90 import GENERATOR_OPTIONS, V4_ATTENTION, model_test_decode  # noqa: E402

real = ga.sparse_attention_gluon


def decode(m, picks=None, variant_of=None, noise_seed=None, wrong=None):
    """Logits of prefill + 8 decode steps; ``picks`` collects each Gluon call's cmp_idx.
    ``wrong``: "stale" (each call returns the same layer's output of the previous step, the
    CUDA-graph bug of reading a buffer not refreshed) or "one_head" (head 0's output zeroed: 1/64
    of the attention wrong)."""
    previous = {}
    calls = [0]

    def launcher(*args, **kw):
        q, kv, kv_idx, cmp, cmp_idx, cmp_len = args[:6]
        if variant_of is not None:
            splits = ga.gluon_config(q.shape[0], kv_idx.shape[-1] + (cmp_idx.shape[-1] or cmp.shape[1]))["NUM_SPLITS"]
            kw["variant"] = variant_of(splits)
        out = real(*args, **kw)
        if picks is not None:
            picks.append(cmp_idx.clone())
        layer, calls[0] = calls[0] % 3, calls[0] + 1  # the model's 3 layers, in order, every step
        if wrong == "stale":
            fresh = out.clone()
            if layer in previous:
                out.copy_(previous[layer])
            previous[layer] = fresh
        elif wrong == "one_head":
            out[:, :, 0] = 0
        if noise_seed is not None:
            g = torch.Generator(device=out.device).manual_seed(noise_seed + len(picks or ()))
            flip = torch.rand(out.shape, generator=g, device=out.device) < 0.5
            bits = out.view(torch.int16)
            bits.copy_(torch.where(flip, bits ^ 1, bits))
        return out

    ga.sparse_attention_gluon = launcher
    try:
        return model_test_decode(Generator(m, compile=False, kv_cache_dtype="auto", **GENERATOR_OPTIONS))
    finally:
        ga.sparse_attention_gluon = real


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=6)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    m = random_model(V4_ATTENTION, dtype=torch.bfloat16, device="cuda")
    with sm90.disabled():
        triton = decode(m)

    def rel(a):
        return float((a - triton).abs().max() / triton.abs().max())

    v3_picks = []
    v3 = decode(m, v3_picks, variant_of=lambda s: "v3")

    def pick_flips(picks):
        flips = 0
        for a, b in zip(picks, v3_picks):
            if a.shape[-1]:  # the CSA layer's calls (the HCA and sliding layers pick nothing)
                for r in range(a.shape[0]):
                    sa, sb = set(a[r].flatten().tolist()), set(b[r].flatten().tolist())
                    flips += len(sa - sb)
        return flips

    print(f"route v3: logits vs Triton {rel(v3):.3e}", flush=True)
    for name, variant_of in (("ws", lambda s: "ws"), ("mix (v3 at 2 splits, ws elsewhere)",
                                                      lambda s: "v3" if s == 2 else "ws")):
        picks = []
        out = decode(m, picks, variant_of=variant_of)
        print(f"route {name}: logits vs Triton {rel(out):.3e}, vs v3 {float((out - v3).abs().max() / v3.abs().max()):.3e}; "
              f"CSA picks differing from v3's: {pick_flips(picks)}", flush=True)
    errs = []
    for seed in range(args.seeds):
        picks = []
        out = decode(m, picks, variant_of=lambda s: "v3", noise_seed=1000 * (seed + 1))
        errs.append(rel(out))
        print(f"v3 + 1-ulp noise (seed {seed}): logits vs Triton {errs[-1]:.3e}, vs v3 "
              f"{float((out - v3).abs().max() / v3.abs().max()):.3e}; CSA picks differing from v3's: {pick_flips(picks)}",
              flush=True)
    print(f"noise floor over {args.seeds} seeds: logits vs Triton {min(errs):.3e} .. {max(errs):.3e}")
    for wrong in ("stale", "one_head"):
        out = decode(m, variant_of=lambda s: "v3", wrong=wrong)
        print(f"v3, attention made wrong ({wrong}): logits vs Triton {rel(out):.3e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
