"""One DeepSeek-V4 decoder layer: mHC around attention, then mHC around the MoE (HF
``DeepseekV4DecoderLayer`` names). Shared by the main model and the MTP block."""
from __future__ import annotations

from torch import Tensor, nn

from ..config import DSV4Config
from .attention import Attention, AttentionState, RMSNorm
from .hyper_connection import HyperConnection
from .moe import MoE
from .plan import StepMeta

__all__ = ["DecoderLayer"]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DSV4Config, layer_idx: int, rope: dict[str, tuple[Tensor, Tensor]]) -> None:
        super().__init__()
        rope_type = "main" if cfg.compress_ratio(layer_idx) == 0 else "compress"
        self.self_attn = Attention(cfg, layer_idx, rope=rope[rope_type])
        self.mlp = MoE(
            cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
            cfg.routed_scaling_factor, cfg.swiglu_limit,
            hash_vocab_size=cfg.vocab_size if cfg.mlp_layer_types[layer_idx] == "hash_moe" else 0,
            n_shared=cfg.n_shared_experts, score_func=cfg.scoring_func,
        )  # fmt: skip
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        hc = (cfg.hidden_size, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def forward(self, x: Tensor, meta: StepMeta, state: AttentionState, input_ids: Tensor) -> Tensor:
        """``x``: ``[B, S, hc_mult, hidden]`` residual streams -> the same, after this layer."""
        u, post, comb = self.attn_hc.collapse(x)
        a = self.self_attn(self.input_layernorm(u), meta, state)
        x = self.attn_hc.expand(a, x, post, comb)
        u, post, comb = self.ffn_hc.collapse(x)
        m = self.mlp(self.post_attention_layernorm(u), input_ids, meta.real)
        return self.ffn_hc.expand(m, x, post, comb)
