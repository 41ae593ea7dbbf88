"""An independent, cache-free oracle of DeepSeek-V4's MTP (NextN) block, tests' ground truth.

Written from dsv4_architecture.md alone (§10 and what it uses: §2 RMSNorm / interleaved RoPE,
§3 MQA with K = V and a per-head sink, §6 the sliding window, §8 mHC, §9 MoE) as plain tensor
math over a whole sequence: every position ``t`` pairs a stream state ``X[t]`` with the token
``tok[t+1]``, attends the block's own kv at positions ``t-W+1 .. t`` and predicts ``tok[t+2]``.
No ``torch.ops.dsv4`` op, no cache, no plan, no ``dsv4_ops.model`` code: the only inputs are
weight tensors by name (:func:`mtp_weights` reads them off a model) and the config's numbers.
It does not reuse ``reference/ops.py`` either (its RoPE, norms and Sinkhorn are re-derived
here), so a shared mistake would have to be made twice.

Precision: activations stay in the dtype of the input streams (float64 for the oracle); each
matrix product runs in its weight's dtype (``linear``), so float64 weights give a float64
oracle, and the distiller (``dsv4_ops.distill``) can run the same math with frozen bf16 expert
weights that are never copied to fp32. Everything is differentiable (the dsv4 ops have no
backward; this is how the MTP block is trained).

Sizes: ``B`` rows, ``S`` positions, ``N = hc_mult`` streams, ``D = hidden``, ``H`` heads of
``Dh = head_dim``, ``r = rope_head_dim``, ``E`` routed experts, ``K`` experts per token.
"""
from __future__ import annotations

from typing import Mapping, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["MTPOutput", "mtp_weights", "mtp_forward", "window_mask", "MTP_PREFIX"]

MTP_PREFIX = "mtp.0."


class MTPOutput(NamedTuple):
    streams: Tensor  # [B, S, N, D] the block's output streams (the next draft step's stream input)
    logits: Tensor  # [B, S, vocab] predictions of tok[t+2]
    kv: Tensor  # [B, S, Dh] the window entry each position writes (post-norm, post-RoPE)


def mtp_weights(model, dtype: torch.dtype | None = torch.float64) -> dict[str, Tensor]:
    """The MTP block's parameters and buffers by their names without ``mtp.0.``, plus the shared
    ``embed`` and ``head``, detached copies in ``dtype`` (None: as stored)."""
    out = {"embed": model.model.embed_tokens.weight, "head": model.lm_head.weight}
    named = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n.endswith("_bias"))]
    out.update((name[len(MTP_PREFIX):], t) for name, t in named if name.startswith(MTP_PREFIX))
    return {k: (t.detach().to(dtype) if dtype is not None else t.detach()) for k, t in out.items()}


# ----------------------------------------------------------------------------- primitives (§2)
def linear(x: Tensor, w: Tensor) -> Tensor:
    """``x @ w^T`` in the weight's dtype, result back in the activation dtype."""
    return F.linear(x.to(w.dtype), w).to(x.dtype)


