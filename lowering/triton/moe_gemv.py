"""Triton routed experts for a few tokens (decode): two GEMV launches in place of the sort, the
gathers and the two grouped GEMMs of ``model/moe.py``. Contract: ``dsv4_ops.reference.moe_gemv``.

Why a kernel: at batch 1 a V4 MoE layer reads 6 routed experts (~300 MB at Flash widths), so its
cost is weight bandwidth, and the grouped path spends it in ~10 launches (argsort, histogram,
gathers, two ``torch._grouped_mm`` that reach about half of HBM bandwidth at 1 row per group,
the inverse permutation, the weighted sum). Here:

- ``moe_gate_up_kernel``, grid ``(T * K, cdiv(I, BLOCK_I))``: program ``(a, i-block)`` computes
  ``BLOCK_I`` gate and up outputs of assignment ``a`` (token ``a // K``, expert ``indices[a]``) —
  two ``[BLOCK_I, D]`` row strips of ``w13[e]`` against ``x[t]`` — then the clamped SwiGLU, and
  stores ``h [T*K, I]``.
- ``moe_down_kernel``, grid ``(T, cdiv(D, BLOCK_O))``: program ``(t, d-block)`` computes
  ``BLOCK_O`` outputs of token ``t`` for each of its ``K`` experts (strips of ``w2[e]`` against
  ``h``) and sums them with the router weights, in a fixed order (deterministic; no atomics),
  into ``out [T, D]`` fp32.

Each program streams whole weight rows (contiguous ``D`` / ``I`` runs), so the loads are
coalesced and the grid has thousands of programs at batch 1. Weights are read once per
assignment: two tokens routed to one expert read it twice, which is why the model uses this
path only for a few tokens (``MAX_ASSIGNMENTS``) and the grouped GEMMs beyond.
An expert id outside ``[0, E)`` contributes zero (the raw-op contract: skipped, never read).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launch, launch, next_pow2

__all__ = ["moe_gemv", "moe_gemv_launches", "moe_gate_up_kernel", "moe_down_kernel", "MAX_ASSIGNMENTS"]

# the model takes this path while tokens * top_k is at most this (batch 1-8 at V4's top-6)
MAX_ASSIGNMENTS = 64

# launch configuration (block sizes cap at the problem's widths): the fastest measured (docs/kernels.md)
DEFAULT_CONFIG = dict(gate_up_rows=4, gate_up_cols=512, gate_up_stages=3, gate_up_warps=4,
                      down_rows=8, down_cols=512, down_stages=3, down_warps=4)


@triton.jit
def moe_gate_up_kernel(x_ptr, idx_ptr, w13_ptr, h_ptr, K, E, D, I, limit,
                       BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr, NUM_STAGES: tl.constexpr):
    # x [T, D], idx [T*K] int64, w13 [E, 2I, D] (gate rows, then up rows), h [T*K, I]: contiguous
    a = tl.program_id(0)
    limit = tl.cast(limit, tl.float32)  # Inductor passes Python floats as fp64
    t = a // K
    e = tl.load(idx_ptr + a)
    routed = (e >= 0) & (e < E)
    e = tl.where(routed, e, 0).to(tl.int64)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    d = tl.arange(0, BLOCK_D)
    row_ok = (i < I) & routed
    gate_rows = w13_ptr + e * 2 * I * D + i.to(tl.int64)[:, None] * D
    up_rows = gate_rows + I * D  # < 2^31 for any real expert
    x_row = x_ptr + t.to(tl.int64) * D
    acc_gate = tl.zeros([BLOCK_I, BLOCK_D], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_I, BLOCK_D], dtype=tl.float32)
    for d0 in tl.range(0, D, BLOCK_D, num_stages=NUM_STAGES):
        col_ok = (d0 + d) < D
        xv = tl.load(x_row + d0 + d, mask=col_ok, other=0.0).to(tl.float32)
        ok = row_ok[:, None] & col_ok[None, :]
        acc_gate += tl.load(gate_rows + d0 + d[None, :], mask=ok, other=0.0).to(tl.float32) * xv[None, :]
        acc_up += tl.load(up_rows + d0 + d[None, :], mask=ok, other=0.0).to(tl.float32) * xv[None, :]
    # gate / up rounded to the weights' dtype, as a matmul in that dtype returns them
    gate = tl.sum(acc_gate, axis=1).to(h_ptr.dtype.element_ty).to(tl.float32)
    up = tl.sum(acc_up, axis=1).to(h_ptr.dtype.element_ty).to(tl.float32)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    h = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + a.to(tl.int64) * I + i, h.to(h_ptr.dtype.element_ty), mask=i < I)


@triton.jit
def moe_down_kernel(h_ptr, idx_ptr, wt_ptr, w2_ptr, out_ptr, K, E, D, I,
                    BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, NUM_STAGES: tl.constexpr):
    # h [T*K, I], idx / wt [T*K] (int64 / fp32), w2 [E, D, I], out [T, D] fp32: contiguous
    t = tl.program_id(0)
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    j = tl.arange(0, BLOCK_I)
    o_ok = o < D
    total = tl.zeros([BLOCK_O], dtype=tl.float32)
    for k in range(K):
        a = t * K + k
        e = tl.load(idx_ptr + a)
        routed = (e >= 0) & (e < E)
        e = tl.where(routed, e, 0).to(tl.int64)
        rows = w2_ptr + e * D * I + o.to(tl.int64)[:, None] * I
        h_row = h_ptr + a.to(tl.int64) * I
        acc = tl.zeros([BLOCK_O, BLOCK_I], dtype=tl.float32)
        for i0 in tl.range(0, I, BLOCK_I, num_stages=NUM_STAGES):
            col_ok = (i0 + j) < I
            hv = tl.load(h_row + i0 + j, mask=col_ok, other=0.0).to(tl.float32)
            ok = (o_ok & routed)[:, None] & col_ok[None, :]
            acc += tl.load(rows + i0 + j[None, :], mask=ok, other=0.0).to(tl.float32) * hv[None, :]
        y = tl.sum(acc, axis=1)
        total += tl.where(routed, tl.load(wt_ptr + a).to(tl.float32), 0.0) * y
    tl.store(out_ptr + t.to(tl.int64) * D + o, total, mask=o_ok)


class MoeGemvLaunches(tuple):
    """(out, h, gate_up, down): the output, the SwiGLU scratch and the two launches (None when empty)."""

    out = property(lambda s: s[0])
    h = property(lambda s: s[1])
    gate_up = property(lambda s: s[2])
    down = property(lambda s: s[3])


def moe_gemv_launches(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor, limit: float, out: torch.Tensor | None = None,
                      config: dict | None = None) -> MoeGemvLaunches:
    """Launches of ``moe_gemv`` for ``x [T, D]``, ``indices / weights [T, K]``, ``w13 [E, 2I, D]``,
    ``w2 [E, D, I]``; ``config`` overrides entries of ``DEFAULT_CONFIG`` (sweeps)."""
    c = {**DEFAULT_CONFIG, **(config or {})}
    (T, D), K, E, I = x.shape, indices.shape[1], w13.shape[0], w2.shape[2]
    if out is None:
        out = torch.empty(T, D, dtype=torch.float32, device=x.device)
    h = torch.empty(T * K, I, dtype=w13.dtype, device=x.device)
    if T == 0 or K == 0 or D == 0:
        return MoeGemvLaunches((out, h, None, None))
    if I == 0:  # no hidden units: every expert outputs 0
        out.zero_()
        return MoeGemvLaunches((out, h, None, None))
    xc, idx = x.contiguous(), indices.reshape(-1).to(torch.int64).contiguous()
    wt = weights.reshape(-1).float().contiguous()
    block_i = min(c["gate_up_rows"], next_pow2(I))
    block_d = min(c["gate_up_cols"], next_pow2(D))
    gate_up = Launch((T * K, triton.cdiv(I, block_i)), (xc, idx, w13.contiguous(), h, K, E, D, I, float(limit)),
                     dict(BLOCK_I=block_i, BLOCK_D=block_d, NUM_STAGES=c["gate_up_stages"], num_warps=c["gate_up_warps"]))
    block_o = min(c["down_rows"], next_pow2(D))
    block_j = min(c["down_cols"], next_pow2(I))
    down = Launch((T, triton.cdiv(D, block_o)), (h, idx, wt, w2.contiguous(), out, K, E, D, I),
                  dict(BLOCK_O=block_o, BLOCK_I=block_j, NUM_STAGES=c["down_stages"], num_warps=c["down_warps"]))
    return MoeGemvLaunches((out, h, gate_up, down))


def moe_gemv(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
             w2: torch.Tensor, limit: float, out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """Raw launcher with the reference signature -> ``out [T, D]`` fp32."""
    launches = moe_gemv_launches(x, indices, weights, w13, w2, limit, out, config)
    launch(moe_gate_up_kernel, launches.gate_up)
    launch(moe_down_kernel, launches.down)
    return launches.out
