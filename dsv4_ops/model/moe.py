"""DeepSeek-V4 mixture of experts (dsv4_architecture.md §9), static shapes throughout.

Parameter names and layouts match HF's DeepseekV4SparseMoeBlock, so its state_dict loads as-is:
  gate.weight [E, D]; gate.e_score_correction_bias [E] fp32 (biased top-k) | gate.tid2eid [vocab, K] int64 (hash)
  experts.gate_up_proj [E, 2I, D] (gate rows first, then up); experts.down_proj [E, D, I]
  shared_experts.{gate_proj, up_proj}.weight [S*I, D]; shared_experts.down_proj.weight [D, S*I] (S = n_shared)
No nonzero, boolean-mask routing or data-dependent shapes (DESIGN rule 2).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.direct import dsv4
from ..reference.ops import swiglu
from .linear import Linear, fp32_linear

__all__ = ["Router", "Experts", "MLP", "MoE", "SCORE_FUNCS"]

# router scoring functions HF's DeepseekV4 builds (ACT2FN[scoring_func]); it has no "softmax"
SCORE_FUNCS = {"sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(), "sigmoid": torch.sigmoid}


class Router(nn.Module):
    """Scores (`score_func`, fp32) of every expert; experts picked by top-k of (score + bias) or, for
    hash layers, by `tid2eid[token_id]`. The bias only selects: weights are the picked scores,
    normalised to sum to 1, times `route_scale`."""

    def __init__(self, dim: int, n_experts: int, top_k: int, route_scale: float = 1.0, hash_vocab_size: int = 0,
                 score_func: str = "sqrtsoftplus"):
        super().__init__()
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"Router: score_func={score_func!r} is not supported; one of {tuple(SCORE_FUNCS)}")
        self.top_k, self.route_scale, self.is_hash = top_k, route_scale, hash_vocab_size > 0
        self.score_func = score_func
        self.weight = nn.Parameter(torch.randn(n_experts, dim, dtype=torch.float32) * 0.02)
        if self.is_hash:
            # a checkpoint overwrites it; random ids keep a freshly built model's tokens spread out
            self.register_buffer("tid2eid", torch.randint(0, n_experts, (hash_vocab_size, top_k)))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(n_experts, dtype=torch.float32))

    def forward(self, x: Tensor, input_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x: [T, D], input_ids: [T] (hash only) -> (weights [T, K] fp32, indices [T, K] int64)."""
        # fp32 like the official Gate (HF runs this linear in the model dtype; same in fp32)
        scores = SCORE_FUNCS[self.score_func](fp32_linear(x, self.weight))  # [T, E]
        if self.is_hash:
            indices = self.tid2eid[input_ids.reshape(-1)].long()
        else:
            biased = scores + self.e_score_correction_bias.float()
            indices = torch.topk(biased, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # HF's epsilon
        return weights * self.route_scale, indices


class Experts(nn.Module):
    """All routed experts as stacked 3-D weights (HF's fused layout), each token running only its
    top-k through ``dsv4::moe_gemv``, which picks its path from static facts (GEMV kernels at
    decode, grouped GEMMs or per-expert blocks beyond): a routed MoE costs what the routed experts
    cost (256 experts ~ 32 at equal top-k). Shapes depend on T, K and E, never on the routing, so
    it traces with fullgraph=True and replays in CUDA graphs."""

    def __init__(self, n_experts: int, dim: int, inter_dim: int, swiglu_limit: float = 10.0):
        super().__init__()
        self.swiglu_limit = swiglu_limit
        # drawn in place: no temporary of the largest tensors of the model
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * inter_dim, dim).normal_(0, 0.02))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, inter_dim).normal_(0, 0.02))

    def forward(self, x: Tensor, indices: Tensor, weights: Tensor) -> Tensor:
        """x: [T, D], indices/weights: [T, K] -> sum_k weights[:, k] * expert_{indices[:, k]}(x), fp32 [T, D].
        An index named twice in a row counts twice (HF's hash layers)."""
        return dsv4.moe_gemv(x, indices, weights, self.gate_up_proj, self.down_proj, float(self.swiglu_limit))


class MLP(nn.Module):
    """The shared expert: clamped SwiGLU with plain Linear layers (HF DeepseekV4MLP names)."""

    def __init__(self, dim: int, inter_dim: int, swiglu_limit: float = 10.0):
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.gate_proj = Linear(dim, inter_dim, bias=False)
        self.up_proj = Linear(dim, inter_dim, bias=False)
        self.down_proj = Linear(inter_dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))


class MoE(nn.Module):
    """Router + routed experts + the shared expert(s). `hash_vocab_size > 0` makes it a hash-routed
    layer (HF mlp_layer_types == "hash_moe"), which then needs `input_ids`. `n_shared` shared
    experts are one MLP of width n_shared * inter_dim (DeepSeek's convention); 0 means none."""

    def __init__(self, dim: int, inter_dim: int, n_experts: int, top_k: int, route_scale: float = 1.0,
                 swiglu_limit: float = 10.0, hash_vocab_size: int = 0, n_shared: int = 1,
                 score_func: str = "sqrtsoftplus"):
        super().__init__()
        self.is_hash = hash_vocab_size > 0
        self.gate = Router(dim, n_experts, top_k, route_scale, hash_vocab_size, score_func)
        self.experts = Experts(n_experts, dim, inter_dim, swiglu_limit)
        self.shared_experts = MLP(dim, n_shared * inter_dim, swiglu_limit) if n_shared > 0 else None

    def forward(self, x: Tensor, input_ids: Tensor | None = None, real: Tensor | None = None) -> Tensor:
        """x: [B, S, D], input_ids: [B, S] (hash layers) -> [B, S, D] in x.dtype.

        ``real`` [B, S] bool: False marks padding (a batch or chunk bucket's fill). Padding routes
        to no expert (id -1, which the experts op skips), so a step reads only the experts its real
        tokens pick; its output is the shared expert's."""
        if self.is_hash and input_ids is None:
            raise ValueError("MoE: hash-routed layer needs input_ids ([B, S] token ids)")
        flat = x.flatten(0, -2)  # [T, D]
        weights, indices = self.gate(flat, input_ids)
        if real is not None:
            indices = torch.where(real.reshape(-1, 1), indices, -1)
        out = self.experts(flat, indices, weights)  # fp32 accumulation, as the official MoE
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.to(x.dtype).view_as(x)
