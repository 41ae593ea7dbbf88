"""``dsv4::sinkhorn``: the mHC residual-mixing matrix made about doubly stochastic."""
import torch
from torch import Tensor
from torch.library import wrap_triton

from ..lowering.triton import sinkhorn as sk
from ..lowering.triton.sinkhorn import sinkhorn_kernel
from ..reference import ops as ref
from . import validate as v
from ._backend import check, use_triton
from .direct import dsv4


@torch.library.triton_op("dsv4::sinkhorn", mutates_args=())
def _sinkhorn(comb: Tensor, iters: int, eps: float) -> Tensor:
    # Also the fake: shape checks, then a static device branch (see _backend.py).
    check(comb.dim() >= 2 and comb.shape[-1] == comb.shape[-2], lambda: "sinkhorn: comb [..., N, N]")
    if use_triton(comb):
        out, spec = sk.sinkhorn_launch(comb, iters, eps)
        if spec is not None:
            wrap_triton(sinkhorn_kernel)[spec.grid](*spec.args, **spec.meta)
        return out
    return ref.sinkhorn(comb, iters, eps).contiguous()


def sinkhorn(comb: Tensor, iters: int, eps: float) -> Tensor:
    """Sinkhorn normalisation of the mHC ``comb`` matrices (architecture.md §8).

    ``c <- c / (colsum(c) + eps)``, then ``iters - 1`` times ``c <- c / (rowsum(c) + eps)``,
    ``c <- c / (colsum(c) + eps)``; math in fp32.

    Args:
        comb: ``[..., N, N]`` positive float matrices (the mHC softmax + ``hc_eps``), one per token.
        iters: Sinkhorn iterations, >= 1 (V4: 20).
        eps: offset of every row / column sum (V4: ``hc_eps``).

    Returns fp32 ``[..., N, N]``, contiguous. On CUDA one Triton launch runs the whole loop.
    """
    v.once_per_signature(_check_arguments, comb, iters)
    return dsv4.sinkhorn(comb, iters, float(eps))


def _check_arguments(comb: Tensor, iters: int) -> None:
    """The metadata checks of :func:`sinkhorn` (square matrices, a float dtype, ``iters``)."""
    op = "sinkhorn"
    if comb.dim() < 2 or comb.shape[-1] != comb.shape[-2]:
        v.fail(op, f"comb must be [..., N, N] (square matrices), got shape {tuple(comb.shape)}")
    v.floating(op, "comb", comb)
    v.at_least(op, "iters", iters, 1)
