"""DeepSeek-V4 for causal LM on the dsv4 ops (dsv4_architecture.md §3-§9).

Parameter names equal HF transformers' ``DeepseekV4ForCausalLM`` (``model.embed_tokens``,
``model.layers.N.{self_attn,mlp,attn_hc,ffn_hc,input_layernorm,post_attention_layernorm}``,
``model.norm``, ``model.hc_head``, ``lm_head``), so ``load_state_dict(hf.state_dict())`` loads
everything. Numerics follow the official reference: norms, mHC, sinks, compressor gates and
the router stay fp32 whatever the model dtype (parameters created fp32, math upcast).

Two ways to run it:
* ``model(input_ids)`` — cache-free full forward of whole prompts from position 0:
  ``[B, S] -> [B, S, vocab]`` logits (fp32).
* ``model.step(input_ids, cache, lengths, n_new)`` — the incremental step the generator
  compiles: ``n_new[b]`` new tokens per row at positions ``lengths[b]..``, all state in a
  ``StaticCache``; one ``plan`` call per step, every layer reads the same plan.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import ops
from ..cache import StaticCache
from ..config import DSV4Config
from ..reference.layer import RMSNorm, StepPlan, plan_step
from ..reference.rope import rope_tables
from .attention import Attention
from .hyper_connection import HyperConnection, HyperHead
from .moe import MoE

__all__ = ["DeepseekV4ForCausalLM", "DeepseekV4Model", "DecoderLayer", "DEFAULT_MAX_POSITIONS"]

# RoPE tables are precomputed per rope type; 1M positions would cost 256 MB each, so the
# default covers 32K and `set_max_positions` grows them (the Generator does it for you).
DEFAULT_MAX_POSITIONS = 32768


class DecoderLayer(nn.Module):
    """mHC around attention, then mHC around the MoE (HF ``DeepseekV4DecoderLayer``)."""

    def __init__(self, cfg: DSV4Config, layer_idx: int, rope: dict[str, tuple[Tensor, Tensor]]) -> None:
        super().__init__()
        rope_type = "main" if cfg.compress_ratio(layer_idx) == 0 else "compress"
        self.self_attn = Attention(cfg, layer_idx, rope=rope[rope_type])
        self.mlp = MoE(
            cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
            cfg.routed_scaling_factor, cfg.swiglu_limit,
            hash_vocab_size=cfg.vocab_size if cfg.mlp_layer_types[layer_idx] == "hash_moe" else 0,
        )  # fmt: skip
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        hc = (cfg.hidden_size, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def forward(self, x: Tensor, state, lengths: Tensor, n_new: Tensor, meta: StepPlan, input_ids: Tensor) -> Tensor:
        # x: [B, S, hc_mult, hidden] residual streams
        u, post, comb = self.attn_hc.collapse(x)
        a = self.self_attn.step(self.input_layernorm(u), state, lengths, n_new, meta)
        x = self.attn_hc.expand(a, x, post, comb)
        u, post, comb = self.ffn_hc.collapse(x)
        m = self.mlp(self.post_attention_layernorm(u), input_ids)
        return self.ffn_hc.expand(m, x, post, comb)


class DeepseekV4Model(nn.Module):
    def __init__(self, cfg: DSV4Config, rope: dict[str, tuple[Tensor, Tensor]]) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rope) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg.hidden_size, cfg.hc_mult, cfg.hc_eps, cfg.rms_norm_eps)


def _rope(cfg: DSV4Config, max_positions: int, device=None) -> dict[str, tuple[Tensor, Tensor]]:
    tables = {}
    for name, layer_type in (("main", "sliding_attention"), ("compress", "compressed_sparse_attention")):
        theta, yarn = cfg.rope_params(layer_type)
        cos, sin = rope_tables(theta, cfg.rope_head_dim, max_positions, yarn)
        tables[name] = (cos.to(device), sin.to(device))
    return tables


class DeepseekV4ForCausalLM(nn.Module):
    """DeepSeek-V4 on the dsv4 ops.

    Args:
        config: a ``DSV4Config``.
        dtype: dtype of the projection / embedding / expert weights (fp32-only parameters —
            norms, mHC, sinks, position biases, router bias — stay fp32).
        device: where to build it.
        max_positions: RoPE table length (default ``min(max_position_embeddings, 32768)``).

    >>> m = DeepseekV4ForCausalLM(DSV4Config.tiny())
    >>> m(torch.randint(0, 256, (2, 9))).shape
    torch.Size([2, 9, 256])
    """

    def __init__(self, config: DSV4Config, dtype: torch.dtype = torch.float32, device=None,
                 max_positions: int | None = None) -> None:
        super().__init__()
        if config.scoring_func != "sqrtsoftplus":
            # the router (model/moe.py) implements V4's sqrt-softplus only; anything else
            # would silently give different logits from HF
            raise ValueError(f"DeepseekV4ForCausalLM: config.scoring_func={config.scoring_func!r} is not "
                             "supported (only 'sqrtsoftplus', as DeepSeek-V4 ships)")
        self.config = config
        max_positions = max_positions or min(config.max_position_embeddings, DEFAULT_MAX_POSITIONS)
        from .mtp import MTPBlock  # imports DecoderLayer from this module

        with torch.device(device or "cpu"):
            rope = _rope(config, max_positions)
            self.model = DeepseekV4Model(config, rope)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            # the MTP (NextN) drafter: `mtp.0.*`, used by Generator(spec_steps=k)
            self.mtp = nn.ModuleList(MTPBlock(config, rope) for _ in range(min(config.num_nextn_predict_layers, 1)))
        _cast_non_fp32_params(self, dtype)

    # ------------------------------------------------------------------ helpers
    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def max_positions(self) -> int:
        return self.model.layers[0].self_attn.cos.shape[0]

    def set_max_positions(self, n: int) -> None:
        """Rebuild the shared RoPE tables for ``n`` positions (no-op if already that long)."""
        if n == self.max_positions:
            return
        rope = _rope(self.config, n, self.device)
        for layer in [*self.model.layers, *self.mtp]:
            attn = layer.self_attn
            attn.cos, attn.sin = rope["main" if attn.ratio == 0 else "compress"]

    # ------------------------------------------------------------------ running
    def plan(self, cache, lengths: Tensor, n_new: Tensor, num_tokens: int, concat: bool | None = None) -> StepPlan:
        """The step's one ``plan`` call: metadata every layer reads."""
        return plan_step(self.config, lengths, n_new, num_tokens, cache.rings, concat, kernels=ops)

    def hidden_streams(self, input_ids: Tensor, cache, lengths: Tensor, n_new: Tensor,
                       meta: StepPlan | None = None) -> Tensor:
        """Final residual streams ``[B, S, hc_mult, hidden]`` (before ``hc_head``)."""
        if meta is None:
            meta = self.plan(cache, lengths, n_new, input_ids.shape[1])
        h = self.model.embed_tokens(input_ids)
        x = h.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        for layer, state in zip(self.model.layers, cache.states):
            x = layer(x, state, lengths, n_new, meta, input_ids)
        return x

    def logits(self, streams: Tensor) -> Tensor:
        """``[..., hc_mult, hidden]`` streams -> fp32 logits ``[..., vocab]``."""
        return self.lm_head(self.model.norm(self.model.hc_head(streams))).float()

    def step(self, input_ids: Tensor, cache, lengths: Tensor, n_new: Tensor, meta: StepPlan | None = None) -> Tensor:
        """One incremental step: ``input_ids [B, S]`` (row ``b``'s first ``n_new[b]`` are real)
        at positions ``lengths[b]..`` -> fp32 logits ``[B, S, vocab]``; the cache is updated in
        place and the caller advances ``lengths += n_new``."""
        return self.logits(self.hidden_streams(input_ids, cache, lengths, n_new, meta))

    def forward(self, input_ids: Tensor) -> Tensor:
        """Cache-free full forward of whole prompts from position 0: ``[B, S] -> [B, S, vocab]``."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
        B, S = input_ids.shape
        if S > self.max_positions:
            raise ValueError(f"input_ids has {S} tokens > max_positions {self.max_positions}")
        cache = StaticCache(self, B, max(S, 1))
        zeros = torch.zeros(B, dtype=torch.int32, device=input_ids.device)
        return self.step(input_ids, cache, zeros, torch.full_like(zeros, S))


def _cast_non_fp32_params(model: nn.Module, dtype: torch.dtype) -> None:
    """Put the big weights in ``dtype``; parameters the reference keeps fp32 stay fp32 (norms,
    mHC, sinks, compressor position biases are created fp32; Linear/Embedding weights are
    the only ones cast)."""
    if dtype == torch.float32:
        return
    for mod in model.modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            mod.to(dtype)
    for name, p in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            p.data = p.data.to(dtype)
