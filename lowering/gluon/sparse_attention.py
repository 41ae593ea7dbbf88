"""Gluon decode sparse attention (sm_90, bf16, H = 64, D = 512, S = 1).

What ``dsv4::sparse_attention`` runs for bf16 decode at V4's widths on an sm_90 GPU (routed by
``dsv4_ops/ops/attention_sm90.py``): CSA 32K at B=64 34.2 us and B=128 46.9 (``ws``) against the tl
kernel's 46.9 and 74.8 (H200, session 20; BENCHMARKS.md).

Same contract and launch split as ``lowering.triton.sparse_attention`` (one program per token
and split, the virtual entry list window | picked | dense prefix, sink folded at the end, the
fp32 partials merged by its ``combine_kernel``). What differs is what ``tl`` cannot say:

- The scores ``q[64, 512] @ rows[BLOCK_N, 512]^T`` use an MMA layout with warps ``[4, 2]``, so
  each of the two warpgroups computes its own ``BLOCK_N / 2`` columns. Triton's ``tl.dot``
  gives a dot that feeds another dot warps ``[8, 1]``: both warpgroups computed the same
  scores, re-reading q from shared memory twice as often (BENCHMARKS.md, design notes).
- (v0) q is staged once in shared memory (the wgmma A operand); rows are gathered by ``cp.async``
  into a ring of ``NUM_STAGES`` swizzled buffers that both dots read in place (``E^T`` for the
  scores is a permuted view). Masked lanes are zero-filled by cp.async (src-size 0).
- P goes through a small shared buffer to ``acc[64, 512] += P @ rows``; each warpgroup owns
  256 output columns (128 fp32 registers a thread).
- Few CTA barriers a block (3 in the PTX, one of them Triton's after the cp.async wait; a
  plain row max and row sum across the warpgroups cost 2 each): the row max is exchanged as
  per-warpgroup maxima through shared memory, the row sum is kept per score column and
  reduced once at the end, and P @ rows stays in flight until the next block's scores.

Ordering: cp.async writes and plain shared stores are generic-proxy writes that wgmma (async
proxy) reads, hence ``fence_async_shared`` by the writing threads and then a CTA barrier
before a wgmma reads them. Checked on the H200 (session 12: errors equal to the tl kernel's).

Variants (``variant=`` of the launchers, ``VARIANTS``; the default, ``DEFAULT_VARIANT``, is ``ws``
since session 20):

- ``v0``: the kernel above (``sparse_attention_gluon_kernel``, 8 warps).
- ``v3`` (the default of sessions 13-19; v0's kernel with ``PREFETCH_EARLY``): the ring refill is
  issued at the top of an iteration instead of after the scores and the row-max barrier, and
  waited for once P @ rows is in flight (a third barrier a block frees the slot), so a block's
  copy runs under the previous block's scores, softmax and P @ rows. H200 (session 13), CSA 32K:
  B=64 32.9 against 36.8 us, B=128 53.3 against 57.9; a 4K dense prefix at B=64: 222.6 against 260.7.
- ``ws`` (``sparse_attention_ws.py``, the default): the gathers in a 4-warp producer partition
  (``gl.warp_specialize``, mbarriers), 32-row blocks x 4 stages; until session 24 v0's compute in
  8 consumer warps, since then one 4-warp partition scoring each block whole and a second sharing
  P @ rows (its own ``NUM_WARPS`` = 4). H200 (session 20, the public op), CSA 32K: B=128 46.9
  against v3's 54.5 us, B=96 45.7 against 51.9, B=64 34.2 against 33.9, B=4-32 within 0.3 us of
  v3 or faster; session 24: B=128 42.0, B=64 30.2 (its module docstring).
- Measured on the H200 and removed (BENCHMARKS.md, sessions 12-13; the code is in git history
  before session 13's cleanup): q in registers with FlashMLA's split of D over two
  warp-specialised warpgroups (no faster), the next block's scores issued under this block's
  softmax (slower), and q copied by cp.async with block 0 (no faster).

Diagnostics (v0 and v3; ``gluon_launch(..., diag=dict(no_gather=True))``, ``DIAG``), for timing by
difference on the GPU (``benchmarks/gluon_attention_check.py --diagnose``); results are wrong:
``no_gather`` no row copies after the prologue (blocks reuse the slots already loaded; index
loads and bias stores stay), ``no_pv`` no P @ rows (P still stored), ``no_softmax`` P = the
scaled scores (no exp2, no max exchange; Triton's membar pass puts a CTA barrier where B1 was,
for the bias ring), ``no_index`` contiguous rows of each segment instead of kv_idx / cmp_idx
(no index loads; no -1 holes, so ~10% more rows), ``max_blocks=N`` at most N blocks a program
(0: launch, prologue and epilogue). Off, the PTX is identical to the kernel without them.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma, warpgroup_mma_init,
                                                             warpgroup_mma_wait)

from ..triton._launch import sm_count
from ..triton.sparse_attention import _LOG2E, attention_config, combine_kernel

__all__ = ["sparse_attention_gluon", "sparse_attention_gluon_kernel",
           "gluon_launch", "gluon_config", "NUM_WARPS", "VARIANTS", "DIAG", "DIAG_VARIANTS"]

NUM_WARPS = 8  # two warpgroups: the layouts below assume it
BLOCK_H, HEAD_DIM = 64, 512


@gluon.jit
def _entry_index(v, W, K, widx_row, swi_w, cidx_row, sci_k):
    """Row index of virtual entries ``v``: window (kv_idx), picked (cmp_idx), dense prefix."""
    in_w = v < W
    in_k = (v >= W) & (v < W + K)
    wi = gl.load(widx_row + v * swi_w, mask=in_w, other=-1)
    ci = gl.load(cidx_row + (v - W) * sci_k, mask=in_k, other=-1)
    return gl.where(in_w, wi, gl.where(in_k, ci, v - W - K))


@gluon.jit
def _load_entry_index(v, W, K, widx_row, swi_w, cidx_row, sci_k):
    """The load half of ``_entry_index``: one load a lane (kv_idx or cmp_idx; -1 in the dense
    prefix), picked by ``_pick_entry_index``. The warp-specialised kernels issue the loads a block
    ahead and pick once the next block comes round: a ``where`` right behind the loads would wait
    out their latency there (H200, session 22: 21% of the FP8 decoder's stall samples)."""
    in_w = v < W
    listed = v < W + K
    ptr = gl.where(in_w, widx_row + v * swi_w, cidx_row + (v - W) * sci_k)
    return gl.load(ptr, mask=listed, other=-1)


@gluon.jit
def _pick_entry_index(v, loaded, W, K):
    """``_entry_index`` from its loads (``_load_entry_index``): the listed index, or the dense prefix's row."""
    return gl.where(v < W + K, loaded, v - W - K)


@gluon.jit
def _index(v, W, K, widx_row, swi_w, cidx_row, sci_k, NO_INDEX: gl.constexpr):
    """``_entry_index``, or (diagnostics, ``NO_INDEX``) contiguous rows of each segment with no
    index load: every entry valid, the rows' bytes the same, only the index latency gone."""
    if NO_INDEX:
        idx = gl.where(v < W, v, gl.where(v < W + K, v - W, v - W - K))
    else:
        idx = _entry_index(v, W, K, widx_row, swi_w, cidx_row, sci_k)
    return idx


@gluon.jit
def _issue_rows(buf, bias_buf, v, idx, hi, W, N_KV, N_CMP, kv_row0, skv_n, cmp_row0, sc_n, offs_d,
                NO_COPY: gl.constexpr = False):
    """cp.async the rows of entries ``v`` into ``buf`` (invalid lanes: zeros, no memory read)
    and store their score bias (0 or -inf) into ``bias_buf``. ``NO_COPY`` (diagnostics only):
    the bias store stays (it keeps the index loads alive), the copy goes."""
    in_w = v < W
    valid = (v < hi) & (idx >= 0) & (idx < gl.where(in_w, N_KV, N_CMP))
    idx64 = gl.where(valid, idx, 0).to(gl.int64)
    row = gl.where(in_w, kv_row0 + idx64 * skv_n, cmp_row0 + idx64 * sc_n)
    if not NO_COPY:
        cp.async_copy_global_to_shared(buf, row[:, None] + offs_d[None, :], mask=valid[:, None])
    bias_buf.store(gl.where(valid, 0.0, float("-inf")))


@gluon.jit
def _refill(ring, bias_ring, slot, v, idx, hi, W, K, N_KV, N_CMP, kv_row0, skv_n, cmp_row0, sc_n, offs_d,
            widx_row, swi_w, cidx_row, sci_k, BLOCK_N: gl.constexpr, NO_COPY: gl.constexpr, NO_INDEX: gl.constexpr):
    """Issue entries ``v`` (rows ``idx``) into ring ``slot`` as one cp.async group; the next
    block's entries and their row indices (the index loads left in flight)."""
    _issue_rows(ring.index(slot), bias_ring.index(slot), v, idx, hi, W, N_KV, N_CMP,
                kv_row0, skv_n, cmp_row0, sc_n, offs_d, NO_COPY)
    cp.commit_group()
    v = v + BLOCK_N
    return v, _index(v, W, K, widx_row, swi_w, cidx_row, sci_k, NO_INDEX)


@gluon.jit
def _split_range(cmp_len_row, N_CMP, W, K, pid_sp, NUM_SPLITS: gl.constexpr, BLOCK_N: gl.constexpr):
    """Entries ``[lo, hi)`` of split ``pid_sp`` of the query's virtual list (window, picks, a dense
    prefix of ``cmp_len`` pool rows, clamped to the pool) and its number of ``BLOCK_N`` blocks:
    splits of whole blocks, the last ones possibly empty."""
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
def _online_softmax(logits, m_i, m_blk, l_i):
    """One block of the online softmax (base 2): P, the rescale of what came before, the
    running row sum (kept per score column) and the running max (``m_blk`` this block's)."""
    m_new = gl.maximum(m_i, m_blk)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(logits - m_safe[:, None])
    return p, alpha, l_i * alpha[:, None] + p, m_new


@gluon.jit
def _epilogue(acc, m_i, l_i, sink_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, b, pid_t, pid_sp, so_b, so_h,
              s_l: gl.constexpr, o_l: gl.constexpr, D: gl.constexpr, BLOCK_H: gl.constexpr,
              NUM_SPLITS: gl.constexpr, COL0: gl.constexpr = 0, STATS: gl.constexpr = True, stage=0,
              STAGED: gl.constexpr = False):
    """One split: the sink folded in and the output stored; several: this split's fp32 partials
    (max, sum, acc) for ``combine_kernel``. ``acc`` holds output columns ``COL0 ...`` (a warpgroup
    that owns a slice of D: the ``ws`` kernel's); ``STATS``: this caller stores the split's max and
    sum (one of the warpgroups that hold the same ones). ``STAGED`` (one split): the output goes
    through ``stage`` (shared memory of ``acc``'s shape and the output's dtype that nothing reads any
    more), so that each warp stores whole rows, 16 bytes a thread. From the accumulator's layout each
    store instruction writes 4 bytes a thread, 16-byte pieces of 8 rows: that store took ~8 of the ws
    kernel's ~11.6 us fixed cost at 128 programs (session 25, BENCHMARKS.md). The fp32 partials of
    several splits, 8 bytes a thread and whole 32-byte sectors, gained nothing staged."""
    offs_h = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_l))
    offs_o = COL0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, o_l))
    offs_hs = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_l))
    if NUM_SPLITS == 1:
        sink = gl.load(sink_ptr + offs_hs).to(gl.float32) * 1.4426950408889634
        m_f = gl.maximum(m_i, sink)
        alpha = gl.exp2(m_i - m_f)
        denom = l_i * alpha + gl.exp2(sink - m_f)
        o = acc * gl.convert_layout(alpha / denom, gl.SliceLayout(1, o_l))[:, None]
        if STAGED:
            stage.store(o.to(out_ptr.dtype.element_ty))
            gl.thread_barrier()  # every thread's part staged
            rows_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
            offs_hr = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, rows_l))
            offs_or = COL0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, rows_l))
            gl.store(out_ptr + b * so_b + offs_hr[:, None] * so_h + offs_or[None, :], stage.load(rows_l))
        else:
            gl.store(out_ptr + b * so_b + offs_h[:, None] * so_h + offs_o[None, :], o.to(out_ptr.dtype.element_ty))
    else:
        row = (pid_t * NUM_SPLITS + pid_sp).to(gl.int64) * BLOCK_H
        if STATS:
            gl.store(part_m_ptr + row + offs_hs, m_i)
            gl.store(part_l_ptr + row + offs_hs, l_i)
        gl.store(part_acc_ptr + (row + offs_h)[:, None] * D + offs_o[None, :], acc)


