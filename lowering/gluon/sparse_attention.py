"""Gluon decode sparse attention over bf16 caches for sm_90: the kernel ``dsv4::sparse_attention`` runs for bf16
decode at V4's widths (``BLOCK_H`` heads of ``HEAD_DIM``, one query token) on an sm_90 GPU, routed by
``dsv4_ops/ops/attention_sm90.py``; the contract is the Triton kernel's (``common``)."""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .common import (HEAD_DIM, check_decode, decode_launches, load_entry_index, pick_entry_index, run,
                     split_range, valid_entries)
from .mma_partitions import helper, mma_buffers, scorer

__all__ = ["sparse_attention_gluon", "sparse_attention_gluon_ws_kernel", "gluon_launch"]

NAME = "sparse_attention_gluon"
BLOCK_N, NUM_STAGES = 32, 4  # rows a block, ring slots: three blocks in flight under the one computed
NUM_WARPS = 4  # the kernel's, i.e. the scorer's (the default partition)
PRODUCER_WARPS, PRODUCER_REGS = 4, 80
HELPER_REGS = 176  # its half of the accumulator is 128 fp32 registers a thread; fewer spilled


@gluon.jit
def _producer(ring, full, empty, cmp_len_row, pid_sp, W, K, L, N_KV, N_CMP, kv_row0, skv_n, cmp_row0, sc_n,
              widx_row, swi_w, cidx_row, sci_k,
              D: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_SPLITS: gl.constexpr):
    """Gather every block's rows into the ring, ``NUM_STAGES`` blocks ahead at most. The next block's row indices
    are loaded before this block's copies are issued, so their latency overlaps the wait for a free slot and the
    issue instead of preceding every block. Each thread arms the slot's ``full`` barrier with
    ``cp.async.mbarrier.arrive.noinc``: its arrival lands with its copies, and no producer thread waits for them."""
    lo, hi, n_blocks = split_range(cmp_len_row, N_CMP, W, K, pid_sp, NUM_SPLITS, BLOCK_N)
    gather_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, gather_l))
    v_next = lo + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gather_l))
    loaded_next = load_entry_index(v_next, W, L, widx_row, swi_w, cidx_row, sci_k)
    for j in range(n_blocks):
        slot = j % NUM_STAGES
        v = v_next
        loaded = loaded_next
        v_next = v + BLOCK_N
        # in flight from here to the next iteration's pick (picking right behind the loads would wait for them)
        loaded_next = load_entry_index(v_next, W, L, widx_row, swi_w, cidx_row, sci_k)
        idx = pick_entry_index(v, loaded, W, K, L)
        valid = valid_entries(v, idx, hi, W, N_KV, N_CMP)
        idx64 = gl.where(valid, idx, 0).to(gl.int64)
        row = gl.where(v < W, kv_row0 + idx64 * skv_n, cmp_row0 + idx64 * sc_n)
        # the slot's previous block (j - NUM_STAGES) must have been consumed by both warpgroups; the first round is free
        mbarrier.wait(empty.index(slot), ((j // NUM_STAGES) + 1) & 1, pred=j >= NUM_STAGES)
        cp.async_copy_global_to_shared(ring.index(slot), row[:, None] + offs_d[None, :], mask=valid[:, None])
        cp.mbarrier_arrive(full.index(slot), increment_count=False)


@gluon.jit
def sparse_attention_gluon_ws_kernel(
    q_ptr, kv_ptr, kv_idx_ptr, cmp_ptr, cmp_idx_ptr, cmp_len_ptr, sink_ptr, out_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,
    scale_log2e,
    N_KV, N_CMP, W, K, L,
    sq_b, sq_h, skv_b, skv_n, swi_b, swi_w,  # strides: q, kv, window index,
    sc_b, sc_n, sci_b, sci_k, scl_b, so_b, so_h,  # compressed kv, its index and length, out
    D: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    NUM_SPLITS: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, HELPER_REGS: gl.constexpr,
):
    """One program per token and split, in three partitions of one warpgroup each (``gl.warp_specialize``), so that
    the gathers, the scores and ``P @ rows`` overlap instead of taking turns:

    - the producer (``_producer``) gathers each ``BLOCK_N``-row block with ``cp.async`` into a ring of
      ``NUM_STAGES`` swizzled slots (masked lanes zero-filled, no memory read) and publishes it on the slot's
      ``full`` mbarrier as its copies land;
    - the scorer and the helper (``mma_partitions``) score each block, run the softmax and accumulate ``P @ rows``,
      each over half of the output columns, and free the slot on its ``empty`` mbarrier.

    Splits follow the Triton kernel's rule (``attention_config``): one program fills an SM, so a call takes the
    most splits, of whole blocks, that keep its grid within one wave of programs (capped, and no split shorter
    than a minimum of entries); several splits leave fp32 partials for ``combine_kernel``.
    ``setmaxnreg`` gives the producer ``PRODUCER_REGS``, the helper ``HELPER_REGS`` and the scorer the rest."""
    gl.static_assert(gl.num_warps() == 4, "the scoring warpgroup is the default partition")
    pid_t = gl.program_id(0)
    pid_sp = gl.program_id(1)
    scale_log2e = scale_log2e.to(gl.float32)
    b = pid_t.to(gl.int64)

    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D], gl.bfloat16)
    e_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16)

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D], q_sl)
    ring = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BLOCK_N, D], e_sl)
    # every producer thread's arrival (with its copies) publishes a slot
    p_smem, alpha_smem, ml_smem, full, empty, pfull, pfree, done = mma_buffers(BLOCK_H, BLOCK_N, NUM_STAGES,
                                                                               PRODUCER_WARPS * 32)

    cmp_len_row = cmp_len_ptr + b * scl_b
    kv_row0 = kv_ptr + b * skv_b
    cmp_row0 = cmp_ptr + b * sc_b
    widx_row = kv_idx_ptr + b * swi_b
    cidx_row = cmp_idx_ptr + b * sci_b
    q_row = q_ptr + b * sq_b

    gl.warp_specialize([
        (scorer, (q_row, sq_h, q_smem, ring, p_smem, alpha_smem, ml_smem, full, empty, pfull, pfree, done,
                  cmp_len_row, pid_sp, scale_log2e, W, K, L, N_KV, N_CMP, widx_row, swi_w, cidx_row, sci_k,
                  sink_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, b, pid_t, so_b, so_h,
                  D, BLOCK_H, BLOCK_N, NUM_STAGES, NUM_SPLITS)),
        (helper, (q_smem, ring, p_smem, alpha_smem, ml_smem, empty, pfull, pfree, done, cmp_len_row, pid_sp, N_CMP, W, K,
                  sink_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, b, pid_t, so_b, so_h,
                  D, BLOCK_H, BLOCK_N, NUM_STAGES, NUM_SPLITS)),
        (_producer, (ring, full, empty, cmp_len_row, pid_sp, W, K, L, N_KV, N_CMP, kv_row0, skv_n, cmp_row0, sc_n,
                     widx_row, swi_w, cidx_row, sci_k, D, BLOCK_N, NUM_STAGES, NUM_SPLITS)),
    ], [4, PRODUCER_WARPS], [HELPER_REGS, PRODUCER_REGS])


