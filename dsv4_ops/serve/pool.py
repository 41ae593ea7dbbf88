"""The serving engine's KV pool: per-slot rings, paged compressed history, one block table.

What a request's later tokens read splits in two (serving_design.md §7.1):

* **O(1) per request** — the window ring and the compressor-input rings (main and indexer) —
  stay per slot: ``[slots, ...]`` rows exactly as ``model.setup_caches`` lays them out, so a
  decode step over slots ``0..B-1`` hands the ops plain row views (no copy in the hot path).
* **O(history)** — the compressed CSA / HCA entries and the indexer keys — live in fixed-size
  pages, one allocation per cache kind and layer, ``[num_pages, entries_per_page, ...]``; page
  ``i`` holds the same ``page_size`` positions in every layer, so one block table
  ``int32 [slots, pages_per_request]`` addresses them all. Page 0 is a dummy: padding rows and
  unused block-table entries point there, and nothing real is ever read from it.

A step hands each layer its pages and the step rows' block-table rows (``AttentionState.
block_table``): ``compress``, ``cache_write``, ``indexer_topk`` and ``sparse_attention`` read and
write the entries where they live, through the block table, so no step copies the compressed
history. A page shared by a prefix is full (every block in it closed), so no step emits into it:
sharing needs no copy-on-write.

FP8 (``kv_cache_dtype="fp8"``): the same split; a page of a compressed kind is one FlashMLA
FP8 page of exactly ``entries_per_page`` entries (``fp8_cache.KVLayout`` / ``IndexerLayout``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import CSA, HCA, SLIDING
from ..model.attention import AttentionState
from ..model.plan import RingSizes, ring_sizes
from ..reference import fp8_cache as fp8

__all__ = ["LayerPages", "PagedKVPool", "RING_FIELDS", "layer_pages"]

RING_FIELDS = ("window", "kv_ring", "gate_ring", "idx_kv_ring", "idx_gate_ring")


@dataclass
class LayerPages:
    """One attention layer's storage: per-slot rings and (compressed layers) paged pools."""

    rings: dict[str, Tensor]  # RING_FIELDS present in this layer -> [slots, ...]
    pool: Tensor | None  # [num_pages, epp, D] float or [num_pages, epp, bytes] uint8; epp = page_size / ratio
    idx_pool: Tensor | None

    def state(self, rows: Tensor | None, B: int, block_table: Tensor) -> AttentionState:
        """This step's state: ring views of slots ``0..B-1`` (``rows=None``) or copies of the
        ``rows`` slots, and the pages themselves with the step rows' ``block_table [B, P]``."""
        rings = {k: (t[:B] if rows is None else t[rows]) for k, t in self.rings.items()}
        return AttentionState(**rings, pool=self.pool, idx_pool=self.idx_pool,
                              block_table=block_table if self.pool is not None else None)

    def write_back(self, state: AttentionState, rows: Tensor | None) -> None:
        """Store what the step wrote to copied rings (``rows`` given); the pages were written in place."""
        if rows is not None:
            for k, t in self.rings.items():
                t.index_copy_(0, rows, getattr(state, k))


