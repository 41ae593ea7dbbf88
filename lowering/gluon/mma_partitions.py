"""The two MMA warpgroups of both warp-specialised decode kernels (``sparse_attention.py`` feeds them bf16 rows
gathered by a producer partition, ``sparse_attention_fp8.py`` rows decoded from FP8 pages by a decoder partition).

Both read a ring of bf16 row blocks ``[BLOCK_N, D]`` published on its slots' ``full`` mbarriers and free a slot on
its ``empty`` mbarrier once both have read it (two arrivals). The *scorer* (the default partition) stages q and
scores every block whole, so q is read from shared memory once a block; splitting a block's scores over both
warpgroups made each read all of q and bound the loop by shared-memory bandwidth. It runs the online softmax and
hands P and the rescale factors to the *helper* through a two-deep shared buffer (``pfull`` / ``pfree``). Each
warpgroup owns half of the output columns: its half of ``P @ rows`` and its epilogue. Each waits for its
``P @ rows`` right after issuing it: left in flight across the loop's back edge, ptxas serialised every wgmma of the
kernel (C7515).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                             warpgroup_mma_init, warpgroup_mma_wait)

from .common import epilogue, load_entry_index, pick_entry_index, split_range, valid_entries

__all__ = ["mma_buffers", "scorer", "helper"]


@gluon.jit
def mma_buffers(BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, FULL_ARRIVALS: gl.constexpr):
    """What the two warpgroups share, allocated after q and the ring (so in each kernel's order) and initialised:
    the scorer -> helper hand-off (P and the rescale factors two deep, the final row stats), the ring's ``full``
    (``FULL_ARRIVALS`` publish a slot) and ``empty`` mbarriers, and the hand-off's ``pfull`` / ``pfree`` / ``done``."""
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16)
    v_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_H, BLOCK_N], p_sl)
    alpha_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], v_sl)
    ml_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], v_sl)
    full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    pfull = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pfree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(NUM_STAGES):
        mbarrier.init(full.index(st), count=FULL_ARRIVALS)
        mbarrier.init(empty.index(st), count=2)  # the scorer's and the helper's P @ rows done
    for st in gl.static_range(2):
        mbarrier.init(pfull.index(st), count=1)
        mbarrier.init(pfree.index(st), count=1)
    mbarrier.init(done.index(0), count=1)
    return p_smem, alpha_smem, ml_smem, full, empty, pfull, pfree, done


@gluon.jit
def scorer(q_row, sq_h, q_smem, ring, p_smem, alpha_smem, ml_smem, full, empty, pfull, pfree, done,
           cmp_len_row, pid_sp, scale_log2e, W, K, L, N_KV, N_CMP, widx_row, swi_w, cidx_row, sci_k,
           sink_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, b, pid_t, so_b, so_h,
           D: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
           NUM_SPLITS: gl.constexpr):
    """Warpgroup 0: q staged, every block's scores and softmax, P handed on, its half of P @ rows, its epilogue.
    The score bias (0 / -inf) comes from the same indices as the copies' masks (``valid_entries``), so no store of
    the row producers has to be ordered against their asynchronous arrivals."""
    HALF: gl.constexpr = D // 2
    lo, hi, n_blocks = split_range(cmp_len_row, N_CMP, W, K, pid_sp, NUM_SPLITS, BLOCK_N)
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
    loaded = load_entry_index(v, W, L, widx_row, swi_w, cidx_row, sci_k)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, row_l)
    l_i = gl.zeros([BLOCK_H], gl.float32, row_l)
    acc = warpgroup_mma_init(gl.zeros([BLOCK_H, HALF], gl.float32, o_l))
    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_l)
    for j in range(n_blocks):
        slot = j % NUM_STAGES
        pb = j % 2
        bias = gl.where(valid_entries(v, pick_entry_index(v, loaded, W, K, L), hi, W, N_KV, N_CMP), 0.0, float("-inf"))
        v = v + BLOCK_N
        loaded = load_entry_index(v, W, L, widx_row, swi_w, cidx_row, sci_k)
        mbarrier.wait(full.index(slot), (j // NUM_STAGES) & 1)
        fence_async_shared()  # the rows' writes (generic proxy) before the wgmma reads (async proxy)
        s = warpgroup_mma(q_smem, ring.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
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
        acc = warpgroup_mma_wait(0, deps=[acc])  # here, not under the next block's scores (module docstring)
        acc = warpgroup_mma_init(acc)
    acc = warpgroup_mma_wait(0, deps=[acc])
    ml_smem.index(0).store(m_i)
    ml_smem.index(1).store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(done.index(0))
    epilogue(acc, gl.convert_layout(m_i, orow_l), gl.convert_layout(l_i, orow_l), sink_ptr, out_ptr, part_m_ptr,
             part_l_ptr, part_acc_ptr, b, pid_t, pid_sp, so_b, so_h, o_l, D, BLOCK_H, NUM_SPLITS, 0, True,
             q_smem.slice(0, HALF, dim=1))  # (q is read no more)


@gluon.jit
def helper(q_smem, ring, p_smem, alpha_smem, ml_smem, empty, pfull, pfree, done, cmp_len_row, pid_sp, N_CMP, W, K,
           sink_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, b, pid_t, so_b, so_h,
           D: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
           NUM_SPLITS: gl.constexpr):
    """Warpgroup 1: its half of P @ rows for every block, rescaled by the scorer's factors; with the scorer's final
    row maxima and sums (``done``), its epilogue, staged in the other half of q's buffer."""
    HALF: gl.constexpr = D // 2
    lo, hi, n_blocks = split_range(cmp_len_row, N_CMP, W, K, pid_sp, NUM_SPLITS, BLOCK_N)
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
    epilogue(acc, m_i, l_i, sink_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, b, pid_t, pid_sp, so_b, so_h,
             o_l, D, BLOCK_H, NUM_SPLITS, HALF, False, q_smem.slice(HALF, HALF, dim=1))
