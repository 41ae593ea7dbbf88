"""Dense-mask oracle of one DeepSeek-V4 attention layer (architecture.md §11), tests only.

``dense_attention(attn, x)`` runs a whole prompt that starts at position 0 through an attention
layer's parameters with explicit masks: every query ``t`` sees the window ``t-W+1..t`` and the
compressed entries ``i < (t+1)//m`` (CSA: only the indexer's top-k of those). O(S^2), no ops,
no cache: an independent check of the incremental, op-built layer in ``dsv4_ops.model``.
``attn`` is any module with that layer's attributes (``dsv4_ops.model.Attention``); the
reference never imports the model.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .ops import apply_rope, rms_norm

__all__ = ["dense_attention", "dense_compress"]


def dense_compress(c, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """All complete blocks of a prompt starting at position 0 (§11 ``compress``) -> [B, n, dim]."""
    B, S, _ = x.shape
    m, d = c.ratio, c.dim
    n = S // m
    width = c.position_bias.shape[-1]
    a = c.kv_proj(x[:, : n * m]).float().view(B, n, m, width)
    z = c.gate_proj(x[:, : n * m]).float().view(B, n, m, width) + c.position_bias
    if c.overlap:  # entry i: first halves of block i-1 (slots 0..m-1), second halves of block i
        K = a.new_zeros(B, n, 2 * m, d)
        L = a.new_full((B, n, 2 * m, d), float("-inf"))
        K[:, :, m:], L[:, :, m:] = a[..., d:], z[..., d:]
        K[:, 1:, :m], L[:, 1:, :m] = a[:, :-1, :, :d], z[:, :-1, :, :d]
    else:
        K, L = a, z
    C = (K * L.softmax(dim=2)).sum(dim=2)
    C = rms_norm(C, c.kv_norm.weight, c.eps)
    bpos = torch.arange(n, device=x.device) * m
    return apply_rope(C, cos[bpos], sin[bpos])


def dense_attention(attn, x: Tensor) -> Tensor:
    """``[B, S, hidden]`` (a whole prompt from position 0) -> the layer's output ``[B, S, hidden]``."""
    B, S, _ = x.shape
    t = torch.arange(S, device=x.device)
    cos, sin = attn.cos[t].expand(B, S, -1), attn.sin[t].expand(B, S, -1)
    q, qr, kv = attn.q_kv(x, cos, sin)

    s = t[None, :]
    window = attn.cfg.sliding_window
    allowed = ((s <= t[:, None]) & (s > t[:, None] - window)).expand(B, S, S)
    keys = kv.float()
    c = attn.compressor
    if c is not None:
        C = dense_compress(c, x, attn.cos, attn.sin)  # [B, n, D]
        n = C.shape[1]
        vis = (torch.arange(n, device=x.device)[None, :] < ((t + 1) // c.ratio)[:, None]).expand(B, S, n)
        if c.indexer is not None and n > 0:
            idx = c.indexer
            KI = dense_compress(idx, x, attn.cos, attn.sin)  # [B, n, DI]
            qI, w = idx.queries(x, qr, cos, sin)
            I = (torch.einsum("bshd,bnd->bshn", qI.float(), KI).relu() * w[..., None]).sum(dim=2)
            I = I.masked_fill(~vis, float("-inf"))
            top = I.topk(min(idx.topk, n), dim=-1).indices
            vis = torch.zeros_like(vis).scatter_(-1, top, True) & vis
        keys = torch.cat([keys, C], dim=1)
        allowed = torch.cat([allowed, vis], dim=-1)

    logits = torch.einsum("bshd,bjd->bshj", q.float(), keys) * attn.scale
    logits = logits.masked_fill(~allowed[:, :, None, :], float("-inf"))
    sink = attn.sinks.float().view(1, 1, -1, 1).expand(B, S, -1, 1)
    probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
    o = torch.einsum("bshj,bjd->bshd", probs, keys).to(x.dtype)
    return attn.out(o, cos, sin)
