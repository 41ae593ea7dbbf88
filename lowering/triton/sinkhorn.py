"""Triton Sinkhorn for the mHC mixing matrix: the whole ``2 * iters - 1`` normalisation loop of
a block of tokens in one launch, each token's ``N x N`` matrix held in registers.
Contract: ``dsv4_ops.reference.sinkhorn``.

Why a kernel: Inductor lowers the eager loop (alternating row / column sums of a ``[T, N, N]``
tensor) to one kernel per normalisation, since each sum reads entries other threads produce;
here one program owns ``BLOCK_T`` whole matrices (grid ``(cdiv(T, BLOCK_T),)``), so the loop
never leaves registers and each mHC site is one launch (measured effect: docs/kernels.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launch, launch, next_pow2

__all__ = ["sinkhorn", "sinkhorn_kernel", "sinkhorn_launch", "sinkhorn_config"]


@triton.jit
def sinkhorn_kernel(comb_ptr, out_ptr, T, N, iters, eps,
                    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    # comb / out: contiguous [T, N, N] fp32; padded rows / columns are held at 0
    eps = tl.cast(eps, tl.float32)  # Inductor passes Python floats as fp64
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    i = tl.arange(0, BLOCK_N)
    ok = (t < T)[:, None, None] & (i < N)[None, :, None] & (i < N)[None, None, :]
    offs = t.to(tl.int64)[:, None, None] * N * N + i[None, :, None] * N + i[None, None, :]
    c = tl.load(comb_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    c = c / (tl.sum(c, axis=1)[:, None, :] + eps)  # columns
    for _ in range(iters - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + eps)  # rows
        c = c / (tl.sum(c, axis=1)[:, None, :] + eps)  # columns
    tl.store(out_ptr + offs, c, mask=ok)


def sinkhorn_config(T: int, N: int) -> dict:
    """Matrices per program and warps (a pure function of sizes).

    One warp per program: the row / column sums of a matrix (39 at V4's 20 iterations) then
    reduce with shuffles inside the warp, never through shared memory and a block-wide barrier,
    which a 4-warp program needs (the H200 sweep: docs/kernels.md). Few matrices (decode): one
    entry per lane, so the matrices spread over as many programs as possible; many (prefill): 4
    entries per lane, fewer programs.
    """
    lanes = 32 if T * N * N <= 32 * 4096 else 128
    return dict(BLOCK_T=max(1, lanes // (next_pow2(N) ** 2)), num_warps=1)


def sinkhorn_launch(comb: torch.Tensor, iters: int, eps: float,
                    out: torch.Tensor | None = None, *, config: dict | None = None
                    ) -> tuple[torch.Tensor, Launch | None]:
    """``out`` (fp32, the shape of ``comb``) and the ``sinkhorn_kernel`` launch that fills it
    (``None``: no matrices). ``config`` overrides keys of ``sinkhorn_config`` (sweeps, tests)."""
    N = comb.shape[-1]
    flat = comb.float().contiguous()
    if out is None:
        out = torch.empty(comb.shape, dtype=torch.float32, device=comb.device)
    T = flat.numel() // max(N * N, 1)
    if T == 0:
        return out, None
    cfg = {**sinkhorn_config(T, N), **(config or {})}
    return out, Launch((triton.cdiv(T, cfg["BLOCK_T"]),), (flat, out, T, N, iters, float(eps)),
                       dict(BLOCK_T=cfg["BLOCK_T"], BLOCK_N=next_pow2(N), num_warps=cfg["num_warps"]))


def sinkhorn(comb: torch.Tensor, iters: int, eps: float, out: torch.Tensor | None = None, *,
             config: dict | None = None) -> torch.Tensor:
    """Raw launcher with the reference signature: ``comb [..., N, N]`` -> fp32, same shape."""
    out, spec = sinkhorn_launch(comb, iters, eps, out, config=config)
    launch(sinkhorn_kernel, spec)
    return out