def rms(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.to(x.dtype)


def rope(x: Tensor, pos: Tensor, theta: float, r: int, inverse: bool = False) -> Tensor:
    """Rotate the last ``r`` channels of ``x [..., S, (heads,) C]`` in consecutive pairs
    ``(2i, 2i+1)`` by ``pos * theta^(-2i/r)`` (conjugate if ``inverse``); ``pos [S]``."""
    freq = theta ** (-torch.arange(0, r, 2, dtype=x.dtype, device=x.device) / r)
    ang = pos.to(x.dtype)[:, None] * freq  # [S, r/2]
    if x.dim() == ang.dim() + 2:  # a heads dim between S and channels
        ang = ang[:, None]
    c, s = ang.cos(), ang.sin() * (-1 if inverse else 1)
    a, b = x[..., -r:][..., 0::2], x[..., -r:][..., 1::2]
    rot = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    return torch.cat([x[..., :-r], rot], dim=-1)


def window_mask(S: int, window: int, device=None) -> Tensor:
    """``[S, S]`` bool: query ``t`` sees key ``s`` iff ``t - window < s <= t`` (§6, itself included)."""
    t = torch.arange(S, device=device)
    d = t[:, None] - t[None, :]
    return (d >= 0) & (d < window)


# ----------------------------------------------------------------------------- mHC (§8)
def sinkhorn(m: Tensor, iters: int, eps: float) -> Tensor:
    """Column normalisation, then (iters - 1) x (rows, columns); every sum offset by eps."""
    m = m / (m.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(-1, keepdim=True) + eps)
        m = m / (m.sum(-2, keepdim=True) + eps)
    return m


def hc_site(X: Tensor, w: Mapping[str, Tensor], site: str, cfg) -> tuple[Tensor, Tensor, Tensor]:
    """One mHC site on streams ``X [B, S, N, D]`` -> (pre [B,S,N], post [B,S,N], comb [B,S,N,N])."""
    N = cfg.hc_mult
    fn, base, scale = (w[f"{site}.{p}"].to(X.dtype) for p in ("fn", "base", "scale"))
    mix = rms(X.flatten(-2), None, cfg.rms_norm_eps) @ fn.T  # [B, S, (2+N)N]
    pre = torch.sigmoid(mix[..., :N] * scale[0] + base[:N]) + cfg.hc_eps
    post = 2 * torch.sigmoid(mix[..., N:2 * N] * scale[1] + base[N:2 * N])
    logits = mix[..., 2 * N:].unflatten(-1, (N, N)) * scale[2] + base[2 * N:].view(N, N)
    comb = sinkhorn(torch.softmax(logits, dim=-1) + cfg.hc_eps, cfg.hc_sinkhorn_iters, cfg.hc_eps)
    return pre, post, comb


def hc_around(X: Tensor, w, site: str, cfg, block) -> Tensor:
    """``X'_k = post_k * block(sum_i pre_i X_i) + sum_j comb[j, k] X_j``."""
    pre, post, comb = hc_site(X, w, site, cfg)
    y = block((pre[..., None] * X).sum(-2))
    return post[..., None] * y[..., None, :] + torch.einsum("bsjk,bsjd->bskd", comb, X)


def hc_head(X: Tensor, w, cfg) -> Tensor:
    fn, base, scale = (w[f"hc_head.hc_{p}"].to(X.dtype) for p in ("fn", "base", "scale"))
    pre = torch.sigmoid(rms(X.flatten(-2), None, cfg.rms_norm_eps) @ fn.T * scale + base) + cfg.hc_eps
    return (pre[..., None] * X).sum(-2)


# ----------------------------------------------------------------------------- attention (§3, §6)
def attention(x: Tensor, w, cfg, past_kv: Tensor | None = None, start: int = 0) -> tuple[Tensor, Tensor]:
    """Sliding-window MQA (K = V) with sink over ``x [B, S, D]`` at positions ``start..start+S-1``
    -> (output [B, S, D], kv [B, S, Dh]).

    ``past_kv`` None: query ``t`` sees this sequence's kv at ``t-W+1 .. t``. ``past_kv [B, S, Dh]``
    (the entries of another sequence at the same positions): query ``t`` sees ``past_kv`` at
    ``t-W+1 .. t-1`` and its own kv at ``t`` — a recursive draft step over a cache of main entries."""
    B, S, _ = x.shape
    H, Dh, r, eps = cfg.num_attention_heads, cfg.head_dim, cfg.rope_head_dim, cfg.rms_norm_eps
    theta = cfg.rope_theta  # the MTP block is sliding-only: plain RoPE, no YaRN (§2, pitfall 1)
    pos = start + torch.arange(S, device=x.device)
    a = "self_attn."
    qr = rms(linear(x, w[a + "q_a_proj.weight"]), w[a + "q_a_norm.weight"], eps)
    q = rope(rms(linear(qr, w[a + "q_b_proj.weight"]).view(B, S, H, Dh), None, eps), pos, theta, r)
    kv = rope(rms(linear(x, w[a + "kv_proj.weight"]), w[a + "kv_norm.weight"], eps), pos, theta, r)
    allowed = window_mask(S, cfg.sliding_window, x.device)
    keys = kv
    if past_kv is not None:
        own = torch.eye(S, dtype=torch.bool, device=x.device)
        keys = torch.cat([past_kv.to(kv.dtype), kv], dim=1)
        allowed = torch.cat([allowed & ~own, own], dim=1)
    logits = torch.einsum("bthd,bsd->bhts", q, keys) * Dh ** -0.5
    logits = logits.masked_fill(~allowed, float("-inf"))
    sink = w[a + "sinks"].to(x.dtype).view(1, H, 1, 1).expand(B, H, S, 1)
    probs = torch.cat([logits, sink], dim=-1).softmax(-1)[..., :-1]  # the sink: a logit with zero value
    o = rope(torch.einsum("bhts,bsd->bthd", probs, keys), pos, theta, r, inverse=True)
    g = cfg.o_groups
    wa = w[a + "o_a_proj.weight"].view(g, cfg.o_lora_rank, -1)
    z = torch.einsum("btgi,gri->btgr", o.reshape(B, S, g, -1).to(wa.dtype), wa).to(x.dtype)
    return linear(z.flatten(2), w[a + "o_b_proj.weight"]), kv


# ----------------------------------------------------------------------------- MoE (§9)
def swiglu_expert(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, limit: float) -> Tensor:
    gate, up = linear(x, w_gate), linear(x, w_up)
    return linear(F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit), w_down)


