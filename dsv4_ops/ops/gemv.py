"""``dsv4::gemv``: the model's dense projections without bias, one weight read for a decode token.

At batch 1 a projection is a matrix-vector product: its cost is one read of the weight, which the
Triton GEMV streams at close to HBM bandwidth where cuBLAS's split-K tiles reached about half
(``lowering/triton/gemv.py``). The op takes the kernel where it measured faster than cuBLAS
(``takes_kernel``: one token, wide rows, enough outputs) and ``F.linear`` / a grouped einsum
everywhere else. The choice is a function of static facts (device, dtypes, shapes), so a
compiled step takes one path and never branches on data.
"""
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.library import wrap_triton

from ..lowering.triton import gemv as gv
from ..lowering.triton.gemv import gemv_kernel
from . import validate as v
from ._backend import check, use_triton
from .direct import dsv4

# Where the GEMV beat cuBLAS (docs/kernels.md): one token, rows of at least 2048 inputs, and enough
# output rows (all groups) to spread the read over the GPU (not the indexer's 64-wide weights projection)
KERNEL_MAX_TOKENS = 1
KERNEL_MIN_K = 2048
KERNEL_MIN_ROWS = 512
assert KERNEL_MAX_TOKENS <= gv.MAX_TOKENS


def takes_kernel(x: Tensor, weight: Tensor) -> bool:
    """Whether the Triton GEMV serves ``x [T, G, K] @ weight [G, N, K]``: a Triton device, one
    token, matching dtypes and a contiguous weight (a sliced view would be copied on every call,
    where cuBLAS reads it in place)."""
    G, N, K = weight.shape
    return (use_triton(x) and x.dtype == weight.dtype and 0 < x.shape[0] <= KERNEL_MAX_TOKENS
            and G * N >= KERNEL_MIN_ROWS and K >= KERNEL_MIN_K and weight.is_contiguous())


@torch.library.triton_op("dsv4::gemv", mutates_args=())
def _gemv(x: Tensor, weight: Tensor) -> Tensor:
    # Also the fake: shape checks, then a static choice of path (see _backend.py).
    check(x.dim() == 3 and weight.dim() == 3, lambda: "gemv: x [T, G, K], weight [G, N, K]")
    check(x.shape[1] == weight.shape[0] and x.shape[2] == weight.shape[2],
          lambda: "gemv: G and K of x and weight differ")
    if takes_kernel(x, weight):
        y, spec = gv.gemv_launch(x, weight)
        if spec is not None:
            wrap_triton(gemv_kernel)[spec.grid](*spec.args, **spec.meta)
        return y
    T, G, K = x.shape
    if G == 1:  # exactly F.linear's numerics (cuBLAS / the CPU GEMM)
        return F.linear(x.reshape(T, K), weight[0]).view(T, 1, weight.shape[1])
    return torch.einsum("tgk,gnk->tgn", x, weight).contiguous()


def gemv(x: Tensor, weight: Tensor) -> Tensor:
    """``y[t, g] = weight[g] @ x[t, g]``: a grouped linear layer without bias.

    Args:
        x: ``[T, G, K]`` float tokens, the dtype of ``weight``.
        weight: ``[G, N, K]``: ``G`` independent ``[N, K]`` projections (``G = 1``: ``F.linear``).

    Returns ``[T, G, N]`` in ``x``'s dtype, accumulated in fp32 and rounded once, as a matmul in
    that dtype returns it (the module docstring says when the Triton GEMV computes it).
    """
    v.once_per_signature(_check_arguments, x, weight)
    return dsv4.gemv(x, weight)


def _check_arguments(x: Tensor, weight: Tensor) -> None:
    """The metadata checks of :func:`gemv` (ranks, dtypes, matching dims, devices)."""
    op = "gemv"
    v.rank(op, "x", x, "[T, G, K]")
    v.rank(op, "weight", weight, "[G, N, K]")
    v.floating(op, "x", x)
    v.same_dtype(op, "weight", weight, "x", x)
    v.dim(op, "weight", weight, 0, x.shape[1], "G of x")
    v.dim(op, "weight", weight, 2, x.shape[2], "K of x")
    v.same_device(op, x=x, weight=weight)
