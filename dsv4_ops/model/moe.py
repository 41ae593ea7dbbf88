"""DeepSeek-V4 mixture of experts (dsv4_architecture.md §9), static shapes throughout.

Parameter names and layouts match HF's DeepseekV4SparseMoeBlock, so its state_dict loads as-is:
  gate.weight [E, D]; gate.e_score_correction_bias [E] fp32 (biased top-k) | gate.tid2eid [vocab, K] int64 (hash)
  experts.gate_up_proj [E, 2I, D] (gate rows first, then up); experts.down_proj [E, D, I]
  shared_experts.{gate_proj, up_proj}.weight [I, D]; shared_experts.down_proj.weight [D, I]
No nonzero, boolean-mask routing or data-dependent shapes (DESIGN rule 2).
"""
import torch
import torch.nn.functional as F
from torch import nn


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    # clamped SwiGLU (HF and the official code): gate only from above, up on both sides
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class Router(nn.Module):
    """sqrt-softplus scores in fp32; experts picked by top-k of (score + bias) or, for hash layers,
    by `tid2eid[token_id]`. The bias only selects: weights are the picked scores, normalised to sum
    to 1, times `route_scale`."""

    def __init__(self, dim: int, n_experts: int, top_k: int, route_scale: float = 1.0, hash_vocab_size: int = 0):
        super().__init__()
        self.top_k, self.route_scale, self.is_hash = top_k, route_scale, hash_vocab_size > 0
        self.weight = nn.Parameter(torch.randn(n_experts, dim) * 0.02)
        if self.is_hash:
            # a checkpoint overwrites it; random ids keep a freshly built model's tokens spread out
            self.register_buffer("tid2eid", torch.randint(0, n_experts, (hash_vocab_size, top_k)))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D], input_ids: [T] (hash only) -> (weights [T, K] fp32, indices [T, K] int64)."""
        # fp32 like the official Gate (HF runs this linear in the model dtype; same in fp32)
        scores = F.softplus(F.linear(x.float(), self.weight.float())).sqrt()  # [T, E]
        if self.is_hash:
            indices = self.tid2eid[input_ids.reshape(-1)].long()
        else:
            biased = scores + self.e_score_correction_bias.float()
            indices = torch.topk(biased, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # HF's epsilon
        return weights * self.route_scale, indices


class Experts(nn.Module):
    """All routed experts as stacked 3-D weights (HF's fused layout)."""

    def __init__(self, n_experts: int, dim: int, inter_dim: int, swiglu_limit: float = 10.0):
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.randn(n_experts, 2 * inter_dim, dim) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(n_experts, dim, inter_dim) * 0.02)

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [T, D], indices/weights: [T, K] -> sum_k weights[:, k] * expert_{indices[:, k]}(x), fp32 [T, D].

        Dense: every expert runs on every token and a [T, E] combine matrix (zero off the top-k) keeps
        the picked outputs. Static and trivially correct, and it reads each expert's weights once, which
        is about what a large decode batch touches anyway; but it costs E/K times the routed FLOPs and
        [E, T, 2I] activations, so it only suits tiny/bench configs and small T. The alternatives:
        gathering per-token weights (gpt-fast mixtral: w[indices] + einsum) is cheapest at batch 1 but
        materialises [T, K, 2I, D]; the production path is a sort-by-expert grouped GEMM
        (torch._grouped_mm with offsets from a static [E] histogram; bf16 only), which can replace
        this method without touching the parameters.
        """
        T, E = x.shape[0], self.gate_up_proj.shape[0]
        # scatter_add: a hash row that names an expert twice counts it twice, as in HF
        combine = weights.new_zeros(T, E).scatter_add_(1, indices, weights)  # [T, E]
        gate, up = torch.matmul(x, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # [E, T, I] each
        y = torch.matmul(swiglu(gate, up, self.swiglu_limit), self.down_proj.transpose(1, 2))  # [E, T, D]
        return (y * combine.t().unsqueeze(-1)).sum(dim=0)


class MLP(nn.Module):
    """The shared expert: clamped SwiGLU with plain Linear layers (HF DeepseekV4MLP names)."""

    def __init__(self, dim: int, inter_dim: int, swiglu_limit: float = 10.0):
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.gate_proj = nn.Linear(dim, inter_dim, bias=False)
        self.up_proj = nn.Linear(dim, inter_dim, bias=False)
        self.down_proj = nn.Linear(inter_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))


class MoE(nn.Module):
    """Router + routed experts + one shared expert. `hash_vocab_size > 0` makes it a hash-routed layer
    (HF mlp_layer_types == "hash_moe"), which then needs `input_ids`."""

    def __init__(self, dim: int, inter_dim: int, n_experts: int, top_k: int, route_scale: float = 1.0,
                 swiglu_limit: float = 10.0, hash_vocab_size: int = 0):
        super().__init__()
        self.is_hash = hash_vocab_size > 0
        self.gate = Router(dim, n_experts, top_k, route_scale, hash_vocab_size)
        self.experts = Experts(n_experts, dim, inter_dim, swiglu_limit)
        self.shared_experts = MLP(dim, inter_dim, swiglu_limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, S, D], input_ids: [B, S] (hash layers) -> [B, S, D] in x.dtype."""
        if self.is_hash and input_ids is None:
            raise ValueError("MoE: hash-routed layer needs input_ids ([B, S] token ids)")
        flat = x.flatten(0, -2)  # [T, D]
        weights, indices = self.gate(flat, input_ids)
        routed = self.experts(flat, indices, weights)  # fp32 accumulation, as the official MoE
        return (routed + self.shared_experts(flat)).to(x.dtype).view_as(x)
