"""What the two Gluon decode-attention kernels share (``sparse_attention.py`` over bf16 caches,
``sparse_attention_fp8.py`` over FP8 pages): the virtual entry list and its splits, the epilogue,
the input checks and the assembly of a call's launches.

The contract is the Triton kernel's (``lowering.triton.sparse_attention``): one program per token
and split, each query's virtual entry list window (``kv_idx``) | picked (``cmp_idx``) | a dense
prefix of ``cmp_len`` pool rows, the sink folded in at the end, and with several splits fp32
partials merged by that module's ``combine_kernel``.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..triton.launch import sm_count
from ..triton.sparse_attention import LOG2E, attention_config, combine_kernel, combine_launch

__all__ = ["BLOCK_H", "HEAD_DIM", "load_entry_index", "pick_entry_index", "valid_entries", "split_range", "epilogue",
           "check_decode", "decode_launches", "run"]

BLOCK_H, HEAD_DIM = 64, 512  # the heads and width both kernels serve: one program holds every head


@gluon.jit
def load_entry_index(v, W, L, widx_row, swi_w, cidx_row, sci_k):
    """The load half of an entry's row index: one load a lane (kv_idx or the ``L`` entries of cmp_idx;
    -1 in an unlisted dense prefix), completed by ``pick_entry_index``. The kernels issue these loads a
    block ahead and pick once that block comes round: a select right behind the loads would wait out
    their latency."""
    in_w = v < W
    listed = v < W + L
    ptr = gl.where(in_w, widx_row + v * swi_w, cidx_row + (v - W) * sci_k)
    return gl.load(ptr, mask=listed, other=-1)


@gluon.jit
def pick_entry_index(v, loaded, W, K, L):
    """Row index of entries ``v`` from their loads (``load_entry_index``): the listed index, or the dense prefix's
    row. cmp_idx lists ``L >= K`` entries: the ``K`` picks, then (``L > K``, a paged pool's) the dense prefix's
    rows, so that the prefix follows the block table."""
    return gl.where(v < W + L, loaded, v - W - K)


@gluon.jit
def valid_entries(v, idx, hi, W, N_KV, N_CMP):
    """Entries that are read: inside this split, a non-negative index inside its segment's rows. The copies'
    masks and the scorer's score bias both follow this rule, so a masked row is never scored."""
    return (v < hi) & (idx >= 0) & (idx < gl.where(v < W, N_KV, N_CMP))


@gluon.jit
def split_range(cmp_len_row, N_CMP, W, K, pid_sp, NUM_SPLITS: gl.constexpr, BLOCK_N: gl.constexpr):
    """Entries ``[lo, hi)`` of split ``pid_sp`` of the query's virtual list (window, picks, a dense
    prefix of ``cmp_len`` pool rows, clamped to the pool) and its number of ``BLOCK_N`` blocks:
    splits of whole blocks, the last ones possibly empty. Every partition computes it for itself."""
    clen = gl.load(cmp_len_row)
    clen = gl.minimum(gl.maximum(clen, 0), N_CMP)
    total = W + K + clen
    if NUM_SPLITS > 1:
        chunk = gl.cdiv(gl.cdiv(total, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = pid_sp * chunk
        hi = gl.minimum(lo + chunk, total)
    else:
        lo = 0
        hi = total
    return lo, hi, gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)


@gluon.jit
def epilogue(acc, m_i, l_i, sink_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, b, pid_t, pid_sp, so_b, so_h,
             o_l: gl.constexpr, D: gl.constexpr, BLOCK_H: gl.constexpr, NUM_SPLITS: gl.constexpr,
             COL0: gl.constexpr, STATS: gl.constexpr, stage):
    """One MMA warpgroup's output columns ``COL0 ...`` (``acc``, layout ``o_l``). One split: the sink folded in and
    the output stored through ``stage`` (shared memory of ``acc``'s shape and the output's dtype that nothing reads
    any more), so that each warp stores whole rows, 16 bytes a thread: from the accumulator's layout a store writes
    4 bytes a thread in pieces of 8 rows, which cost most of a call's fixed time. Several splits: this split's fp32
    partials for ``combine_kernel``, straight from the accumulator (8 bytes a thread, whole sectors: staging them
    gained nothing); ``STATS``: this caller also stores the split's row max and sum (the warpgroups hold the same)."""
    offs_h = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_l))
    offs_o = COL0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, o_l))
    if NUM_SPLITS == 1:
        sink = gl.load(sink_ptr + offs_h).to(gl.float32) * 1.4426950408889634
        m_f = gl.maximum(m_i, sink)
        alpha = gl.exp2(m_i - m_f)
        denom = l_i * alpha + gl.exp2(sink - m_f)
        stage.store((acc * (alpha / denom)[:, None]).to(out_ptr.dtype.element_ty))
        gl.thread_barrier()  # every thread's part staged
        rows_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
        offs_hr = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, rows_l))
        offs_or = COL0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, rows_l))
        gl.store(out_ptr + b * so_b + offs_hr[:, None] * so_h + offs_or[None, :], stage.load(rows_l))
    else:
        row = (pid_t * NUM_SPLITS + pid_sp).to(gl.int64) * BLOCK_H
        if STATS:
            gl.store(part_m_ptr + row + offs_h, m_i)
            gl.store(part_l_ptr + row + offs_h, l_i)
        gl.store(part_acc_ptr + (row + offs_h)[:, None] * D + offs_o[None, :], acc)


