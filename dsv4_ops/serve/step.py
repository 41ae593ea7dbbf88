"""The engine's two compiled steps over the paged pool: both run the model's layers on the pool's
rings and pages (``pool.LayerPages.state``: the ops address the pages through the block table)
and sample in the graph.

* decode: ``ids [B, 1]`` for slots ``0..B-1`` (``rows=None``: ring views, no copies), ring mode;
* prefill: ``ids [B, C]`` for the slots in ``rows [B]`` (their rings copied in and back; padding
  rows point at the dummy slot), concat mode.

Padding rows bring ``n_new = 0``: the plan gives them no writes and no emits. Each step reads
``slot_len`` and ``block_table`` from the pool's static buffers and advances ``slot_len`` itself,
so its only inputs are the token ids, the rows, ``n_new`` and the sampling settings: requests
coming and going change values, never shapes (one graph per bucket). The speculative steps
(``spec.py``) run the same layer loop, ``paged_streams``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import sampling
from ..model.plan import plan_step
from ..sampling import SamplingParams
from .pool import PagedKVPool

__all__ = ["pool_step", "paged_streams"]


@torch.no_grad()
def pool_step(model, pool: PagedKVPool, ids: Tensor, rows: Tensor | None, n_new: Tensor, params: SamplingParams,
              filtered: bool) -> tuple[Tensor, Tensor]:
    """One step -> ``(tokens [B], logits [B, vocab])``: each row's next token (drawn at position
    ``slot_len + n_new``) and the logits of its last new token. Rows with ``n_new = 0`` are padding."""
    B, C = ids.shape
    lengths, table = slot_rows(pool, rows, B)
    meta = plan_step(model.config, lengths, n_new, C, pool.rings, concat=C > 1)
    x = paged_streams(model, pool, ids, rows, meta, table)
    last = (n_new.long() - 1).clamp(min=0)
    logits = model.logits(x[torch.arange(B, device=ids.device), last][:, None])[:, 0]
    if rows is None:
        pool.slot_len[:B].add_(n_new)
    else:
        pool.slot_len.index_add_(0, rows, n_new)
    tokens = sampling.sample(logits, params, (lengths + n_new).long(), filtered)
    return tokens, logits


def slot_rows(pool: PagedKVPool, rows: Tensor | None, B: int) -> tuple[Tensor, Tensor]:
    """``(lengths, block-table rows)`` of slots ``0..B-1`` (``rows=None``) or of ``rows``; the
    lengths are a copy, since the step advances ``slot_len``."""
    if rows is None:
        return pool.slot_len[:B].clone(), pool.block_table[:B]
    return pool.slot_len[rows], pool.block_table[rows]


def paged_streams(model, pool: PagedKVPool, ids: Tensor, rows: Tensor | None, meta, table: Tensor) -> Tensor:
    """The main layers over the paged pool (pages read and written in place through ``table``)
    -> the final residual streams ``[B, C, hc_mult, hidden]``."""
    x = model.model.embed_tokens(ids)
    x = x.unsqueeze(2).expand(-1, -1, model.config.hc_mult, -1).contiguous()
    for layer, pages in zip(model.model.layers, pool.layers):
        state = pages.state(rows, ids.shape[0], table)
        x = layer(x, meta, state, ids)
        pages.write_back(state, rows)
    return x
