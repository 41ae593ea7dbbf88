"""``dsv4::moe_gemv``: the routed experts of a token batch, weighted and summed.

The op picks its path from static facts (device, dtypes, the number of (token, expert)
assignments), so a compiled step takes one path and never branches on data:

- a few assignments on a Triton device (decode): two GEMV launches that stream each
  assignment's expert rows once (``lowering/triton/moe_gemv.py``);
- more, bf16 on sm_90 / sm_100: ``torch._grouped_mm`` over the expert-sorted rows;
- everything else (CPU, fp32, other GPUs, the reference backend): the same sorted rows as ``bmm``
  over per-expert blocks (``lowering/aten/experts.py``).

Every path reads only the experts the tokens route to, so 256 experts cost what 32 do at equal top-k.
"""
import torch
from torch import Tensor
from torch.library import wrap_triton

from ..lowering.aten.experts import experts_blocked, experts_grouped_mm, grouped_mm_supported
from ..lowering.triton import moe_gemv as mg
from ..lowering.triton.moe_gemv import moe_down_kernel, moe_gate_up_kernel
from . import validate as v
from ._backend import check, use_triton
from .direct import dsv4


def takes_kernel(x: Tensor, w13: Tensor, n_assignments: int) -> bool:
    """Whether the GEMV kernels serve a call: a Triton device, weights of the tokens' dtype and few
    enough assignments that reading each assignment's expert once costs about what the grouped
    GEMMs' one read per routed expert does."""
    return use_triton(x) and x.dtype == w13.dtype and 0 < n_assignments <= mg.MAX_ASSIGNMENTS


@torch.library.triton_op("dsv4::moe_gemv", mutates_args=())
def _moe_gemv(x: Tensor, indices: Tensor, weights: Tensor, w13: Tensor, w2: Tensor, limit: float) -> Tensor:
    # Also the fake: shape checks, then a static choice of path (see _backend.py).
    check(x.dim() == 2 and indices.dim() == 2 and w13.dim() == 3 and w2.dim() == 3,
          lambda: "moe_gemv: x [T, D], indices [T, K], w13 [E, 2I, D], w2 [E, D, I]")
    check(weights.shape == indices.shape and indices.shape[0] == x.shape[0],
          lambda: "moe_gemv: indices and weights must be [T, K] of x")
    check(w13.shape[2] == x.shape[1] and w2.shape[1] == x.shape[1], lambda: "moe_gemv: D of x and weights differ")
    check(w13.shape[1] == 2 * w2.shape[2] and w13.shape[0] == w2.shape[0],
          lambda: "moe_gemv: w13 must be [E, 2I, D] and w2 [E, D, I]")
    T, K = indices.shape
    if T * K == 0:
        return x.new_zeros(x.shape, dtype=torch.float32)
    if takes_kernel(x, w13, T * K):
        launches = mg.moe_gemv_launches(x, indices, weights, w13, w2, limit)
        gate_up, down = launches.gate_up, launches.down
        if gate_up is not None:
            wrap_triton(moe_gate_up_kernel)[gate_up.grid](*gate_up.args, **gate_up.meta)
        if down is not None:
            wrap_triton(moe_down_kernel)[down.grid](*down.args, **down.meta)
        return launches.out
    # an id outside [0, E) contributes zero, as in the kernels: its row runs expert 0 and is dropped
    routed = (indices >= 0) & (indices < w13.shape[0])
    ids = torch.where(routed, indices, 0).long()
    run = experts_grouped_mm if grouped_mm_supported(x, w13, w2) else experts_blocked
    y = run(x, ids, w13, w2, limit).view(T, K, -1)
    # where, not a product: a skipped id's row ran expert 0, which may hold anything
    return torch.where(routed.unsqueeze(-1), y.float() * weights.float().unsqueeze(-1), 0).sum(dim=1)


def moe_gemv(x: Tensor, indices: Tensor, weights: Tensor, w13: Tensor, w2: Tensor, limit: float) -> Tensor:
    """``out[t] = sum_k weights[t, k] * expert_{indices[t, k]}(x[t])``.

    Expert ``e`` is the clamped SwiGLU MLP of HF's fused layout: ``gate | up = x @ w13[e].T``,
    ``h = silu(min(gate, limit)) * clamp(up, -limit, limit)``, ``y = h @ w2[e].T``.

    Args:
        x: ``[T, D]`` float tokens, the dtype of the weights.
        indices: ``[T, K]`` int expert ids in ``0 .. E-1``; an id named twice counts twice.
        weights: ``[T, K]`` float router weights.
        w13: ``[E, 2I, D]`` gate rows then up rows of every expert.
        w2: ``[E, D, I]`` down projections.
        limit: the SwiGLU clamp (V4: 10).

    Returns fp32 ``[T, D]`` (the module docstring says which path computes it). The raw op
    ``torch.ops.dsv4.moe_gemv`` skips ids outside ``[0, E)`` (zero contribution); this wrapper
    rejects them.
    """
    v.once_per_signature(_check_arguments, x, indices, weights, w13, w2)
    if v.checks_op_values(indices):
        E = w13.shape[0]
        v.run_value_checks(v.in_range_check("moe_gemv", "indices", indices, 0, E - 1, f"the experts E={E}"))
    return dsv4.moe_gemv(x, indices, weights, w13, w2, float(limit))


def _check_arguments(x: Tensor, indices: Tensor, weights: Tensor, w13: Tensor, w2: Tensor) -> None:
    """The metadata checks of :func:`moe_gemv` (ranks, dtypes, matching dims, devices)."""
    op = "moe_gemv"
    v.rank(op, "x", x, "[T, D]")
    v.rank(op, "indices", indices, "[T, K]")
    v.rank(op, "weights", weights, "[T, K]")
    v.rank(op, "w13", w13, "[E, 2I, D]")
    v.rank(op, "w2", w2, "[E, D, I]")
    v.floating(op, "x", x)
    v.floating(op, "weights", weights)
    v.same_dtype(op, "w13", w13, "x", x)
    v.same_dtype(op, "w2", w2, "x", x)
    if indices.dtype not in (torch.int32, torch.int64):
        v.fail(op, f"indices must be int32 or int64, got {indices.dtype}")
    v.dim(op, "indices", indices, 0, x.shape[0], "T of x")
    if weights.shape != indices.shape:
        v.fail(op, f"weights must have the shape of indices {tuple(indices.shape)}, got {tuple(weights.shape)}")
    v.dim(op, "w13", w13, 2, x.shape[1], "D of x")
    v.dim(op, "w2", w2, 0, w13.shape[0], "E of w13")
    v.dim(op, "w2", w2, 1, x.shape[1], "D of x")
    v.dim(op, "w13", w13, 1, 2 * w2.shape[2], "2 * I, I from w2")
    v.same_device(op, x=x, indices=indices, weights=weights, w13=w13, w2=w2)