def _check(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink):
    """ValueError naming the argument outside the one case this kernel serves."""
    check_decode(NAME, q, kv_idx, cmp_idx, cmp_len, sink)
    for arg, t in (("kv", kv), ("cmp", cmp)):
        if t.dtype != torch.bfloat16 or t.dim() != 3 or t.shape[-1] != HEAD_DIM:
            raise ValueError(f"{NAME}: {arg} must be bf16 rows [B, N, {HEAD_DIM}], got {t.dtype} {tuple(t.shape)} "
                             "(FP8 pages: lowering.gluon.sparse_attention_fp8)")


def gluon_launch(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale, num_splits=None, out=None, picks=None):
    """(out, [(kernel, grid, args, meta), ...]) of one call: the attention and, when split, ``combine_kernel``;
    the cross-compile tests compile these without a GPU."""
    _check(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink)
    q, kv, cmp = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, kv, cmp))
    n_kv, n_cmp = kv.shape[1], cmp.shape[1]
    # an empty segment is never dereferenced (every lane masked) but needs a valid pointer
    if n_kv == 0 or kv_idx.shape[-1] == 0:
        kv = cmp
    if n_cmp == 0:
        cmp = kv
    meta = dict(BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES, PRODUCER_WARPS=PRODUCER_WARPS, PRODUCER_REGS=PRODUCER_REGS,
                HELPER_REGS=HELPER_REGS, num_warps=NUM_WARPS)
    return decode_launches(NAME, sparse_attention_gluon_ws_kernel, meta, q, kv, kv_idx, cmp, cmp_idx, cmp_len,
                           sink.contiguous(), scale, n_kv, n_cmp, num_splits, out, picks)


def sparse_attention_gluon(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale, num_splits=None, *,
                           out=None, picks=None) -> torch.Tensor:
    """``lowering.triton.sparse_attention.sparse_attention`` for bf16 decode at V4's widths (``BLOCK_H`` heads of
    ``HEAD_DIM``, one query token, bf16 caches); ValueError for anything else. ``picks``: ``common.decode_launches``."""
    return run(*gluon_launch(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale, num_splits, out, picks))
