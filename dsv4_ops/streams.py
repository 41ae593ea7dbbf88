"""The main model's final residual streams at every position of whole sequences, cache-free.

What the MTP block reads (``X_main``, dsv4_architecture.md §10) and what its oracle and its
distillation need for every position at once. It is exactly the cache-free ``model(input_ids)``
(parity-tested against HF transformers) stopped before ``hc_head``: the same scratch state and
the same one ``plan`` call, so no new attention path is trusted here.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .model.plan import ring_sizes

__all__ = ["main_streams"]


@torch.no_grad()
def main_streams(model, input_ids: Tensor) -> Tensor:
    """``input_ids [B, S]`` (whole sequences from position 0) -> ``[B, S, hc_mult, hidden]``
    streams in the model's dtype; ``model.logits(streams)`` equals ``model(input_ids)``."""
    B, S = input_ids.shape
    dev = input_ids.device
    lengths = torch.zeros(B, dtype=torch.int32, device=dev)
    n_new = torch.full_like(lengths, S)
    states = [layer.self_attn.new_state(B, S, None, model.dtype, dev) for layer in model.model.layers]
    meta = model.plan(lengths, n_new, S, rings=ring_sizes(model.config))
    return model.hidden_streams(input_ids, lengths, n_new, meta, states)
