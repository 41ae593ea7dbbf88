"""Triton ``plan``: every metadata tensor of a step (or of ``steps`` MTP sub-steps) in ONE
launch. Contract: ``dsv4_ops.reference.plan``.

Grid ``(steps * B, cdiv(S, BLOCK_S))``: one program per ``(step, row)`` and block of ``BLOCK_S``
query slots ``j``. From the row's ``lengths`` / ``n_new`` it derives ``start = lengths + step *
n_new``, ``end = start + n_new``, then for its slots writes ``positions``, ``win_write``, the
``[BLOCK_S, W]`` tile(s) of ``win_idx``, and ``*_len`` / ``*_write`` of both rates. Emit slot
``e`` (``e < ceil(S/m) <= S``) is written by the program that owns query slot ``j = e``, so all
nine outputs come from the same launch: a step's metadata is a few integers per token, so its
cost is launches, not bytes. Per-slot math in int64 (positions near 2^31 do not overflow); the
``[BLOCK_S, BLOCK_W]`` window tile is int32, relative to ``start`` (``start % R`` folded in
once), which keeps the kernel's registers well below an int64 tile's (docs/kernels.md).
Outputs int32.

Negative ``lengths`` / ``n_new`` count as 0 (the raw-op contract, shared with the
reference), so every quantity the reference takes ``%`` or ``//`` of is non-negative wherever
the result is kept (negative window positions are masked to -1), and the one modulo of a
possibly negative tile value is written ``((x % R) + R) % R``: C-style integer division on
the GPU and numpy's floor division in the interpreter both give the reference's results.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launch, launch, next_pow2

__all__ = ["plan", "plan_kernel", "plan_config", "plan_launch"]


@triton.jit
def _ring_write(pos, valid, end, ring):
    # written unless a later token of the step lands on the same slot (> ring new tokens)
    keep = valid & (pos >= end - ring)
    return tl.where(keep, pos % ring, -1)


@triton.jit
def plan_kernel(
    lengths_ptr, n_new_ptr,
    pos_ptr, win_write_ptr, win_idx_ptr,
    csa_len_ptr, csa_emit_ptr, csa_write_ptr,
    hca_len_ptr, hca_emit_ptr, hca_write_ptr,
    B, S, W, win_ring, csa_ratio, csa_ring, hca_ratio, hca_ring, E_CSA, E_HCA,
    sl_b, sn_b,
    WIN_CONCAT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr,
):
    pid_r = tl.program_id(0)  # step * B + b
    pid_s = tl.program_id(1)  # block of query slots
    step = (pid_r // B).to(tl.int64)
    b = (pid_r % B).to(tl.int64)
    length = tl.maximum(tl.load(lengths_ptr + b * sl_b).to(tl.int64), 0)
    n_new = tl.maximum(tl.load(n_new_ptr + b * sn_b).to(tl.int64), 0)
    start = length + step * n_new
    end = start + n_new

    j = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)  # query slots
    in_s = j < S
    pos = start + j
    valid = j < n_new
    row = pid_r.to(tl.int64) * S  # offset of this (step, b) in the [steps, B, S] outputs
    tl.store(pos_ptr + row + j, tl.where(valid, pos, -1).to(tl.int32), mask=in_s)
    tl.store(win_write_ptr + row + j, _ring_write(pos, valid, end, win_ring).to(tl.int32), mask=in_s)

    # window entries of query t: positions t-W+1 .. t (oldest first). The [BLOCK_S, BLOCK_W]
    # tile is int32, relative to start: wpos = start + rel.
    s_mod = (start % win_ring).to(tl.int32)
    neg_start = tl.maximum(-start, -(2**31 - 1)).to(tl.int32)  # wpos >= 0  <=>  rel >= -start
    for w0 in range(0, W, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        rel = j[:, None] - W + 1 + w[None, :]
        widx = ((s_mod + rel) % win_ring + win_ring) % win_ring  # wpos % win_ring, wpos >= 0
        if WIN_CONCAT:
            widx = tl.where(rel >= 0, win_ring + rel, widx)
        widx = tl.where(valid[:, None] & (rel >= neg_start), widx, -1)
        tl.store(win_idx_ptr + (row + j)[:, None] * W + w[None, :], widx,
                 mask=in_s[:, None] & (w < W)[None, :])

    # per compression rate: visible count, ring write slot, blocks closed this step
    tl.store(csa_len_ptr + row + j, tl.where(valid, (pos + 1) // csa_ratio, 0).to(tl.int32), mask=in_s)
    tl.store(hca_len_ptr + row + j, tl.where(valid, (pos + 1) // hca_ratio, 0).to(tl.int32), mask=in_s)
    tl.store(csa_write_ptr + row + j, _ring_write(pos, valid, end, csa_ring).to(tl.int32), mask=in_s)
    tl.store(hca_write_ptr + row + j, _ring_write(pos, valid, end, hca_ring).to(tl.int32), mask=in_s)
    blk = start // csa_ratio + j  # emit slot e = j
    emit = tl.where(blk < end // csa_ratio, blk, -1)
    tl.store(csa_emit_ptr + pid_r.to(tl.int64) * E_CSA + j, emit.to(tl.int32), mask=j < E_CSA)
    blk = start // hca_ratio + j
    emit = tl.where(blk < end // hca_ratio, blk, -1)
    tl.store(hca_emit_ptr + pid_r.to(tl.int64) * E_HCA + j, emit.to(tl.int32), mask=j < E_HCA)


def plan_config(num_tokens: int, window: int) -> dict:
    """Static block sizes: up to 64 query slots x 128 window entries per tile, at most 4096
    entries (a decode step is one slot, so V4's 128-entry window is one tile)."""
    block_s = min(64, next_pow2(max(num_tokens, 1)))
    block_w = min(128, next_pow2(max(window, 1)), max(1, 4096 // block_s))
    return dict(BLOCK_S=block_s, BLOCK_W=block_w, num_warps=4)


def plan_launch(lengths: torch.Tensor, n_new: torch.Tensor, num_tokens: int, steps: int, window: int, win_ring: int,
                win_concat: bool, csa_ratio: int, csa_ring: int, hca_ratio: int, hca_ring: int,
                out: tuple[torch.Tensor, ...] | None = None) -> tuple[tuple[torch.Tensor, ...], Launch | None]:
    """The nine ``int32`` plan tensors and the ``plan_kernel`` launch that fills them (``None``:
    they are empty). ``out`` (optional) is the tuple of nine contiguous ``int32`` outputs, in
    ``Plan`` order."""
    B, S, W = lengths.shape[0], num_tokens, window
    e_csa, e_hca = -(-S // csa_ratio), -(-S // hca_ratio)
    shapes = [(steps, B, S), (steps, B, S), (steps, B, S, W),
              (steps, B, S), (steps, B, e_csa), (steps, B, S),
              (steps, B, S), (steps, B, e_hca), (steps, B, S)]
    if out is None:
        out = tuple(torch.empty(s, dtype=torch.int32, device=lengths.device) for s in shapes)
    else:
        out = tuple(out)
        if len(out) != 9:
            raise ValueError(f"plan: out must hold 9 tensors, got {len(out)}")
        for i, (t, s) in enumerate(zip(out, shapes)):
            if tuple(t.shape) != s or t.dtype != torch.int32 or not t.is_contiguous():
                raise ValueError(f"plan: out[{i}] must be a contiguous int32 tensor of shape {s}, "
                                 f"got {t.dtype} {tuple(t.shape)}")
    if steps * B * S == 0:
        return out, None
    cfg = plan_config(S, W)
    args = (lengths, n_new, *out,
            B, S, W, win_ring, csa_ratio, csa_ring, hca_ratio, hca_ring, e_csa, e_hca,
            lengths.stride(0), n_new.stride(0))
    return out, Launch((steps * B, -(-S // cfg["BLOCK_S"])), args,
                       dict(WIN_CONCAT=bool(win_concat), BLOCK_S=cfg["BLOCK_S"], BLOCK_W=cfg["BLOCK_W"],
                            num_warps=cfg["num_warps"]))


def plan(*args, **kwargs) -> tuple[torch.Tensor, ...]:
    """Raw launcher with the reference signature (that of :func:`plan_launch`): the nine
    ``int32`` plan tensors."""
    out, spec = plan_launch(*args, **kwargs)
    launch(plan_kernel, spec)
    return out
