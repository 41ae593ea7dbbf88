"""Static KV pool (DESIGN.md rule 3): every layer's window ring, compressor-input rings,
compressed pool and indexer-key pool, allocated once for ``max_batch_size x max_seq_len``
and addressed by absolute position. A request's only mutable scalar is its length, which
the caller owns; nothing here is ever resized, rolled back or re-allocated."""
from __future__ import annotations

import dataclasses

import torch

from .reference.layer import AttentionState, RingSizes, ring_sizes


class StaticCache:
    """Per-layer ``AttentionState`` for ``max_batch_size`` rows of up to ``max_seq_len`` tokens.

    ``lookahead``: extra ring slots so that steps of ``1 + lookahead`` tokens can run in ring
    mode and rejected speculative tokens never clobber a row that is still needed.
    ``mtp``: also allocate the MTP block's window ring (``mtp_states``).
    Every buffer is marked as a static address, so CUDA graphs treat the in-place writes
    as writes to fixed memory (no "mutated inputs" cudagraph skips).
    """

    def __init__(self, model, max_batch_size: int, max_seq_len: int, lookahead: int = 0,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 mtp: bool = False) -> None:
        cfg = model.config
        if max_batch_size < 1:
            raise ValueError(f"StaticCache: max_batch_size must be >= 1, got {max_batch_size}")
        if max_seq_len < 1:
            raise ValueError(f"StaticCache: max_seq_len must be >= 1, got {max_seq_len}")
        ref = model.model.embed_tokens.weight
        dtype = dtype or ref.dtype
        device = device or ref.device
        self.max_batch_size, self.max_seq_len, self.lookahead = max_batch_size, max_seq_len, lookahead
        self.rings: RingSizes = ring_sizes(cfg, lookahead)
        self.states: list[AttentionState] = [
            layer.self_attn.init_state(max_batch_size, max_seq_len, self.rings, dtype, device)
            for layer in model.model.layers
        ]
        # the MTP block's window (sliding attention only); its steps carry one token more than
        # the main model's (the position before the verified ones, see speculative.py)
        self.mtp_rings: RingSizes = ring_sizes(cfg, lookahead + 1)
        self.mtp_states: list[AttentionState] = [
            blk.self_attn.init_state(max_batch_size, max_seq_len, self.mtp_rings, dtype, device)
            for blk in getattr(model, "mtp", [])
        ] if mtp else []
        for st in self.states + self.mtp_states:
            for t in self.tensors(st):
                torch._dynamo.mark_static_address(t)

    @staticmethod
    def tensors(state: AttentionState) -> list[torch.Tensor]:
        return [t for t in (getattr(state, f.name) for f in dataclasses.fields(state)) if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for st in self.states + self.mtp_states for t in self.tensors(st))