@gluon.jit
def sparse_attention_gluon_kernel(
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
    NUM_SPLITS: gl.constexpr,
    DIAG_NO_GATHER: gl.constexpr = False, DIAG_NO_PV: gl.constexpr = False, DIAG_NO_SOFTMAX: gl.constexpr = False,
    DIAG_NO_INDEX: gl.constexpr = False, DIAG_MAX_BLOCKS: gl.constexpr = -1,
    PREFETCH_EARLY: gl.constexpr = False,
):
    """``PREFETCH_EARLY`` (variant v3): the refill of the ring is issued at the top of an
    iteration, not after the scores and the row-max barrier; P @ rows is then waited for in its
    own iteration (a third barrier frees its slot), so block j + 1's copy runs under block j's
    scores, softmax and P @ rows instead of its softmax only.

    The DIAG_* switches (``gluon_launch(diag=...)``, module docstring) each remove one stage
    for timing by difference; results are then wrong. Off (the defaults), the PTX is the same
    as without them."""
    gl.static_assert(gl.num_warps() == 8, "two warpgroups")
    gl.static_assert(NUM_STAGES >= 2)
    pid_t = gl.program_id(0)  # query token b (S = 1)
    pid_sp = gl.program_id(1)  # split of the entry list
    scale_log2e = scale_log2e.to(gl.float32)
    b = pid_t.to(gl.int64)

    # gathers: a warp reads 512 contiguous bytes of a row, 16 B (one cp.async) per thread
    gather_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, gather_l)
    cols_l: gl.constexpr = gl.SliceLayout(0, gather_l)
    # scores: warpgroup w computes columns [w * BLOCK_N / 2, (w + 1) * BLOCK_N / 2)
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_N // 2, 16])
    # output: warpgroup w owns channels [w * D / 2, (w + 1) * D / 2)
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, D // 2, 16])
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D], gl.bfloat16)
    e_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16)
    red_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    # the score rows: 16 a warp (rows 16 w .. of warp w of each warpgroup), 8 a lane quad, 2
    # registers a thread (r, r + 8); the same in both warpgroups (wgmma's accumulator layout)
    row_l: gl.constexpr = gl.SliceLayout(1, s_l)
    # [BLOCK_H, 2] per-warpgroup maxima, both in every thread that holds the row: reducing
    # axis 1 is then thread-local and lands in row_l
    pair_l: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [8, 0]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0], [0, 0]], block_bases=[], shape=[BLOCK_H, 2])
    bias_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])

    offs_d = gl.arange(0, D, layout=cols_l)
    offs_hq = gl.arange(0, BLOCK_H, layout=rows_l)
    q = gl.load(q_ptr + b * sq_b + offs_hq[:, None] * sq_h + offs_d[None, :])
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D], q_sl, q)
    ring = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BLOCK_N, D], e_sl)
    bias_ring = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_N], bias_sl)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], p_sl)
    red_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H, 2], red_sl)

    lo, hi, n_blocks = _split_range(cmp_len_ptr + b * scl_b, N_CMP, W, K, pid_sp, NUM_SPLITS, BLOCK_N)
    if DIAG_MAX_BLOCKS >= 0:  # the program's fixed cost (0) and one block's (1 - 0)
        n_blocks = gl.minimum(n_blocks, DIAG_MAX_BLOCKS)

    kv_row0 = kv_ptr + b * skv_b
    cmp_row0 = cmp_ptr + b * sc_b
    widx_row = kv_idx_ptr + b * swi_b
    cidx_row = cmp_idx_ptr + b * sci_b

    # prologue: NUM_STAGES - 1 blocks in flight (blocks past hi are all-masked: no traffic)
    v = lo + gl.arange(0, BLOCK_N, layout=rows_l)
    idx = _index(v, W, K, widx_row, swi_w, cidx_row, sci_k, DIAG_NO_INDEX)
    for st in gl.static_range(NUM_STAGES - 1):
        _issue_rows(ring.index(st), bias_ring.index(st), v, idx, hi, W, N_KV, N_CMP,
                    kv_row0, skv_n, cmp_row0, sc_n, offs_d)
        cp.commit_group()
        v = v + BLOCK_N
        idx = _index(v, W, K, widx_row, swi_w, cidx_row, sci_k, DIAG_NO_INDEX)
    cp.wait_group(NUM_STAGES - 2)  # this thread's copies of block 0 landed
    fence_async_shared()  # ... and are visible to wgmma (async proxy)
    gl.thread_barrier()  # ... every thread's

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, row_l)
    # l per score column, summed once at the end: a row sum per block would cross the
    # warpgroups (two more barriers a block); alpha is the same for every column of a row
    l_i = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_l)
    # P @ rows is left in flight into the next block: it then runs back to back with that
    # block's scores wgmma, both waited for together
    acc = warpgroup_mma_init(gl.zeros([BLOCK_H, D], gl.float32, o_l))
    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_l)
    # Two barriers a block. B1 (row max exchange): every warpgroup has waited for block j - 1's
    # P @ rows, so its ring slot may be refilled and P rewritten. B2 (P written): also
    # publishes block j + 1's rows, waited for and fenced by each thread just before.
    for j in range(n_blocks):
        slot = j % NUM_STAGES
        e = ring.index(slot)
        if PREFETCH_EARLY:  # the slot of block j - 1 is free: its P @ rows was waited for before B3
            v, idx = _refill(ring, bias_ring, (j + NUM_STAGES - 1) % NUM_STAGES, v, idx, hi, W, K, N_KV, N_CMP,
                             kv_row0, skv_n, cmp_row0, sc_n, offs_d, widx_row, swi_w, cidx_row, sci_k, BLOCK_N,
                             DIAG_NO_GATHER, DIAG_NO_INDEX)
        s = warpgroup_mma(q_smem, e.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        bias = bias_ring.index(slot).load(gl.SliceLayout(0, s_l))
        s, acc = warpgroup_mma_wait(0, deps=[s, acc])
        logits = s * scale_log2e + bias[None, :]
        if not DIAG_NO_SOFTMAX:
            # row max of this warpgroup's columns ([BLOCK_H, 2]: axis 1 is the warpgroup, so the
            # reduction stays within warps), exchanged through shared memory
            m_wg = gl.max(gl.reshape(logits, [BLOCK_H, 2, BLOCK_N // 2]), 2)
            red_smem.store(m_wg)
            gl.thread_barrier()  # B1
            m_blk = gl.convert_layout(gl.max(red_smem.load(pair_l), 1), row_l, assert_trivial=True)
        if not PREFETCH_EARLY:  # refill the slot of block j - 1 with block j + NUM_STAGES - 1
            v, idx = _refill(ring, bias_ring, (j + NUM_STAGES - 1) % NUM_STAGES, v, idx, hi, W, K, N_KV, N_CMP,
                             kv_row0, skv_n, cmp_row0, sc_n, offs_d, widx_row, swi_w, cidx_row, sci_k, BLOCK_N,
                             DIAG_NO_GATHER, DIAG_NO_INDEX)

        if DIAG_NO_SOFTMAX:  # P = the scores as they are; no max, no exp2, no rescale
            p = logits
            l_i = l_i + p
        else:
            p, alpha, l_i, m_i = _online_softmax(logits, m_i, m_blk, l_i)
        p_smem.store(p.to(gl.bfloat16))
        if PREFETCH_EARLY:
            fence_async_shared()  # P visible to wgmma
            gl.thread_barrier()  # B2
        else:
            cp.wait_group(NUM_STAGES - 2)  # this thread's copies of block j + 1 landed
            fence_async_shared()  # P and those rows visible to wgmma
            gl.thread_barrier()  # B2
        if not DIAG_NO_SOFTMAX:
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l), assert_trivial=True)[:, None]
        if DIAG_NO_PV:  # P stays stored (unread); the accumulator only rescaled
            acc = warpgroup_mma_init(acc)
        else:
            acc = warpgroup_mma(p_smem, e, acc, is_async=True)
        if PREFETCH_EARLY:
            cp.wait_group(NUM_STAGES - 2)  # this thread's copies of block j + 1 landed (under P @ rows)
            acc = warpgroup_mma_init(warpgroup_mma_wait(0, deps=[acc]))  # slot j and P read
            fence_async_shared()  # block j + 1's rows visible to wgmma
            gl.thread_barrier()  # B3: ... every thread's; slot j may be refilled
    acc = warpgroup_mma_wait(0, deps=[acc])
    cp.wait_group(0)  # no copy may outlive the program's shared memory
    _epilogue(acc, m_i, gl.sum(l_i, 1), sink_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, b, pid_t, pid_sp,
              so_b, so_h, s_l, o_l, D, BLOCK_H, NUM_SPLITS)


# diag key -> (constexpr of the v0 kernel, its off value); module docstring: what each removes
DIAG = {
    "no_gather": ("DIAG_NO_GATHER", False),
    "no_pv": ("DIAG_NO_PV", False),
    "no_softmax": ("DIAG_NO_SOFTMAX", False),
    "no_index": ("DIAG_NO_INDEX", False),
    "max_blocks": ("DIAG_MAX_BLOCKS", -1),
}
# variant -> the constexprs it launches the kernel with (module docstring: what each one changes).
# v0 and v3 run NUM_WARPS warps at DEFAULT_BLOCKS unless told, take the DIAG switches and need 2 stages;
# ws (sparse_attention_ws.py, its own kernel, warps and constexprs) runs at DEFAULT_BLOCKS_WS and takes no DIAG.
VARIANTS = {"v0": dict(PREFETCH_EARLY=False), "v3": dict(PREFETCH_EARLY=True), "ws": dict()}
DIAG_VARIANTS = ("v0", "v3")  # the variants that take the DIAG switches
# what the public op runs (dsv4_ops/ops/attention_sm90.py): ws, within 0.3 us of v3 or faster from batch 1 to 128
# (CSA 32K at B = 128: 46.9 against 54.5 us; B = 64: 34.2 against 33.9; BENCHMARKS.md, session 20)
DEFAULT_VARIANT = "ws"
# (BLOCK_N, NUM_STAGES) unless told: the H200 sweeps' best for both (sessions 12-13)
DEFAULT_BLOCKS = (64, 2)
# ws: 32-row blocks x 4 stages, three blocks in flight under the one computed (H200, session 19)
DEFAULT_BLOCKS_WS = (32, 4)
# combine_kernel at 2+ splits: (heads, columns) a program and its warps; 1024 programs at B=64 (``combine_launch``).
# H200, session 26 (``benchmarks/ws_ab.py --combine``): eight other tiles / warps from 8 x 128 x 2 to 64 x 128 x 4 and
# 16 x 512 x 8 all within -0.2 / +0.8 us of it at both B=64 cases, outputs identical: its cost is not in its tile
COMBINE_TILE = (16, 128)
COMBINE_WARPS = 4


def gluon_config(B: int, max_entries: int, sms: int = 132, num_splits: int | None = None,
                 block_n: int | None = None, num_stages: int | None = None, variant: str = DEFAULT_VARIANT) -> dict:
    """Block rows, ring depth and splits: the tl kernel's split rule at the same sizes; the kernel,
    its warps and constexprs (``variant``: a key of ``VARIANTS``, returned as ``variant``).

    v0 / v3: 64-row blocks x 2 stages (3 stages need 271,616 B of shared memory), the fastest
    config of the H200 sweep at B = 64 and 128 (CSA 32K: 36.6 and 57.7 us against 39.5 and 58.4 at
    32 x 4; a 4K-entry dense prefix: 261 against 305 us; BENCHMARKS.md, session 12). ws: 32 x 4
    (session 19)."""
    if variant not in VARIANTS:
        raise ValueError(f"sparse_attention_gluon: variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    cfg = attention_config(B, 1, BLOCK_H, HEAD_DIM, max_entries, sms, num_splits)
    if variant == "ws":  # the warp-specialised kernel's module may name its own (an A/B candidate does)
        from . import sparse_attention_ws as ws  # noqa: PLC0415 (it imports this module's helpers)
        default_blocks = getattr(ws, "BLOCKS", DEFAULT_BLOCKS_WS)
    else:
        default_blocks = DEFAULT_BLOCKS
    block_n = default_blocks[0] if block_n is None else block_n
    num_stages = default_blocks[1] if num_stages is None else num_stages
    if num_stages < 2:
        raise ValueError(f"sparse_attention_gluon: num_stages must be >= 2 (a slot computed, one filled), got {num_stages}")
    common = dict(BLOCK_N=block_n, NUM_STAGES=num_stages, NUM_SPLITS=cfg["NUM_SPLITS"], num_warps=NUM_WARPS,
                  variant=variant)
    if variant == "ws":  # the warp-specialised kernel (sparse_attention_ws.py, imported above): its own constexprs
        return dict(common, kernel=ws.sparse_attention_gluon_ws_kernel, num_warps=getattr(ws, "NUM_WARPS", NUM_WARPS),
                    extra=dict(PRODUCER_WARPS=ws.PRODUCER_WARPS, PRODUCER_REGS=ws.PRODUCER_REGS,
                               PUBLISH=ws.PUBLISH))
    return dict(common, kernel=sparse_attention_gluon_kernel, extra=dict(VARIANTS[variant]))


def _check(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink):
    """ValueError naming the argument outside the one case this kernel serves."""
    if q.dim() != 4:
        raise ValueError(f"sparse_attention_gluon: q must be [B, S, H, D], got {tuple(q.shape)}")
    B, S, H, D = q.shape
    for name, t in (("q", q), ("kv", kv), ("cmp", cmp)):
        if t.dtype != torch.bfloat16:
            raise ValueError(f"sparse_attention_gluon: {name} must be bf16, got {t.dtype}")
        if t.dim() != (4 if name == "q" else 3):
            raise ValueError(f"sparse_attention_gluon: {name} has {t.dim()} dims (FP8 paged caches unsupported)")
    if H != BLOCK_H:
        raise ValueError(f"sparse_attention_gluon: H (q.shape[2]) must be {BLOCK_H}, got {H}")
    if D != HEAD_DIM or kv.shape[-1] != D or cmp.shape[-1] != D:
        raise ValueError(f"sparse_attention_gluon: D must be {HEAD_DIM}, got q {D}, kv {kv.shape[-1]}, cmp {cmp.shape[-1]}")
    if S != 1:
        raise ValueError(f"sparse_attention_gluon: S (q.shape[1]) must be 1 (decode), got {S}")
    for name, t in (("kv_idx", kv_idx), ("cmp_idx", cmp_idx), ("cmp_len", cmp_len)):
        if t.dtype != torch.int32:
            raise ValueError(f"sparse_attention_gluon: {name} must be int32, got {t.dtype}")
    if sink.numel() != H:
        raise ValueError(f"sparse_attention_gluon: sink must have {H} entries, got {sink.numel()}")


def _lastdim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _diag_meta(diag: dict | None) -> dict:
    """The DIAG_* constexprs of ``diag`` (keys of ``DIAG``), every one of them (off unless given)."""
    diag = dict(diag or {})
    unknown = sorted(set(diag) - set(DIAG))
    if unknown:
        raise ValueError(f"sparse_attention_gluon: unknown diag switches {unknown}; known: {sorted(DIAG)}")
    meta = {name: default for name, default in DIAG.values()}
    for key, value in diag.items():
        name, default = DIAG[key]
        meta[name] = int(value) if isinstance(default, int) and not isinstance(default, bool) else bool(value)
    return meta


def gluon_launch(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale, num_splits=None, block_n=None, num_stages=None,
                 out=None, variant=DEFAULT_VARIANT, *, diag=None):
    """(out, [(kernel, grid, args, meta), ...]) of one call: the attention and, when split,
    ``combine_kernel``; the cross-compile test compiles these without a GPU. ``diag``: timing
    switches (``DIAG``; v0 and v3), e.g. ``dict(no_gather=True)``: the result is then wrong."""
    _check(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink)
    diag_meta = _diag_meta(diag)
    B, _, H, D = q.shape
    q, kv, cmp = (_lastdim_contiguous(t) for t in (q, kv, cmp))
    sink = sink.contiguous()
    W, K = kv_idx.shape[-1], cmp_idx.shape[-1]
    n_kv, n_cmp = kv.shape[1], cmp.shape[1]
    if n_kv == 0 and n_cmp == 0:
        raise ValueError("sparse_attention_gluon: kv and cmp are both empty (no rows to attend to)")
    # an empty segment is never dereferenced (every lane masked) but needs a valid pointer; its
    # length (W, K, N_KV or N_CMP = 0) is what the kernel reads: the tl launcher's substitutes
    if n_kv == 0 or W == 0:
        kv = cmp
    if n_cmp == 0:
        cmp = kv
    if W == 0:
        kv_idx = cmp_len[..., None]
    if K == 0:
        cmp_idx = cmp_len[..., None]
    # the entries the split rule plans for: the tl launcher's (window + picked, or the whole pool)
    cfg = gluon_config(B, W + (K if K else n_cmp), sm_count(q.device), num_splits, block_n, num_stages,
                       variant)
    splits = cfg["NUM_SPLITS"]
    if cfg["variant"] not in DIAG_VARIANTS:  # ws: no DIAG constexprs
        if diag:
            raise ValueError(f"sparse_attention_gluon: the diag switches are for variants {DIAG_VARIANTS}, "
                             f"not {cfg['variant']}")
        diag_meta = {}
    if out is None:
        out = torch.empty_like(q)
    if splits > 1:
        part_m = torch.empty((B, splits, H), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((B, splits, H, D), dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused
    if out.stride(-1) != 1:
        raise ValueError("sparse_attention_gluon: out must be contiguous in its last dim")
    args = (q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, out, part_m, part_l, part_acc, float(scale) * _LOG2E,
            n_kv if W else 0, n_cmp, W, K,
            q.stride(0), q.stride(2), kv.stride(0), kv.stride(1), kv_idx.stride(0), kv_idx.stride(2),
            cmp.stride(0), cmp.stride(1), cmp_idx.stride(0), cmp_idx.stride(2), cmp_len.stride(0),
            out.stride(0), out.stride(2))
    meta = dict(D=D, BLOCK_H=BLOCK_H, BLOCK_N=cfg["BLOCK_N"], NUM_STAGES=cfg["NUM_STAGES"], NUM_SPLITS=splits,
                **diag_meta, **cfg["extra"], num_warps=cfg["num_warps"])
    launches = [(cfg["kernel"], (B, splits), args, meta)]
    if splits > 1:
        launches.append(combine_launch(part_m, part_l, part_acc, sink, out))
    return out, launches


def combine_launch(part_m, part_l, part_acc, sink, out):
    """``(combine_kernel, grid, args, meta)``: the split partials ``[B, splits, H(, D)]`` of a decode call merged
    into ``out`` ``[B, 1, H, D]``, one program a ``COMBINE_TILE`` (heads x columns) of a token, ``COMBINE_WARPS``
    warps (both Gluon readers' launchers)."""
    B, splits, H, D = part_acc.shape
    block_h, block_d = COMBINE_TILE
    return (combine_kernel, (B, H // block_h, D // block_d), (part_m, part_l, part_acc, sink, out, 1, H, *out.stride()),
            dict(D=D, BLOCK_D=block_d, BLOCK_H=block_h, NUM_SPLITS=splits, num_warps=COMBINE_WARPS))


def sparse_attention_gluon(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale, num_splits=None, *,
                           block_n=None, num_stages=None, out=None, variant=DEFAULT_VARIANT, diag=None) -> torch.Tensor:
    """``lowering.triton.sparse_attention.sparse_attention`` for bf16 decode at V4-Flash widths
    (H = 64, D = 512, S = 1, float caches); ValueError for anything else. ``diag``: see
    ``gluon_launch`` (timing only: wrong results)."""
    out, launches = gluon_launch(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale, num_splits, block_n,
                                 num_stages, out, variant, diag=diag)
    for kernel, grid, args, meta in launches:
        kernel[grid](*args, **meta)
    return out
