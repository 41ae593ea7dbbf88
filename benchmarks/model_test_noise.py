"""How far the V4-width test model's decode logits move when its attention outputs move by bf16
rounding only: the noise floor of ``test_model_at_v4_attention_widths_decodes_with_the_gluon_kernel``.

    PYTHONPATH=$PWD python3 benchmarks/model_test_noise.py [--seeds 6] [--cpu]

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
head of 64 zeroed. ``--cpu``: the same model on the CPU's kernels, the noise and the wrong
attentions only (its noise floor is the CPU's; the wrong attentions' scale is what it is for).
"""
import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import dsv4_ops.lowering.gluon.sparse_attention as ga  # noqa: E402  (the module the op calls)
import dsv4_ops.model.attention as model_attention  # noqa: E402  (its module global dsv4 = torch.ops.dsv4)
from dsv4_ops import Generator  # noqa: E402
from dsv4_ops.ops import attention_sm90 as sm90  # noqa: E402
from model_util import random_model  # noqa: E402
from ops.test_sparse_attention_sm90 import GENERATOR_OPTIONS, V4_ATTENTION, model_test_decode  # noqa: E402

real = ga.sparse_attention_gluon


class AttentionHooked:
    """``torch.ops.dsv4`` as the model sees it, with every decode call of ``sparse_attention``
    passed through ``hook(args, out)`` (whichever kernel ran: Gluon, Triton or the CPU's)."""

    def __init__(self, hook):
        self.hook = hook

    def __getattr__(self, name):
        op = getattr(torch.ops.dsv4, name)
        if name != "sparse_attention":
            return op

        def call(*args):
            out = op(*args)
            return self.hook(args, out) if args[0].shape[1] == 1 else out
        return call


def decode(m, picks=None, variant_of=None, noise_seed=None, wrong=None):
    """Logits of prefill + 8 decode steps; ``picks`` collects each decode call's cmp_idx.
    ``variant_of(splits)``: the Gluon variant a call runs (CUDA). ``wrong``: "stale" (each call
    returns the same layer's output of the previous step, the CUDA-graph bug of reading a buffer
    not refreshed) or "one_head" (head 0's output zeroed: 1/64 of the attention wrong)."""
    previous = {}
    calls = [0]

    def launcher(*args, **kw):
        q, kv, kv_idx, cmp, cmp_idx, cmp_len = args[:6]
        splits = ga.gluon_config(q.shape[0], kv_idx.shape[-1] + (cmp_idx.shape[-1] or cmp.shape[1]))["NUM_SPLITS"]
        return real(*args, **dict(kw, variant=variant_of(splits)))

    def hook(args, out):
        if picks is not None:
            picks.append(args[4].clone())
        layer, calls[0] = calls[0] % 3, calls[0] + 1  # the model's 3 layers, in order, every step
        if wrong == "stale":
            fresh = out.clone()
            if layer in previous:
                out.copy_(previous[layer])
            previous[layer] = fresh
        elif wrong == "one_head":
            out[:, :, 0] = 0
        if noise_seed is not None:
            g = torch.Generator(device=out.device).manual_seed(noise_seed + calls[0])
            flip = torch.rand(out.shape, generator=g, device=out.device) < 0.5
            bits = out.view(torch.int16)
            bits.copy_(torch.where(flip, bits ^ 1, bits))
        return out

    if variant_of is not None:
        ga.sparse_attention_gluon = launcher
    model_attention.dsv4 = AttentionHooked(hook)
    try:
        return model_test_decode(Generator(m, compile=False, kv_cache_dtype="auto", **GENERATOR_OPTIONS))
    finally:
        ga.sparse_attention_gluon = real
        model_attention.dsv4 = torch.ops.dsv4


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--cpu", action="store_true",
                    help="on the CPU's kernels: the noise floor and the wrong attentions only (no Gluon routes)")
    args = ap.parse_args()
    if not (args.cpu or torch.cuda.is_available()):
        print("no CUDA device")
        return 2
    m = random_model(V4_ATTENTION, dtype=torch.bfloat16, device="cpu" if args.cpu else "cuda")
    base_name = "CPU" if args.cpu else "Triton"
    base_picks = []
    with sm90.disabled():
        base = decode(m, base_picks)

    def rel(a, b=base):
        return float((a - b).abs().max() / b.abs().max())

    def pick_flips(picks, ref):
        flips = 0
        for a, b in zip(picks, ref):
            if a.shape[-1]:  # the CSA layer's calls (the HCA and sliding layers pick nothing)
                for r in range(a.shape[0]):
                    flips += len(set(a[r].flatten().tolist()) - set(b[r].flatten().tolist()))
        return flips

    ref, ref_picks, ref_name, variant_of = base, base_picks, base_name, None
    if not args.cpu:  # the Gluon routes, against Triton; the noise then goes on v3
        ref_picks = []
        ref, ref_name, variant_of = decode(m, ref_picks, variant_of=lambda s: "v3"), "v3", lambda s: "v3"
        print(f"route v3: logits vs Triton {rel(ref):.3e}", flush=True)
        for name, route in (("ws", lambda s: "ws"), ("mix (v3 at 2 splits, ws elsewhere)",
                                                   lambda s: "v3" if s == 2 else "ws")):
            picks = []
            out = decode(m, picks, variant_of=route)
            print(f"route {name}: logits vs Triton {rel(out):.3e}, vs v3 {rel(out, ref):.3e}; "
                  f"CSA picks differing from v3's: {pick_flips(picks, ref_picks)}", flush=True)
    errs = []
    for seed in range(args.seeds):
        picks = []
        out = decode(m, picks, variant_of=variant_of, noise_seed=1000 * (seed + 1))
        errs.append(rel(out))
        print(f"{ref_name} + 1-ulp noise (seed {seed}): logits vs {base_name} {errs[-1]:.3e}, vs {ref_name} "
              f"{rel(out, ref):.3e}; CSA picks differing from {ref_name}'s: {pick_flips(picks, ref_picks)}", flush=True)
    if errs:
        print(f"noise floor over {args.seeds} seeds: logits vs {base_name} {min(errs):.3e} .. {max(errs):.3e}")
    for wrong in ("stale", "one_head"):
        out = decode(m, variant_of=variant_of, wrong=wrong)
        print(f"{ref_name}, attention made wrong ({wrong}): logits vs {base_name} {rel(out):.3e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
