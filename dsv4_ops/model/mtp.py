"""The MTP (NextN) block of DeepSeek-V4 (dsv4_architecture.md §10), the speculative drafter.

    e = e_proj(enorm(embed(tok[t+1])))                 # [B, S, dim]
    h = h_proj(hnorm(X[t]))                            # X: a [B, S, hc_mult, dim] stream state
    X' = Block(h + e[:, :, None])                      # one sliding-window-only decoder block
    logits = lm_head(norm(hc_head(X')))                # predicts tok[t+2]

``X`` is the main model's final stream state at position ``t`` (before its ``hc_head``) for the
first draft, and the MTP block's own output for the next ones (recursive drafting). The
block's attention is sliding-window only (θ = 10000, no compressor), its MoE uses biased
top-k routing (never hashed); ``embed_tokens`` and ``lm_head`` are the main model's.

Parameter names (``mtp.0.*``): the block is a ``DecoderLayer`` with the same HF-style names as
a main layer (``self_attn.*``, ``mlp.*``, ``input_layernorm``, ``post_attention_layernorm``,
``attn_hc.*``, ``ffn_hc.*``) plus ``enorm``, ``hnorm``, ``e_proj``, ``h_proj``,
``hc_head.{hc_fn,hc_base,hc_scale}`` and ``norm``. ``dsv4_ops.load_pretrained (checkpoint.py)`` maps
DeepSeek's checkpoint names onto these with the main layers' rename table (``mtp.0.attn.wq_a``
-> ``mtp.0.self_attn.q_a_proj``, ``mtp.0.ffn_norm`` -> ``mtp.0.post_attention_layernorm``,
``mtp.0.hc_head_fn`` -> ``mtp.0.hc_head.hc_fn``; ``enorm``/``hnorm``/``e_proj``/``h_proj``/
``norm`` keep their names).
"""
from __future__ import annotations

from torch import Tensor, nn

from ..config import SLIDING, DSV4Config
from .attention import AttentionState, RMSNorm
from .decoder_layer import DecoderLayer
from .hyper_connection import HyperHead
from .linear import Linear
from .plan import StepMeta

__all__ = ["MTPBlock", "mtp_config"]


def mtp_config(cfg: DSV4Config) -> DSV4Config:
    """The MTP block's own one-layer config: sliding-window attention, biased-top-k MoE."""
    return cfg.replace(num_hidden_layers=1, layer_types=[SLIDING], mlp_layer_types=["moe"])


class MTPBlock(DecoderLayer):
    """A one-layer ``DecoderLayer`` (sliding attention, biased MoE) with the MTP input and head."""

    def __init__(self, cfg: DSV4Config, rope) -> None:
        super().__init__(mtp_config(cfg), 0, rope)
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(dim, eps)
        self.hnorm = RMSNorm(dim, eps)
        self.e_proj = Linear(dim, dim, bias=False)
        self.h_proj = Linear(dim, dim, bias=False)
        self.hc_head = HyperHead(dim, cfg.hc_mult, cfg.hc_eps, eps)
        self.norm = RMSNorm(dim, eps)

    def forward(self, streams: Tensor, tok_embeds: Tensor, meta: StepMeta, state: AttentionState,
                input_ids: Tensor) -> Tensor:
        """``streams [B, S, N, dim]`` at positions ``meta.start..``, ``tok_embeds [B, S, dim]`` the
        embeddings of the NEXT tokens -> the block's output streams ``[B, S, N, dim]``."""
        e = self.e_proj(self.enorm(tok_embeds))
        h = self.h_proj(self.hnorm(streams))
        return super().forward(h + e.unsqueeze(2), meta, state, input_ids)

    def hidden(self, streams: Tensor) -> Tensor:
        """Output streams -> the normed hidden state the shared ``lm_head`` reads."""
        return self.norm(self.hc_head(streams))
