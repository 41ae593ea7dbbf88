"""Dense projections that take ``dsv4::gemv`` at decode.

At batch 1 a projection is a matrix-vector product: its cost is one read of the weight, which
``dsv4::gemv`` streams at close to HBM bandwidth where cuBLAS's split-K tiles reached about half
(``lowering/triton/gemv.py``). The choice is static (device, dtype, token count, width and
whether autograd needs a graph), so a compiled step takes one path and never branches on data.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..lowering.triton.gemv import MAX_TOKENS
from ..ops._backend import use_triton

__all__ = ["Linear", "grouped_linear", "gemv_supported", "fp32_linear", "GEMV_MAX_TOKENS", "GEMV_MIN_ROWS",
           "GEMV_MIN_K", "FP32_SUM_MAX_TOKENS"]

# Where the GEMV beat cuBLAS on the H200 (benchmarks/bench_gemv.py, BENCHMARKS.md session 9):
# one token (at 2 tokens it wins only on some shapes, from 4 it loses everywhere);
GEMV_MAX_TOKENS = 1
assert GEMV_MAX_TOKENS <= MAX_TOKENS
# rows of at least 2048 inputs (q_b's 1024-wide rows: cuBLAS 18.6 vs 19.0 us; o_b's 8192: 22.0 vs
# 17.9; kv's 4096: 7.4 vs 4.2);
GEMV_MIN_K = 2048
# and enough output rows (all groups) to spread the read over the GPU (not the indexer's 64-wide
# weights projection or the routers)
GEMV_MIN_ROWS = 512


def gemv_supported(x: Tensor, weight: Tensor, tokens: int, rows: int) -> bool:
    """Whether a projection of ``tokens`` tokens onto ``rows`` outputs takes ``dsv4::gemv``."""
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    # a non-contiguous weight (a view someone sliced) would be copied on every call: cuBLAS reads it in place
    return (use_triton(x) and x.dtype == weight.dtype and 0 < tokens <= GEMV_MAX_TOKENS
            and rows >= GEMV_MIN_ROWS and weight.shape[-1] >= GEMV_MIN_K and weight.is_contiguous()
            and not needs_grad)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) whose few-token calls on a Triton device
    run ``dsv4::gemv``; everything else is ``F.linear``."""

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if self.bias is None and gemv_supported(x, w, tokens, w.shape[0]):
            y = torch.ops.dsv4.gemv(x.reshape(tokens, 1, x.shape[-1]), w.unsqueeze(0))
            return y.view(*x.shape[:-1], w.shape[0])
        return F.linear(x, w, self.bias)


def grouped_linear(x: Tensor, weight: Tensor) -> Tensor:
    """``[..., G, K] x [G, N, K] -> [..., G, N]``: group ``g`` of every token through ``weight[g]``
    (the grouped output projection ``o_a``)."""
    G, N, K = weight.shape
    tokens = x.numel() // (G * K) if G * K else 0
    if gemv_supported(x, weight, tokens, G * N):
        return torch.ops.dsv4.gemv(x.reshape(tokens, G, K), weight).view(*x.shape[:-1], N)
    return torch.einsum("...gk,gnk->...gn", x, weight)


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
