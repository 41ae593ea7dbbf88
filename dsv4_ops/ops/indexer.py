"""``dsv4::indexer_topk``: lightning-indexer scores and fixed-width top-k with -1 sentinels."""
from typing import Optional

import torch
from torch import Tensor
from torch.library import wrap_triton

from ..lowering.triton import indexer as ix
from ..lowering.triton.indexer import indexer_scores_kernel, topk_kernel, topk_row_kernel
from ..reference import fp8_cache as fp8
from ..reference import ops as ref
from . import validate as v
from . import topk_cuda
from ._backend import check, use_triton
from .direct import dsv4


@torch.library.triton_op("dsv4::indexer_topk", mutates_args=())
def _indexer_topk(q: Tensor, weights: Tensor, keys: Tensor, visible: Tensor, topk: int,
                  block_table: Optional[Tensor] = None) -> Tensor:
    # Also the fake: shape checks, then a static device branch (see _backend.py). CUDA/ROCm:
    # Triton scores + radix top-k (same tie rule as the reference); on NVIDIA GPUs where the
    # native library is loaded, the top-k is the CUDA kernel's (topk_cuda.py).
    # keys may be an FP8 key cache (rank-4 uint8 [B, pages, page, DI + 4], or rank-3 pages with a
    # block table; static): dequantised where read
    paged = block_table is not None
    keys8 = fp8.is_fp8_cache(keys, paged)
    check(q.dim() == 4 and weights.dim() == 3 and (keys.dim() == 3 or keys8) and visible.dim() == 2,
          lambda: "indexer_topk: q [B, S, HI, DI], weights [B, S, HI], keys [B, N, DI], visible [B, S]")
    check(keys.shape[-1] == q.shape[-1] + (4 if keys8 else 0), lambda: "indexer_topk: DI of keys and q differ")
    check(not paged or (block_table.dim() == 2 and block_table.shape[0] == q.shape[0]),
          lambda: "indexer_topk: block_table must be [B, P], B of q")
    check(paged or keys.shape[0] == q.shape[0], lambda: "indexer_topk: B of keys and q differ")
    check(weights.shape == q.shape[:3], lambda: "indexer_topk: weights must be [B, S, HI] of q")
    check(visible.shape == q.shape[:2], lambda: "indexer_topk: [B, S] of visible and q differ")
    if use_triton(q):
        B, S = visible.shape
        N = ix.entries(keys, block_table)
        # the CUDA top-k (topk_cuda.py) after the Triton scores, when every token is one group
        cuda_topk = ix.token_group(B, S, N) == S and topk_cuda.applies((B, S, N), q.device, topk)
        if cuda_topk:
            scores, scoring = ix.scores_launch(q, weights, keys, visible, block_table=block_table)
            groups = ((scoring, (), None),)
        else:
            launches = ix.indexer_launches(q, weights, keys, visible, topk, block_table=block_table)
            groups = launches.groups
        for scores_spec, rows, loop in groups:  # one group per step, unless the scores would not fit
            wrap_triton(indexer_scores_kernel)[scores_spec.grid](*scores_spec.args, **scores_spec.meta)
            for row in rows:  # one launch, or the split top-k's two stages
                wrap_triton(topk_row_kernel)[row.grid](*row.args, **row.meta)
            if loop is not None:
                wrap_triton(topk_kernel)[loop.grid](*loop.args, **loop.meta)
        return torch.ops.dsv4.topk_rows_cuda(scores, visible, topk) if cuda_topk else launches.out
    return ref.indexer_topk(q, weights, keys, visible, topk, block_table).contiguous()


