"""The indexer_topk tests' inputs and rules: the op's inputs and opcheck cases (``make_inputs``); the
kernels' inputs on ``DEVICE`` (``kernel_inputs``: small integers make every score exact in fp32
whatever the summation order, with many ties); the reference's top-k rule over given scores
(``reference_topk``) and what the split / fused stage 1 must leave in its candidate buffers
(``check_candidates``); the kernels the op body launches with a config forced (``op_body_launches``);
integer-valued inputs at V4's indexer widths (``v4_integer_inputs``)."""
import sys

import torch

from launchers import DEVICE

I32 = torch.int32
NINF = float("-inf")


def make_inputs(B=2, S=3, HI=4, DI=8, N=10, topk=4, dtype=torch.float32, device="cpu", visible=None):
    q = torch.randn(B, S, HI, DI, device=device).to(dtype)
    weights = torch.randn(B, S, HI, device=device).to(dtype)
    keys = torch.randn(B, N, DI, device=device).to(dtype)
    if visible is None:
        visible = torch.randint(0, N + 1, (B, S), dtype=I32, device=device)
    return [q, weights, keys, visible, topk]


OPCHECK_CASES = {
    "basic": dict(),
    "one_query": dict(B=1, S=1),
    "empty_pool": dict(N=0, visible=torch.zeros(2, 3, dtype=I32)),
    "k_above_pool": dict(N=3, topk=8),
    "nothing_visible_all_-1": dict(visible=torch.zeros(2, 3, dtype=I32)),
}



def kernel_inputs(B, S, HI, DI, N, dtype, integer=False, visible=None, weights=None):
    if integer:  # small integers: every score is exact in fp32 whatever the summation order
        draw = lambda *shape: torch.randint(-2, 3, shape, device=DEVICE).to(dtype)  # noqa: E731
    else:
        draw = lambda *shape: torch.randn(*shape, device=DEVICE).to(dtype)  # noqa: E731
    q, keys = draw(B, S, HI, DI), draw(B, N, DI)
    w = draw(B, S, HI) if weights is None else weights
    if visible is None:
        visible = torch.randint(0, N + 1, (B, S), device=DEVICE, dtype=torch.int32)
    return q, w, keys, visible


def reference_topk(scores, visible, topk):
    """The reference's top-k rule over given ``[B, S, N]`` scores (``ref.indexer_topk`` after
    its scores): entries past ``visible`` (clamped to [0, N]) are ``-inf``, a stable descending
    sort (ties to the lower index, -0.0 == +0.0), slots past ``min(topk, visible)`` are -1."""
    B, S, N = scores.shape
    vis = visible.long().clamp(0, N)
    masked = scores.masked_fill(torch.arange(N, device=scores.device) >= vis[..., None], NINF)
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :topk]
    out = torch.full((B, S, topk), -1, dtype=I32, device=scores.device)
    width = order.shape[-1]
    rank = torch.arange(width, device=scores.device)
    out[..., :width] = torch.where(rank < vis[..., None], order, -1).to(I32)
    return out


def check_candidates(scores, visible, topk, seg, cand_idx, cand_scores):
    """Stage 1: segment ``p``'s slots ``[p * topk, (p + 1) * topk)`` hold the segment's top
    ``min(topk, visible in it)`` entries (the reference rule on the segment) as entry indices in
    ascending order, with their scores, then -1 / ``-inf``."""
    B, S, N = scores.shape
    for b in range(B):
        for s in range(S):
            vis = min(max(int(visible[b, s]), 0), N)
            for p in range(-(-N // seg)):
                lo = p * seg
                seg_vis = min(max(vis - lo, 0), seg)
                n = min(seg_vis, topk)
                idx = cand_idx[b, s, p * topk: (p + 1) * topk]
                val = cand_scores[b, s, p * topk: (p + 1) * topk]
                seg_scores = scores[b: b + 1, s: s + 1, lo: lo + seg]
                want = reference_topk(seg_scores, torch.tensor([[seg_vis]], device=scores.device), topk)
                want = want[0, 0, :n].sort().values + lo
                where = f"row ({b}, {s}) segment {p}"
                assert torch.equal(idx[:n], want.to(idx.device)), f"{where}: {idx.tolist()} vs {want.tolist()}"
                assert torch.equal(val[:n], scores[b, s, idx[:n].long()]), where
                assert (idx[n:] == -1).all() and (val[n:] == NINF).all(), f"{where}: fillers {idx.tolist()}"


def op_body_launches(monkeypatch, **config):
    """Make the ``dsv4::indexer_topk`` body take its Triton branch (CPU tensors too, under the interpreter)
    with ``config`` over the default launch config; returns the list of kernel names it then launches
    through ``wrap_triton``."""
    from dsv4_ops import lowering

    mod = sys.modules["dsv4_ops.ops.indexer"]
    monkeypatch.setattr(lowering, "use_triton", lambda device_type: True)
    real_config = mod.ix.indexer_config
    monkeypatch.setattr(mod.ix, "indexer_config", lambda *a, **k: dict(real_config(*a, **k), **config))
    launched = []

    def spy(kernel, real=mod.wrap_triton):
        launched.append(kernel.fn.__name__)
        return real(kernel)

    monkeypatch.setattr(mod, "wrap_triton", spy)
    return launched


def v4_integer_inputs(B, N, device, S=1, HI=64, DI=128):
    """bf16 queries and keys, fp32 weights at V4-Flash's indexer widths, all small integers: exact scores,
    many ties."""
    q = torch.randint(-2, 3, (B, S, HI, DI), device=device).bfloat16()
    w = torch.randint(-2, 3, (B, S, HI), device=device).float()
    keys = torch.randint(-2, 3, (B, N, DI), device=device).bfloat16()
    return q, w, keys