def check_decode(name: str, q, kv_idx, cmp_idx, cmp_len, sink) -> None:
    """ValueError, prefixed ``name``, naming the argument outside the decode both kernels serve: bf16 q
    ``[B, 1, BLOCK_H, HEAD_DIM]``, int32 indices and lengths, one sink a head (``sink`` None: not checked)."""
    if q.dim() != 4:
        raise ValueError(f"{name}: q must be [B, S, H, D], got {tuple(q.shape)}")
    B, S, H, D = q.shape
    if q.dtype != torch.bfloat16:
        raise ValueError(f"{name}: q must be bf16, got {q.dtype}")
    if H != BLOCK_H:
        raise ValueError(f"{name}: H (q.shape[2]) must be {BLOCK_H}, got {H}")
    if D != HEAD_DIM:
        raise ValueError(f"{name}: D (q.shape[3]) must be {HEAD_DIM}, got {D}")
    if S != 1:
        raise ValueError(f"{name}: S (q.shape[1]) must be 1 (decode), got {S}")
    for arg, t in (("kv_idx", kv_idx), ("cmp_idx", cmp_idx), ("cmp_len", cmp_len)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name}: {arg} must be int32, got {t.dtype}")
    if sink is not None and sink.numel() != H:
        raise ValueError(f"{name}: sink must have {H} entries, got {sink.numel()}")


def decode_launches(name, kernel, meta, q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale, n_kv, n_cmp,
                    num_splits=None, out=None, picks=None):
    """(out, [(kernel, grid, args, meta), ...]) of one decode call: ``kernel`` with ``meta`` on a ``(B, splits)``
    grid and, when split, ``combine_kernel``. ``n_kv`` / ``n_cmp``: the window's and the pool's rows (``kv``,
    ``cmp``: valid pointers even when empty). ``picks``: cmp_idx's picks (None: all), the rest the dense prefix
    (``attention_sm90.paged_entries``). Splits: the Triton kernel's rule for window + picks or the prefix."""
    if n_kv == 0 and n_cmp == 0:
        raise ValueError(f"{name}: kv and cmp are both empty (no rows to attend to)")
    B, _, H, D = q.shape
    W, L = kv_idx.shape[-1], cmp_idx.shape[-1]
    K = L if picks is None else picks
    if not 0 <= K <= L:
        raise ValueError(f"{name}: picks must be in [0, {L}] (cmp_idx's entries), got {picks}")
    dense_rows = n_cmp if picks is None else L - K
    # an empty index list is never read but needs a valid pointer; its length (W or L = 0) is what the kernel reads
    if W == 0:
        kv_idx = cmp_len[..., None]
    if L == 0:
        cmp_idx = cmp_len[..., None]
    splits = attention_config(B, 1, BLOCK_H, HEAD_DIM, W + (K if K else dense_rows), sm_count(q.device),
                              num_splits)["NUM_SPLITS"]
    if out is None:
        out = torch.empty_like(q)
    if out.stride(-1) != 1:
        raise ValueError(f"{name}: out must be contiguous in its last dim")
    if splits > 1:
        part_m = torch.empty((B, splits, H), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((B, splits, H, D), dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused
    args = (q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, out, part_m, part_l, part_acc, float(scale) * LOG2E,
            n_kv if W else 0, n_cmp, W, K, L,
            q.stride(0), q.stride(2), kv.stride(0), kv.stride(1), kv_idx.stride(0), kv_idx.stride(2),
            cmp.stride(0), cmp.stride(1), cmp_idx.stride(0), cmp_idx.stride(2), cmp_len.stride(0),
            out.stride(0), out.stride(2))
    launches = [(kernel, (B, splits), args, dict(meta, D=D, BLOCK_H=BLOCK_H, NUM_SPLITS=splits))]
    if splits > 1:
        launches.append((combine_kernel, *combine_launch(part_m, part_l, part_acc, sink, out, D)))
    return out, launches


def run(out, launches):
    """Launch what ``decode_launches`` planned; ``out``."""
    for kernel, grid, args, meta in launches:
        kernel[grid](*args, **meta)
    return out
