"""``dsv4::indexer_topk``: lightning-indexer scores and fixed-width top-k with -1 sentinels."""
import torch
from torch import Tensor

from ..reference import ops as ref
from ..lowering import BACKEND
from . import _validate as v


@torch.library.custom_op("dsv4::indexer_topk", mutates_args=())
def _indexer_topk(q: Tensor, weights: Tensor, keys: Tensor, visible: Tensor, topk: int) -> Tensor:
    # Default implementation for every device: the reference (plain aten).
    return ref.indexer_topk(q, weights, keys, visible, topk).contiguous()


@_indexer_topk.register_fake
def _indexer_topk_fake(q, weights, keys, visible, topk):
    torch._check(q.dim() == 4 and weights.dim() == 3 and keys.dim() == 3 and visible.dim() == 2,
                 lambda: "indexer_topk: q [B, S, HI, DI], weights [B, S, HI], keys [B, N, DI], visible [B, S]")
    torch._check(keys.shape[-1] == q.shape[-1], lambda: "indexer_topk: DI of keys and q differ")
    torch._check(visible.shape[0] == q.shape[0], lambda: "indexer_topk: B of visible and q differ")
    torch._check(visible.shape[1] == q.shape[1], lambda: "indexer_topk: S of visible and q differ")
    torch._check(topk >= 1, lambda: "indexer_topk: topk must be >= 1")
    return q.new_empty((q.shape[0], q.shape[1], topk), dtype=torch.int32)


def indexer_topk(q: Tensor, weights: Tensor, keys: Tensor, visible: Tensor, topk: int) -> Tensor:
    """Top-``topk`` visible compressed entries per query, by lightning-indexer score.

    ``score[b, s, i] = sum_h weights[b, s, h] * relu(q[b, s, h] . keys[b, i])`` (fp32), over
    entries ``i < visible[b, s]``.

    Args:
        q: ``[B, S, HI, DI]`` float indexer queries (roped).
        weights: ``[B, S, HI]`` float per-head weights, every scale folded in.
        keys: ``[B, N, DI]`` indexer-key pool, same dtype as ``q``; ``N`` may be 0.
        visible: ``[B, S] int32`` in ``0 .. N``: entries ``i < visible`` may be picked
            (causality ``(t+1)//m``, 0 for padding queries).
        topk: output width ``k >= 1``.

    Returns ``[B, S, topk] int32``: the ``min(topk, visible)`` best entries in descending score
    order, **ties to the lower index**; remaining slots are ``-1``.
    """
    op = "indexer_topk"
    v.rank(op, "q", q, "[B, S, HI, DI]")
    v.rank(op, "weights", weights, "[B, S, HI]")
    v.rank(op, "keys", keys, "[B, N, DI]")
    v.rank(op, "visible", visible, "[B, S]")
    v.floating(op, "q", q)
    v.floating(op, "weights", weights)
    v.same_dtype(op, "keys", keys, "q", q)
    v.dtype(op, "visible", visible, torch.int32)
    B, S, HI, DI = q.shape
    v.dim(op, "weights", weights, 0, B, "B of q")
    v.dim(op, "weights", weights, 1, S, "S of q")
    v.dim(op, "weights", weights, 2, HI, "HI of q")
    v.dim(op, "keys", keys, 0, B, "B of q")
    v.dim(op, "keys", keys, 2, DI, "DI of q")
    v.dim(op, "visible", visible, 0, B, "B of q")
    v.dim(op, "visible", visible, 1, S, "S of q")
    v.at_least(op, "topk", topk, 1)
    v.same_device(op, q=q, weights=weights, keys=keys, visible=visible)
    if v.reads_values(visible):
        N = keys.shape[1]
        v.in_range(op, "visible", visible, 0, N, f"keys entries N={N}")
    return torch.ops.dsv4.indexer_topk(q, weights, keys, visible, topk)


# CUDA (and ROCm) kernel, chosen once at import: the Triton scores + radix top-k launcher
# (same tie rule as the reference), unless DSV4_OPS_BACKEND=reference.
if BACKEND == "triton":

    @_indexer_topk.register_kernel("cuda")
    def _indexer_topk_cuda(q, weights, keys, visible, topk):
        from ..lowering.triton.indexer import indexer_topk as launch

        return launch(q, weights, keys, visible, topk)
