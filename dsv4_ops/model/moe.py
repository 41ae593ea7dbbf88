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

from ..lowering.triton.moe_gemv import MAX_ASSIGNMENTS
from ..ops._backend import use_triton
from .linear import Linear, fp32_linear

__all__ = ["swiglu", "Router", "Experts", "MLP", "MoE", "SCORE_FUNCS", "route_layout", "grouped_mm_supported",
           "moe_gemv_supported"]

# router scoring functions HF's DeepseekV4 builds (ACT2FN[scoring_func]); it has no "softmax"
SCORE_FUNCS = {"sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(), "sigmoid": torch.sigmoid}


def swiglu(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    # clamped SwiGLU (HF and the official code): gate only from above, up on both sides
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


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
        self.weight = nn.Parameter(torch.randn(n_experts, dim) * 0.02)
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


# ---- routed experts -----------------------------------------------------------------------------
# torch._grouped_mm's fast kernels: bf16 on sm90 / sm100. Elsewhere CUDA falls back to a per-group
# loop that reads the offsets on the host (a sync; no CUDA graphs), and its fake kernel accepts bf16
# only, so other dtypes would not even trace. ROCm: the portable path (DESIGN rule 6).
_GROUPED_MM_ARCHS = (9, 10)


@torch._dynamo.assume_constant_result
def _cuda_arch_has_grouped_mm(device_index: int) -> bool:
    if torch.version.hip is not None or not hasattr(torch, "_grouped_mm"):
        return False
    return torch.cuda.get_device_capability(device_index)[0] in _GROUPED_MM_ARCHS


def grouped_mm_supported(x: Tensor, gate_up_proj: Tensor, down_proj: Tensor) -> bool:
    """Whether `Experts` takes the `torch._grouped_mm` path for these tensors: static facts only
    (device, dtype, 16-byte aligned rows), so the choice is fixed while tracing."""
    if not (x.is_cuda and x.dtype == gate_up_proj.dtype == down_proj.dtype == torch.bfloat16):
        return False
    if gate_up_proj.shape[-1] % 8 or down_proj.shape[-1] % 8:
        return False
    return _cuda_arch_has_grouped_mm(x.device.index)  # a CUDA tensor's device always has its index


def moe_gemv_supported(x: Tensor, gate_up_proj: Tensor, n_assignments: int) -> bool:
    """Whether `Experts` takes the `dsv4::moe_gemv` path: a Triton backend device, weights of the
    tokens' dtype, and few enough (token, expert) assignments that reading each assignment's expert
    once costs about what the grouped GEMMs' one read per routed expert does (static facts only)."""
    return use_triton(x) and x.dtype == gate_up_proj.dtype and 0 < n_assignments <= MAX_ASSIGNMENTS


def route_layout(indices: Tensor, n_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """The T*K (token, expert) assignments sorted by expert, with static shapes.

    indices [T, K] -> (flat [N] expert of each assignment (token-major), order [N] assignments
    by expert (stable argsort, so tokens stay in order within an expert), counts [E] int64
    assignments per expert). Assignment a is token a // K; a row naming an expert twice is two
    assignments. The histogram is a scatter_add of ones: no bincount, no data-dependent shape."""
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    return flat, order, counts


def _inverse(order: Tensor) -> Tensor:
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def experts_grouped_mm(x: Tensor, indices: Tensor, w13: Tensor, w2: Tensor, limit: float) -> Tensor:
    """One grouped GEMM per projection over the expert-sorted rows: every assignment's FLOPs once,
    every routed expert's weights once, unrouted experts untouched. -> [N, D] in assignment order."""
    K = indices.shape[1]
    flat, order, counts = route_layout(indices, w13.shape[0])
    offs = counts.cumsum(0).to(torch.int32)  # end row of each expert's group
    xs = x[order // K]  # [N, D] rows sorted by expert
    gate, up = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    ys = torch._grouped_mm(swiglu(gate, up, limit), w2.transpose(1, 2), offs=offs)  # [N, D]
    return ys[_inverse(order)]


def experts_blocked(x: Tensor, indices: Tensor, w13: Tensor, w2: Tensor, limit: float) -> Tensor:
    """Portable path (any device / dtype): the expert-sorted rows padded per expert to blocks of B
    rows, each block one bmm against its expert's weights gathered once per block.

    B = ceil(N / E): while N = T*K <= E (decode) B = 1 and the blocks are exactly the routed
    (token, expert) pairs, so only routed experts are read; at large N the blocks gather at most 2E
    expert weights in all (twice the expert set, however skewed the routing) and at most 2N rows.
    The block count is the static bound floor((N + min(E, N) * (B - 1)) / B); spare blocks repeat
    a routed expert on a zero row and are dropped. -> [N, D] in assignment order."""
    (T, D), K, E = x.shape, indices.shape[1], w13.shape[0]
    N = T * K
    B = max(1, -(-N // E))
    n_blocks = (N + min(E, N) * (B - 1)) // B
    flat, order, counts = route_layout(indices, E)
    sorted_e = flat[order]
    padded = (counts + (B - 1)) // B * B  # [E] rows per expert, rounded up to whole blocks
    pad_start = padded.cumsum(0) - padded
    start = counts.cumsum(0) - counts
    rank = torch.arange(N, device=x.device) - start[sorted_e]  # place within its expert
    pos = pad_start[sorted_e] + rank  # [N] padded row of each sorted assignment
    rows = torch.full((n_blocks, B), T, dtype=torch.int64, device=x.device)  # token of each padded row
    rows.view(-1).scatter_(0, pos, order // K)
    blocks = torch.arange(n_blocks, device=x.device)
    block_e = torch.searchsorted(padded.cumsum(0) // B, blocks, right=True)  # expert of each block
    block_e = torch.where(block_e < E, block_e, sorted_e[-1])  # spare blocks: a routed expert, zero rows
    xp = torch.cat([x, x.new_zeros(1, D)])[rows]  # [n_blocks, B, D]; row T is the zero row
    gate, up = torch.bmm(xp, w13[block_e].transpose(1, 2)).chunk(2, dim=-1)  # [n_blocks, B, I] each
    y = torch.bmm(swiglu(gate, up, limit), w2[block_e].transpose(1, 2)).flatten(0, 1)  # [n_blocks * B, D]
    return y[pos[_inverse(order)]]


class Experts(nn.Module):
    """All routed experts as stacked 3-D weights (HF's fused layout), each token running only its
    top-k: a routed MoE must cost what the routed experts cost (256 experts ~ 32 at equal top-k).

    A few tokens on a Triton device (decode; `moe_gemv_supported`): `dsv4::moe_gemv`, two GEMV
    launches over each assignment's expert rows. More tokens, CUDA bf16 on sm90/sm100: `torch._grouped_mm` over the expert-sorted assignments
    (`experts_grouped_mm`). Everything else (CPU, fp32, other GPUs): `experts_blocked`, the same
    sorted layout as bmm over per-expert blocks. The path is chosen from device, dtype and shapes
    only; shapes depend on T, K and E, never on the routing, so it traces with fullgraph=True and
    replays in CUDA graphs. The token count T is static (one graph per token count)."""

    def __init__(self, n_experts: int, dim: int, inter_dim: int, swiglu_limit: float = 10.0):
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.randn(n_experts, 2 * inter_dim, dim) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(n_experts, dim, inter_dim) * 0.02)

    def forward(self, x: Tensor, indices: Tensor, weights: Tensor) -> Tensor:
        """x: [T, D], indices/weights: [T, K] -> sum_k weights[:, k] * expert_{indices[:, k]}(x), fp32 [T, D].
        An index named twice in a row counts twice (HF's hash layers)."""
        T, K = indices.shape
        if T == 0:
            return x.new_zeros(x.shape, dtype=torch.float32)
        w13, w2 = self.gate_up_proj, self.down_proj
        if moe_gemv_supported(x, w13, T * K):  # a few tokens (decode): two GEMV launches, already weighted
            return torch.ops.dsv4.moe_gemv(x, indices, weights, w13, w2, float(self.swiglu_limit))
        run = experts_grouped_mm if grouped_mm_supported(x, w13, w2) else experts_blocked
        y = run(x, indices, w13, w2, self.swiglu_limit).view(T, K, -1)
        return (y.float() * weights.float().unsqueeze(-1)).sum(dim=1)


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

    def forward(self, x: Tensor, input_ids: Tensor | None = None) -> Tensor:
        """x: [B, S, D], input_ids: [B, S] (hash layers) -> [B, S, D] in x.dtype."""
        if self.is_hash and input_ids is None:
            raise ValueError("MoE: hash-routed layer needs input_ids ([B, S] token ids)")
        flat = x.flatten(0, -2)  # [T, D]
        weights, indices = self.gate(flat, input_ids)
        out = self.experts(flat, indices, weights)  # fp32 accumulation, as the official MoE
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.to(x.dtype).view_as(x)
