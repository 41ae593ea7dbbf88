"""The model's dense projections: bias-free inference calls go through ``dsv4::gemv``, which picks
the Triton GEMV for a decode token where it beats cuBLAS and ``F.linear`` otherwise (its module
docstring says where); a forward that autograd records stays on ``F.linear``."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..ops.direct import dsv4

__all__ = ["Linear", "grouped_linear", "fp32_linear", "FP32_SUM_MAX_TOKENS"]


def _needs_grad(x: Tensor, weight: Tensor) -> bool:
    # the dsv4 ops are inference kernels without a backward: a forward that autograd records keeps aten
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) whose bias-free inference calls run
    ``dsv4::gemv`` (one weight read for a decode token on a GPU, ``F.linear`` otherwise)."""

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if self.bias is not None or _needs_grad(x, w):
            return F.linear(x, w, self.bias)
        y = dsv4.gemv(x.reshape(-1, 1, x.shape[-1]), w.unsqueeze(0))
        return y.view(*x.shape[:-1], w.shape[0])


def grouped_linear(x: Tensor, weight: Tensor) -> Tensor:
    """``[..., G, K] x [G, N, K] -> [..., G, N]``: group ``g`` of every token through ``weight[g]``
    (the grouped output projection ``o_a``)."""
    G, N, K = weight.shape
    if _needs_grad(x, weight):
        return torch.einsum("...gk,gnk->...gn", x, weight)
    return dsv4.gemv(x.reshape(-1, G, K), weight).view(*x.shape[:-1], N)


# The fp32 projections onto a few outputs (the mHC mixing weights: 24 of 4 x 4096 inputs; the routers:
# 256 of 4096): at a decode step's token or two, cuBLAS runs each as one to three latency-bound
# kernels (a cast of the bf16 router weight to fp32, then an fp32 GEMV or a dot + reduce pair), 13 of
# them per Flash-slice step. Written as a product and a sum, Inductor makes each one reduction kernel
# that reads the weight once in its stored dtype. Only when compiling (eager keeps F.linear and its
# numerics) and only for few tokens: at many tokens the product-and-sum reads the weight
# once per token where a GEMM reads it once per tile.
FP32_SUM_MAX_TOKENS = 4


def fp32_linear(x: Tensor, weight: Tensor) -> Tensor:
    """``F.linear(x.float(), weight.float())``: in fp32 whatever the dtypes (``[..., K] x [N, K] -> [..., N]``)."""
    tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
    # statically known: a symbolic token count (dynamic=True) keeps the GEMM rather than adding a guard
    # on it (and a graph per side of the threshold)
    if torch.compiler.is_compiling() and statically_known_true((tokens > 0) & (tokens <= FP32_SUM_MAX_TOKENS)):
        return (x.float().unsqueeze(-2) * weight.float()).sum(-1)
    return F.linear(x.float(), weight.float())