class PagedKVPool:
    """Rings for ``slots`` request slots and ``num_pages`` pages of ``page_size`` positions for
    every main attention layer of ``model`` (the MTP block's window ring is ``spec.SpecSlots``'s).
    ``lookahead``: ring slots for steps of up to ``1 + lookahead`` tokens whose last ones may be
    rejected (speculative verify), as ``model.setup_caches``.

    ``slot_len [slots] int32`` (positions cached per slot) and ``block_table [slots, P] int32``
    are device buffers with static addresses; the engine fills them, the compiled steps read
    them and advance ``slot_len``.
    """

    def __init__(self, model, slots: int, max_seq_len: int, num_pages: int, page_size: int,
                 kv_cache_dtype: str = "auto", dtype: torch.dtype | None = None, lookahead: int = 0) -> None:
        cfg = model.config
        self.config, self.slots, self.page_size, self.num_pages = cfg, slots, page_size, num_pages
        self.pages_per_request = -(-max_seq_len // page_size)
        self.max_seq_len = max_seq_len
        self.fp8 = kv_cache_dtype == "fp8"
        self.rings: RingSizes = ring_sizes(cfg, lookahead)
        device = model.device
        dtype = torch.bfloat16 if kv_cache_dtype == "bf16" else dtype or model.dtype
        self.dtype = dtype
        self.layers = [layer_pages(layer.self_attn, slots, num_pages, page_size, self.fp8, dtype, device, self.rings)
                       for layer in model.model.layers]
        self.slot_len = torch.zeros(slots, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(slots, self.pages_per_request, dtype=torch.int32, device=device)
        for t in self.buffers():
            torch._dynamo.mark_static_address(t)

    def buffers(self) -> list[Tensor]:
        out = [self.slot_len, self.block_table]
        for lp in self.layers:
            out += list(lp.rings.values()) + [t for t in (lp.pool, lp.idx_pool) if t is not None]
        return out

    def ring_tensors(self) -> list[Tensor]:
        """Every per-slot ring of every layer (what a prefix snapshot saves), in a fixed order."""
        return [t for lp in self.layers for t in lp.rings.values()]

    def nbytes(self) -> dict[str, int]:
        ring = sum(t.numel() * t.element_size() for t in self.ring_tensors())
        paged = sum(t.numel() * t.element_size() for lp in self.layers for t in (lp.pool, lp.idx_pool)
                    if t is not None)
        return {"rings": ring, "pages": paged, "page": paged // self.num_pages}

    @staticmethod
    def page_bytes(model, page_size: int, kv_cache_dtype: str = "auto") -> int:
        """Bytes one page takes over every layer (to size ``num_pages`` from a memory budget)."""
        dtype = torch.bfloat16 if kv_cache_dtype == "bf16" else model.dtype
        layers = [layer_pages(layer.self_attn, 1, 1, page_size, kv_cache_dtype == "fp8", dtype, "meta")
                  for layer in model.model.layers]
        return sum(t.numel() * t.element_size() for lp in layers for t in (lp.pool, lp.idx_pool) if t is not None)


def layer_pages(attn, slots: int, num_pages: int, page_size: int, fp8_cache: bool, dtype: torch.dtype,
                device, rings: RingSizes | None = None) -> LayerPages:
    """One attention layer's rings (``rings``, default the smallest) for ``slots`` slots and, for
    compressed layers, ``num_pages`` pages."""
    cfg = attn.cfg
    st = attn.new_state(slots, 1, rings or ring_sizes(cfg), dtype, device, fp8_cache)
    rings = {k: getattr(st, k) for k in RING_FIELDS if getattr(st, k) is not None}
    if attn.layer_type == SLIDING:
        return LayerPages(rings, None, None)
    assert attn.layer_type in (CSA, HCA)
    epp = page_size // attn.ratio
    D, DI = attn.head_dim, cfg.index_head_dim
    pool = _pages(num_pages, epp, D, fp8.KVLayout(D, cfg.rope_head_dim, epp) if fp8_cache else None, dtype, device)
    idx_pool = None
    if attn.layer_type == CSA:
        idx_pool = _pages(num_pages, epp, DI, fp8.IndexerLayout(DI, epp) if fp8_cache else None, dtype, device)
    return LayerPages(rings, pool, idx_pool)


def _pages(num_pages: int, epp: int, width: int, layout, dtype, device) -> Tensor:
    if layout is None:
        return torch.zeros(num_pages, epp, width, dtype=dtype, device=device)
    _, _, page, entry_bytes = layout.shape(num_pages, epp)
    return torch.zeros(num_pages, page, entry_bytes, dtype=torch.uint8, device=device)
