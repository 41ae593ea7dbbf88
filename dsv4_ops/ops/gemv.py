"""``dsv4::gemv``: the dense projections of a few tokens (decode), one weight read for all of them."""
import torch
from torch import Tensor
from torch.library import wrap_triton

from ..lowering.triton import gemv as gv
from ..lowering.triton.gemv import gemv_kernel
from ..reference import ops as ref
from . import _validate as v
from ._backend import use_triton


@torch.library.triton_op("dsv4::gemv", mutates_args=())
def _gemv(x: Tensor, weight: Tensor) -> Tensor:
    # Also the fake: shape checks, then a static device branch (see _backend.py).
    torch._check(x.dim() == 3 and weight.dim() == 3, lambda: "gemv: x [T, G, K], weight [G, N, K]")
    torch._check(x.shape[1] == weight.shape[0] and x.shape[2] == weight.shape[2],
                 lambda: "gemv: G and K of x and weight differ")
    torch._check(x.shape[0] <= gv.MAX_TOKENS, lambda: f"gemv: at most {gv.MAX_TOKENS} tokens")
    if use_triton(x):
        y, spec = gv.gemv_launch(x, weight)
        if spec is not None:
            wrap_triton(gemv_kernel)[spec.grid](*spec.args, **spec.meta)
        return y
    return ref.gemv(x, weight).contiguous()


def gemv(x: Tensor, weight: Tensor) -> Tensor:
    """``y[t, g] = weight[g] @ x[t, g]`` for a few tokens: a grouped linear layer without bias.

    Args:
        x: ``[T, G, K]`` float tokens (``T <= 8``), the dtype of ``weight``.
        weight: ``[G, N, K]``: ``G`` independent ``[N, K]`` projections (``G = 1``: ``F.linear``).

    Returns ``[T, G, N]`` in ``x``'s dtype, accumulated in fp32 and rounded once, as a matmul in
    that dtype returns it. On CUDA / ROCm one Triton launch reads the weight once for all ``T``
    tokens (the model takes it at decode; ``dsv4_ops.model.linear``).
    """
    op = "gemv"
    v.rank(op, "x", x, "[T, G, K]")
    v.rank(op, "weight", weight, "[G, N, K]")
    v.floating(op, "x", x)
    v.same_dtype(op, "weight", weight, "x", x)
    v.dim(op, "weight", weight, 0, x.shape[1], "G of x")
    v.dim(op, "weight", weight, 2, x.shape[2], "K of x")
    if x.shape[0] > gv.MAX_TOKENS:
        v.fail(op, f"x has {x.shape[0]} tokens; at most {gv.MAX_TOKENS} (use F.linear / a GEMM beyond)")
    v.same_device(op, x=x, weight=weight)
    return torch.ops.dsv4.gemv(x, weight)
