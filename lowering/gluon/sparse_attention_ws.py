"""Warp-specialised Gluon decode sparse attention (sm_90, bf16, H = 64, D = 512, S = 1): variant ``ws``.

Three partitions of 4 warps each (``gl.warp_specialize``):

- the *producer* gathers each 32-row block into a ring slot with 16-byte ``cp.async`` (invalid lanes zero-filled,
  no memory read), and publishes the block on the slot's ``full`` mbarrier once it
  has landed (``PUBLISH``, ``_producer``), up to ``NUM_STAGES - 1`` blocks ahead of the consumers;
- the *scorer* (warpgroup 0, the default partition) stages q and computes every block's scores alone: S[64 heads,
  32 rows] as 32 dependent m64n32k16 wgmmas, the online softmax, then hands P (bf16) and the block's rescale factors
  to warpgroup 1 through a two-deep shared buffer (``pfull`` / ``pfree`` mbarriers) and issues its own half of
  ``P @ rows`` (the slot's first 256 columns, a slice of its shared-memory descriptor);
- the *helper* (warpgroup 1) rescales its half of the accumulator by those factors and issues the other half of
  ``P @ rows``.

Each warpgroup owns 256 of the 512 output columns and writes them itself (``_epilogue``'s ``COL0``); warpgroup 0 leaves the
final row maxima and sums in shared memory for warpgroup 1 (``done``). With one split each stages its bf16 output in
its half of q's buffer and stores it a row a warp, 16 bytes a thread (``STAGED_OUT``). A ring slot is freed once both
warpgroups' ``P @ rows`` of its block has completed (``empty`` counts two arrivals).

Why (session 24, BENCHMARKS.md): until then both warpgroups of an 8-warp consumer each scored half of a block's rows
(N = 16), so each read all of q (64 KB) from shared memory for every block: 160 KB of score operands a 32-row block,
bound by shared-memory bandwidth (the score wgmmas cost ~0.7 of the 1.6 us a block took with no HBM traffic;
``benchmarks/ws_diag.py --consumer``). One scoring warpgroup reads q once a block (96 KB of operands) and the
exchange of row maxima, its barrier and the second CTA barrier go. Both ``P @ rows`` are waited for right after their
issue: left in flight across the loop's back edge, ptxas serialised every wgmma of the kernel (C7515).

The score bias (0 / -inf per entry) is computed by the scorer from the same indices as the producer's copy mask
(``_valid``), so no plain shared-memory store of the producer has to be ordered against its asynchronous arrivals.

Launch split, contract, partials and ``combine_kernel``: as ``sparse_attention.py`` (whose ``gluon_launch`` launches
this kernel for ``variant="ws"``, with this module's ``NUM_WARPS``). Registers: the helper gets ``HELPER_REGS``, the
producer ``PRODUCER_REGS``, the scorer the rest (``setmaxnreg``).

The FP8 reader (``sparse_attention_fp8_ws.py``) runs ``_scorer`` and ``_helper`` beside its decoder partition.

Status (H200, BENCHMARKS.md, sessions 24 and 25): session 24's partitions took CSA 32K B=128 from 46.4 to 42.4 us
against session 23's 8-warp consumer (``benchmarks/ws_ab.py``). Session 25 found the output's store from the
accumulator's layout to cost ~8 of the ~11.6 us a call spent outside the loop at 128 programs (``ws_diag.py``'s
no-block variants); staged through shared memory it costs ~2.6: through the public op, B=128 at 32K and 128K is now
60.1-65.0% of the floor (50.4-61.1% before), B=64 32.1-47.5% (two splits: fp32 partials and the combine kernel, ~13 us
of fixed cost, unchanged). Session 26: per-thread arrivals (``PUBLISH`` 0) 0.8-1.5 us faster; the public op at B=128
63.0-66.8%, B=64 33.0-48.0%. Correct against the float64 oracle and with every SM's shared memory poisoned before each
launch.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                             warpgroup_mma_init, warpgroup_mma_wait)

from .sparse_attention import _epilogue, _load_entry_index, _pick_entry_index, _split_range

__all__ = ["sparse_attention_gluon_ws_kernel", "PRODUCER_WARPS", "PRODUCER_REGS", "HELPER_REGS", "PUBLISH", "NUM_WARPS",
           "Q_REG_COLS", "STAGED_OUT"]

NUM_WARPS = 4  # the kernel's, i.e. the scorer's (the default partition); the launcher reads it
PRODUCER_WARPS = 4
# how the producer publishes a landed block (``_producer``): 0 = each thread's arrival lands with its copies
# (``.noinc``); 1 = the writers wait, fence, then arrive. 0 since session 26 (H200, ``benchmarks/ws_ab.py``, outputs
# identical): 0.8-1.5 us faster in all five cases, e.g. CSA 32K B=64 30.08 -> 29.23, B=128 36.21 -> 35.06
PUBLISH = 0
PRODUCER_REGS = 80
HELPER_REGS = gl.constexpr(176)  # acc[64, 256] fp32 is 128 a thread; 152 spilled
# q's columns held in the scorer's registers as the scores' A operand (0, 128 or 256; ``_scores``). Session 25 (H200):
# 256 (with HELPER_REGS 168) 1 us faster at HCA B=128, up to 0.6 us slower at B=64 and CSA; 128 within 0.3 us: off
Q_REG_COLS = gl.constexpr(0)
# one split: each warpgroup's output through its half of q's shared memory, stored a row a warp (``_epilogue``)
STAGED_OUT = gl.constexpr(True)


@gluon.jit
def _valid(v, idx, hi, W, N_KV, N_CMP):
    """Entries that are read: inside this split, a non-negative index inside its segment's rows.
    Producer (copy mask) and scorer (score bias) both use this rule."""
    return (v < hi) & (idx >= 0) & (idx < gl.where(v < W, N_KV, N_CMP))


@gluon.jit
def _producer(ring, full, empty, cmp_len_row, pid_sp, W, K, N_KV, N_CMP, kv_row0, skv_n, cmp_row0, sc_n,
              widx_row, swi_w, cidx_row, sci_k,
              D: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, PUBLISH: gl.constexpr,
              NUM_SPLITS: gl.constexpr):
    """Gather every block's rows into the ring, ``NUM_STAGES`` blocks ahead at most. The next
    block's row indices are loaded before this block's copies are issued, so their latency
    overlaps the wait for a free slot and the issue instead of preceding every block.

    ``PUBLISH`` 0: each thread arms the slot's ``full`` barrier with
    ``cp.async.mbarrier.arrive.noinc`` (its arrival lands with its copies). 1: the writers
    publish the rows themselves, as the non-specialised kernels do: once block j is issued, each
    thread waits for its copies of block ``j - LAG`` (``cp.async.wait_group``), fences them for
    the async proxy the wgmma reads through, the partition barriers, and one thread arrives.

    With ``PUBLISH`` 1 and 4 stages, block k is published only after block k + 2 has been issued into block k - 2's slot. So a
    consumer that waited for block i + 1 before freeing block i - 1 would deadlock. Session 23 measured such a
    consumer, one that issues the next block's scores under this block's softmax: it hung. Its deadlock-free forms were
    slower (BENCHMARKS.md, session 23)."""
    lo, hi, n_blocks = _split_range(cmp_len_row, N_CMP, W, K, pid_sp, NUM_SPLITS, BLOCK_N)
    LAG: gl.constexpr = NUM_STAGES - 2  # blocks issued but not yet published, past the newest
    gather_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, gather_l))
    v_next = lo + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gather_l))
    loaded_next = _load_entry_index(v_next, W, K, widx_row, swi_w, cidx_row, sci_k)
    for j in range(n_blocks):
        slot = j % NUM_STAGES
        v = v_next
        loaded = loaded_next
        v_next = v + BLOCK_N
        # in flight from here to the next iteration's pick (picking right behind the loads would wait for them)
        loaded_next = _load_entry_index(v_next, W, K, widx_row, swi_w, cidx_row, sci_k)
        idx = _pick_entry_index(v, loaded, W, K)
        valid = _valid(v, idx, hi, W, N_KV, N_CMP)
        idx64 = gl.where(valid, idx, 0).to(gl.int64)
        row = gl.where(v < W, kv_row0 + idx64 * skv_n, cmp_row0 + idx64 * sc_n)
        # the slot's previous block (j - NUM_STAGES) must have been consumed by both warpgroups; the first round is free
        mbarrier.wait(empty.index(slot), ((j // NUM_STAGES) + 1) & 1, pred=j >= NUM_STAGES)
        cp.async_copy_global_to_shared(ring.index(slot), row[:, None] + offs_d[None, :], mask=valid[:, None])
        if PUBLISH == 0:
            cp.mbarrier_arrive(full.index(slot), increment_count=False)
        else:
            cp.commit_group()
            if j >= LAG:
                cp.wait_group(LAG)  # this thread's copies of block j - LAG landed
                fence_async_shared()  # ... and are visible to the async proxy (wgmma)
                gl.thread_barrier()  # ... every producer thread's
                mbarrier.arrive(full.index((j - LAG) % NUM_STAGES))
    if PUBLISH == 1:  # the last LAG blocks
        cp.wait_group(0)
        fence_async_shared()
        gl.thread_barrier()
        for k in range(gl.maximum(n_blocks - LAG, 0), n_blocks):
            mbarrier.arrive(full.index(k % NUM_STAGES))


@gluon.jit
def _q_register_part(q_smem, s_l: gl.constexpr, Q_REG_COLS: gl.constexpr):
    """q's first ``Q_REG_COLS`` columns as the scores' register operand (loaded once; 0: none, a placeholder)."""
    if Q_REG_COLS == 0:
        return 0
    else:
        return q_smem.slice(0, Q_REG_COLS, dim=1).load(gl.DotOperandLayout(operand_index=0, parent=s_l, k_width=2))


@gluon.jit
def _scores(q_smem, q_reg, e, s_zero, Q_REG_COLS: gl.constexpr):
    """S = q @ e^T as async wgmmas: q's first ``Q_REG_COLS`` columns from registers, the rest from shared memory,
    in power-of-two column slices (a wgmma operand's shared-memory slice must be one)."""
    if Q_REG_COLS == 0:
        s = warpgroup_mma(q_smem, e.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    else:
        gl.static_assert((Q_REG_COLS == 128) | (Q_REG_COLS == 256), "Q_REG_COLS: 0, 128 or 256")
        s = warpgroup_mma(q_reg, e.slice(0, Q_REG_COLS, dim=1).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        if Q_REG_COLS == 128:
            s = warpgroup_mma(q_smem.slice(128, 128, dim=1), e.slice(128, 128, dim=1).permute((1, 0)), s,
                              is_async=True)
        s = warpgroup_mma(q_smem.slice(256, 256, dim=1), e.slice(256, 256, dim=1).permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _scorer(q_row, sq_h, q_smem, ring, p_smem, alpha_smem, ml_smem, full, empty, pfull, pfree, done,
            cmp_len_row, pid_sp, scale_log2e, W, K, N_KV, N_CMP, widx_row, swi_w, cidx_row, sci_k,
            sink_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, b, pid_t, so_b, so_h,
            D: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
            NUM_SPLITS: gl.constexpr, Q_REG_COLS: gl.constexpr, STAGED_OUT: gl.constexpr):
    """Warpgroup 0: q staged, every block's scores and softmax, P handed on, its half of P @ rows, its epilogue."""
    HALF: gl.constexpr = D // 2
    lo, hi, n_blocks = _split_range(cmp_len_row, N_CMP, W, K, pid_sp, NUM_SPLITS, BLOCK_N)
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    offs_hq = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_l))
    offs_dq = gl.arange(0, D, layout=gl.SliceLayout(0, q_l))
    q_smem.store(gl.load(q_row + offs_hq[:, None] * sq_h + offs_dq[None, :]))
    fence_async_shared()  # q (plain stores) visible to wgmma (async proxy) ...
    gl.thread_barrier()  # ... every scorer thread's
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, HALF, 16])
    row_l: gl.constexpr = gl.SliceLayout(1, s_l)
    col_l: gl.constexpr = gl.SliceLayout(0, s_l)
    orow_l: gl.constexpr = gl.SliceLayout(1, o_l)

    offs_n = gl.arange(0, BLOCK_N, layout=col_l)
    v = lo + offs_n
    loaded = _load_entry_index(v, W, K, widx_row, swi_w, cidx_row, sci_k)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, row_l)
    l_i = gl.zeros([BLOCK_H], gl.float32, row_l)
    acc = warpgroup_mma_init(gl.zeros([BLOCK_H, HALF], gl.float32, o_l))
    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_l)
    q_reg = _q_register_part(q_smem, s_l, Q_REG_COLS)
    for j in range(n_blocks):
        slot = j % NUM_STAGES
        pb = j % 2
        bias = gl.where(_valid(v, _pick_entry_index(v, loaded, W, K), hi, W, N_KV, N_CMP), 0.0, float("-inf"))
        v = v + BLOCK_N
        loaded = _load_entry_index(v, W, K, widx_row, swi_w, cidx_row, sci_k)
        mbarrier.wait(full.index(slot), (j // NUM_STAGES) & 1)
        fence_async_shared()  # the cp.async writes (generic proxy) before the wgmma reads (async proxy)
        s = _scores(q_smem, q_reg, ring.index(slot), s_zero, Q_REG_COLS)
        s, acc = warpgroup_mma_wait(0, deps=[s, acc])  # (P @ rows of block j - 1 was waited for below)
        logits = s * scale_log2e + bias[None, :]
        m_new = gl.maximum(m_i, gl.max(logits, 1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(logits - m_safe[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        # the P buffer of block j - 2 must have been read by warpgroup 1 (the first round is free)
        mbarrier.wait(pfree.index(pb), ((j // 2) + 1) & 1, pred=j >= 2)
        p_smem.index(pb).store(p.to(gl.bfloat16))
        alpha_smem.index(pb).store(alpha)
        fence_async_shared()  # P visible to both warpgroups' wgmma
        gl.thread_barrier()  # every thread's P and alpha stored; this warpgroup's P @ rows of block j - 1 done
        mbarrier.arrive(pfull.index(pb))
        mbarrier.arrive(empty.index((j + NUM_STAGES - 1) % NUM_STAGES), pred=j > 0)
        acc = acc * gl.convert_layout(alpha, orow_l)[:, None]
        acc = warpgroup_mma(p_smem.index(pb), ring.index(slot).slice(0, HALF, dim=1), acc, is_async=True)
        # waited for here, not under the next block's scores: in flight across the back edge, ptxas serialised
        # every wgmma of the kernel (C7515)
        acc = warpgroup_mma_wait(0, deps=[acc])
        acc = warpgroup_mma_init(acc)
    acc = warpgroup_mma_wait(0, deps=[acc])
    ml_smem.index(0).store(m_i)
    ml_smem.index(1).store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(done.index(0))
    _epilogue(acc, gl.convert_layout(m_i, orow_l), gl.convert_layout(l_i, orow_l), sink_ptr, out_ptr, part_m_ptr,
              part_l_ptr, part_acc_ptr, b, pid_t, pid_sp, so_b, so_h, o_l, o_l, D, BLOCK_H, NUM_SPLITS, 0, True,
              q_smem.slice(0, HALF, dim=1), STAGED_OUT)  # (q is read no more)


@gluon.jit
def _helper(q_smem, ring, p_smem, alpha_smem, ml_smem, empty, pfull, pfree, done, cmp_len_row, pid_sp, N_CMP, W, K,
            sink_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, b, pid_t, so_b, so_h,
            D: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
            NUM_SPLITS: gl.constexpr, STAGED_OUT: gl.constexpr):
    """Warpgroup 1: its half of P @ rows for every block, rescaled by warpgroup 0's factors; its epilogue."""
    HALF: gl.constexpr = D // 2
    lo, hi, n_blocks = _split_range(cmp_len_row, N_CMP, W, K, pid_sp, NUM_SPLITS, BLOCK_N)
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, HALF, 16])
    orow_l: gl.constexpr = gl.SliceLayout(1, o_l)
    acc = warpgroup_mma_init(gl.zeros([BLOCK_H, HALF], gl.float32, o_l))
    for j in range(n_blocks):
        slot = j % NUM_STAGES
        pb = j % 2
        mbarrier.wait(pfull.index(pb), (j // 2) & 1)
        alpha = alpha_smem.index(pb).load(orow_l)
        acc = warpgroup_mma_wait(0, deps=[acc])  # P @ rows of block j - 1 (already waited for below)
        gl.thread_barrier()  # every helper thread past it
        mbarrier.arrive(pfree.index(1 - pb), pred=j > 0)  # block j - 1's P buffer
        mbarrier.arrive(empty.index((j + NUM_STAGES - 1) % NUM_STAGES), pred=j > 0)
        acc = acc * alpha[:, None]
        acc = warpgroup_mma(p_smem.index(pb), ring.index(slot).slice(HALF, HALF, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        acc = warpgroup_mma_init(acc)
    acc = warpgroup_mma_wait(0, deps=[acc])
    mbarrier.wait(done.index(0), 0)  # (also: the scorer reads q no more)
    m_i = ml_smem.index(0).load(orow_l)
    l_i = ml_smem.index(1).load(orow_l)
    _epilogue(acc, m_i, l_i, sink_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, b, pid_t, pid_sp, so_b, so_h,
              o_l, o_l, D, BLOCK_H, NUM_SPLITS, HALF, False, q_smem.slice(HALF, HALF, dim=1), STAGED_OUT)


@gluon.jit
def sparse_attention_gluon_ws_kernel(
    q_ptr, kv_ptr, kv_idx_ptr, cmp_ptr, cmp_idx_ptr, cmp_len_ptr, sink_ptr, out_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,
    scale_log2e,
    N_KV, N_CMP, W, K,
    sq_b, sq_h,
    skv_b, skv_n,
    swi_b, swi_w,
    sc_b, sc_n,
    sci_b, sci_k,
    scl_b,
    so_b, so_h,
    D: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    NUM_SPLITS: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, PUBLISH: gl.constexpr,
):
    gl.static_assert(gl.num_warps() == 4, "the scoring warpgroup is the default partition")
    pid_t = gl.program_id(0)
    pid_sp = gl.program_id(1)
    scale_log2e = scale_log2e.to(gl.float32)
    b = pid_t.to(gl.int64)
    HALF: gl.constexpr = D // 2

    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D], gl.bfloat16)
    e_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16)
    v_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D], q_sl)
    ring = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BLOCK_N, D], e_sl)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_H, BLOCK_N], p_sl)
    alpha_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], v_sl)
    ml_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], v_sl)
    full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    pfull = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pfree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(NUM_STAGES):
        mbarrier.init(full.index(st), count=PRODUCER_WARPS * 32 if PUBLISH == 0 else 1)
        mbarrier.init(empty.index(st), count=2)
    for st in gl.static_range(2):
        mbarrier.init(pfull.index(st), count=1)
        mbarrier.init(pfree.index(st), count=1)
    mbarrier.init(done.index(0), count=1)

    cmp_len_row = cmp_len_ptr + b * scl_b
    kv_row0 = kv_ptr + b * skv_b
    cmp_row0 = cmp_ptr + b * sc_b
    widx_row = kv_idx_ptr + b * swi_b
    cidx_row = cmp_idx_ptr + b * sci_b
    q_row = q_ptr + b * sq_b

    gl.warp_specialize([
        (_scorer, (q_row, sq_h, q_smem, ring, p_smem, alpha_smem, ml_smem, full, empty, pfull, pfree, done,
                   cmp_len_row, pid_sp, scale_log2e, W, K, N_KV, N_CMP, widx_row, swi_w, cidx_row, sci_k,
                   sink_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, b, pid_t, so_b, so_h,
                   D, BLOCK_H, BLOCK_N, NUM_STAGES, NUM_SPLITS, Q_REG_COLS, STAGED_OUT)),
        (_helper, (q_smem, ring, p_smem, alpha_smem, ml_smem, empty, pfull, pfree, done, cmp_len_row, pid_sp, N_CMP, W, K,
                   sink_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, b, pid_t, so_b, so_h,
                   D, BLOCK_H, BLOCK_N, NUM_STAGES, NUM_SPLITS, STAGED_OUT)),
        (_producer, (ring, full, empty, cmp_len_row, pid_sp, W, K, N_KV, N_CMP, kv_row0, skv_n, cmp_row0, sc_n,
                     widx_row, swi_w, cidx_row, sci_k, D, BLOCK_N, NUM_STAGES, PUBLISH, NUM_SPLITS)),
    ], [4, PRODUCER_WARPS], [HELPER_REGS, PRODUCER_REGS])