def moe(x: Tensor, w, cfg) -> Tensor:
    """Biased top-K routing (the MTP block is never hash-routed) + the shared expert, ``[B, S, D]``.
    Loops over experts and gathers each one's tokens: memory O(T * K), not O(T * E * width)."""
    m, K, lim = "mlp.", cfg.num_experts_per_tok, cfg.swiglu_limit
    flat = x.reshape(-1, x.shape[-1])
    logits = flat @ w[m + "gate.weight"].to(x.dtype).T  # router in the activation dtype (fp32 or wider)
    scores = F.softplus(logits).sqrt() if cfg.scoring_func == "sqrtsoftplus" else torch.sigmoid(logits)
    picked = torch.topk(scores + w[m + "gate.e_score_correction_bias"].to(x.dtype), K, dim=-1).indices
    weights = scores.gather(-1, picked)
    weights = weights / weights.sum(-1, keepdim=True) * cfg.routed_scaling_factor
    w13, w2 = w[m + "experts.gate_up_proj"], w[m + "experts.down_proj"]  # [E, 2I, D] (gate rows first), [E, D, I]
    inter = w2.shape[-1]
    out = torch.zeros_like(flat)
    for e in picked.unique().tolist():
        tok, slot = (picked == e).nonzero(as_tuple=True)
        y = swiglu_expert(flat[tok], w13[e, :inter], w13[e, inter:], w2[e], lim)
        out = out.index_add(0, tok, y * weights[tok, slot, None])
    s = m + "shared_experts."
    out = out + swiglu_expert(flat, w[s + "gate_proj.weight"], w[s + "up_proj.weight"], w[s + "down_proj.weight"],
                              lim)
    return out.view_as(x)


# ----------------------------------------------------------------------------- the block (§10)
def mtp_forward(w: Mapping[str, Tensor], cfg, streams: Tensor, next_ids: Tensor,
                past_kv: Tensor | None = None, start: int = 0) -> MTPOutput:
    """The MTP block over positions ``start..start+S-1``: ``streams [B, S, N, D]`` (the main model's
    final streams, before its hc_head, or the block's own output streams of the previous position),
    ``next_ids [B, S]`` the token after each position -> :class:`MTPOutput` in the streams' dtype.

    ``past_kv``: see :func:`attention` (each position one recursive step over a cache of other
    entries); None = this sequence is the whole cache. ``start > 0``: the sequence is the tail of a
    longer one; only queries at ``>= start + W - 1`` then see their whole window."""
    eps = cfg.rms_norm_eps
    X0 = streams
    e = linear(rms(w["embed"][next_ids].to(X0.dtype), w["enorm.weight"], eps), w["e_proj.weight"])
    X = linear(rms(X0, w["hnorm.weight"], eps), w["h_proj.weight"]) + e[:, :, None]
    kv_out = []

    def attn_block(u):
        y, kv = attention(rms(u, w["input_layernorm.weight"], eps), w, cfg, past_kv, start)
        kv_out.append(kv)
        return y

    X = hc_around(X, w, "attn_hc", cfg, attn_block)
    X = hc_around(X, w, "ffn_hc", cfg, lambda u: moe(rms(u, w["post_attention_layernorm.weight"], eps), w, cfg))
    hidden = rms(hc_head(X, w, cfg), w["norm.weight"], eps)
    return MTPOutput(X, linear(hidden, w["head"]), kv_out[0])