def indexer_topk(q: Tensor, weights: Tensor, keys: Tensor, visible: Tensor, topk: int,
                 block_table: Tensor | None = None) -> Tensor:
    """Top-``topk`` visible compressed entries per query, by lightning-indexer score.

    ``score[b, s, i] = sum_h weights[b, s, h] * relu(q[b, s, h] . keys[b, i])`` (fp32), over
    entries ``i < visible[b, s]``.

    Args:
        q: ``[B, S, HI, DI]`` float indexer queries (roped).
        weights: ``[B, S, HI]`` float per-head weights, every scale folded in.
        keys: ``[B, N, DI]`` indexer-key pool, same dtype as ``q``; ``N`` may be 0. Or FP8 keys
            ``uint8 [B, pages, page, DI + 4]`` (``N = pages * page``; ``dsv4_ops/reference/fp8_cache.py``):
            those hold Hadamard-ROTATED keys, so pass rotated queries (``fp8_cache.rotate``). Over
            FP8 keys the queries are quantised too, each head to e4m3 codes with one power-of-two
            scale (``fp8_cache.simulate_queries``), as the serving engines score them: on CUDA an
            FP8 x FP8 tensor-core dot for bf16 queries.
        visible: ``[B, S] int32`` in ``0 .. N``: entries ``i < visible`` may be picked
            (causality ``(t+1)//m``, 0 for padding queries).
        topk: output width ``k >= 1``.
        block_table: ``[B, P] int32`` page ids in ``0 .. num_pages-1``; ``keys`` are then paged,
            ``[num_pages, page, DI]`` (or FP8 pages ``uint8 [num_pages, page, DI + 4]``, whose page
            stride may be padded), entry ``i < N = P * page`` of row ``b`` at slot ``i % page`` of
            page ``block_table[b, i // page]`` (``reference.ops.paged_rows``). The picks are
            entry indices ``i`` (logical), as without pages.

    Returns ``[B, S, topk] int32``: the ``min(topk, visible)`` best entries in descending score
    order, **ties to the lower index**; remaining slots are ``-1``.

    The raw op ``torch.ops.dsv4.indexer_topk`` checks shapes only; on every backend it clamps
    ``visible`` to ``[0, N]`` (and ``topk = 0`` gives ``[B, S, 0]``). This wrapper rejects
    such values instead.
    """
    v.once_per_signature(_check_arguments, q, weights, keys, visible, topk, block_table)
    if v.checks_op_values(visible, *v.present(block_table)):
        op, N = "indexer_topk", v.entries(keys, block_table)
        v.run_value_checks(*v.block_table_checks(op, block_table, keys),
                           v.in_range_check(op, "visible", visible, 0, N, f"keys entries N={N}"))
    return dsv4.indexer_topk(q, weights, keys, visible, topk, block_table)


def _check_arguments(q: Tensor, weights: Tensor, keys: Tensor, visible: Tensor, topk: int,
                     block_table: Tensor | None) -> None:
    """The metadata checks of :func:`indexer_topk` (ranks, dtypes, matching dims, devices, ``topk``)."""
    op = "indexer_topk"
    paged = block_table is not None
    v.rank(op, "q", q, "[B, S, HI, DI]")
    v.rank(op, "weights", weights, "[B, S, HI]")
    if keys.dtype == torch.uint8:
        v.fp8_key_cache(op, "keys", keys, q.shape[-1] if q.dim() == 4 else -1, paged)
    else:
        v.rank(op, "keys", keys, "[num_pages, page, DI]" if paged else "[B, N, DI]")
    v.rank(op, "visible", visible, "[B, S]")
    v.floating(op, "q", q)
    v.floating(op, "weights", weights)
    if keys.dtype != torch.uint8:
        v.same_dtype(op, "keys", keys, "q", q)
    v.dtype(op, "visible", visible, torch.int32)
    B, S, HI, DI = q.shape
    v.dim(op, "weights", weights, 0, B, "B of q")
    v.dim(op, "weights", weights, 1, S, "S of q")
    v.dim(op, "weights", weights, 2, HI, "HI of q")
    if paged:
        v.block_table(op, block_table, keys)
        v.dim(op, "block_table", block_table, 0, B, "B of q")
    else:
        v.dim(op, "keys", keys, 0, B, "B of q")
    if keys.dtype != torch.uint8:
        v.dim(op, "keys", keys, 2, DI, "DI of q")
    v.dim(op, "visible", visible, 0, B, "B of q")
    v.dim(op, "visible", visible, 1, S, "S of q")
    v.at_least(op, "topk", topk, 1)
    v.same_device(op, q=q, weights=weights, keys=keys, visible=visible, block_table=block_table)
