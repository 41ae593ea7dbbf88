"""Warp-specialised Gluon decode attention over FP8 KV caches (sm_90, bf16 q, H = 64, D = 512, S = 1):
variant ``ws`` of ``sparse_attention_fp8.py``.

Why: the FP8 reader (``sparse_attention_fp8.py``, variant ``v0``) decodes each row block with the
same 8 warps that compute the scores, softmax and ``P @ rows``; the decode and its barriers run
between the MMAs, so the FP8 cache, which reads 43% fewer bytes than bf16, takes 1.5x the bf16
kernel's time (H200, session 13: CSA 32K B=128 83.5 against 53.9 us).

Here the two roles run side by side, as in ``sparse_attention_ws.py`` (the bf16 ``ws`` kernel):

- A *decoder* partition (``DECODER_WARPS`` warps, ``gl.warp_specialize``) gathers each block's raw
  entry bytes by ``cp.async`` into a byte ring of ``NUM_STAGES`` slots (``_issue_bytes``: codes,
  rope, footer scales; masked lanes zero-filled, which decodes to exact zeros), and decodes a landed
  block (``_decode_block``: the PTX bit moves, bit for bit the v0 reader's values) into a ring of
  ``E_STAGES`` bf16 row blocks, the wgmma operand. It waits for its E slot to be freed (``empty``
  mbarrier), and publishes the decoded block (``fence.proxy.async`` for the wgmma's proxy, a
  partition barrier, one arrival on ``full``). Once a block is decoded its byte slot is refilled
  with the block ``NUM_STAGES`` ahead.
- The two MMA warpgroups are the bf16 ``ws`` kernel's (``_scorer``, ``_helper``; since session 24): the scorer
  waits on ``full``, scores a block whole, runs the online softmax and hands P and the rescale factors to the
  helper; each issues ``P @ rows`` over its 256 channels and writes them; a decoded slot is freed once both have
  read it (``empty`` counts two). Until session 24 8 consumer warps each scored half of a block's rows and
  exchanged the row maxima through shared memory. The score bias follows the decoder's copy mask (``_valid``: the
  same rule as ``_entry_pointers``).

FP8 modes 2 (FP8 window and pool pages) and 1 (bf16 window rows, loaded by the decoder, and an FP8
pool), as v0. Launch split, partials, ``combine_kernel`` and the argument checks: ``gluon_fp8_launch``
(``variant="ws"``).

Shared memory: q 64 KB + ``E_STAGES x BLOCK_N`` KB of decoded rows + ``NUM_STAGES x BLOCK_N x 648`` B
of raw bytes + P ``2 x 64 x BLOCK_N x 2`` B + the rescale factors and row stats (``fp8_smem_bytes``).

Status (H200; BENCHMARKS.md, sessions 21 to 25): the default FP8 reader, bit for bit v0's values. Session 21:
CSA 32K B=1 19.2 us (Triton FP8 kernel 20.3, v0 21.9), B=64 44.0 (v0 53.3), B=128 72.0 (v0 83.4), decoder-bound
(its loop: 965 SASS instructions a 32-row block, run by one warp per SM sub-partition). Session 22 (Nsight Compute
first, ``benchmarks/ncu_gluon.py``) cut the loop to 530 instructions: the copies' page arithmetic in unsigned
32 bits with constant strides (``_entry_offsets``; no division by a selected page size), each row's index, address
and mask computed once in its warp (``_row_lane_layout``, ``_issue_rows``; the 32 lanes of a row used to repeat
it) and its indices picked an iteration after their loads (21% of the decoder's stall samples were a select
waiting for them). The byte ring's rows are swizzled (``CODES_SWIZZLE``) against the 4-way bank conflicts of the
one-store decode's reads. CSA 32K: B=1 15.8, B=64 34.3, B=128 54.1 us. Session 24 (the bf16 ws kernel's scorer and
helper as the MMA warps): B=1 15.3, B=64 32.3, B=128 46.9; a 4K-entry dense prefix at B=128 448 against 507; mode 1
B=128 69.0; still 0 mismatches against the Triton FP8 kernel in every mode and split. Session 25 (the output stored
through q's shared memory, ``STAGED_OUT``): B=128 41.2, mode 1 B=128 61.3; B=1 and 64 (two splits) unchanged.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.runtime.jit import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from .sparse_attention import _load_entry_index, _pick_entry_index, _split_range
from .sparse_attention_fp8 import (_copy_data_bytes, _copy_scale_bytes, _decode_block, _decode_block_3d,
                                   _entry_pointers, _rows_3d)
from .sparse_attention_ws import _helper, _scorer

__all__ = ["sparse_attention_gluon_fp8_ws_kernel", "NUM_WARPS", "DECODER_WARPS", "DECODER_REGS", "HELPER_REGS",
           "Q_REG_COLS", "STAGED_OUT", "ONE_STORE_ROWS", "L3_ROW",
           "CODES_SWIZZLE"]

# 4 decoder warps: 8 leave ptxas 128 registers a thread for the whole kernel, too few for the MMA warps
NUM_WARPS = 4  # the kernel's: the bf16 ws kernel's scorer partition (the launcher reads it)
DECODER_WARPS = 4
DECODER_REGS = 112
# the scorer and helper's registers split (``sparse_attention_ws``): the scorer gets 504 - HELPER_REGS - DECODER_REGS
HELPER_REGS = 176
Q_REG_COLS = 0  # q's columns in the scorer's registers (``sparse_attention_ws._scores``)
STAGED_OUT = 1  # one split: the output stored through q's shared memory (``sparse_attention._epilogue``); 0: not
# timing switches of the decoder (``_decoder``; results wrong), e.g. ``benchmarks/ws_ab.py --fp8 DIAG_NO_DECODE=1``
DIAG_NO_DECODE = 0
DIAG_NO_COPY = 0
# FP8 mode 2: rows decoded as one [16, 8, 64] tensor and stored at once (0: a 64-channel block at a
# time, a membar CTA barrier before each store); 16 is the fewest rows 4 warps hold without duplicates
ONE_STORE_ROWS = 16
# the 3D decode's layout keeps a row's 8 blocks in one thread: the rope's where folds away (-19% of
# the decoder loop's instructions in the sm_90 SASS: 964 against 1187 a 32-row block)
L3_ROW = True
# the one-store decode reads a warp's 4 rows at one column offset: 512-byte rows put them in the same banks
# (Nsight Compute, session 22: 4.1-way conflicts, 18% of the decoder's shared-load wavefronts); swizzled,
# odd rows swap the 64-byte halves of each 128 bytes, so two rows share a wavefront. H200 (session 22), CSA 32K:
# B=64 34.3 against 35.3 us, a dense prefix at B=128 507 against 521, B=128 54.1 either way; exact either way
CODES_SWIZZLE = True


@constexpr_function
def _row_lane_layout(block_n, warps, width):
    """``[block_n, width]`` with a row's ``width`` bytes in one thread and the rows over the lanes: warp
    ``w`` holds rows ``w, w + warps, ...`` (the rows it copies: one a warp at a time, as
    ``_copy_data_bytes``), one a lane; the lanes past ``block_n / warps`` repeat them. A row's address
    is then computed once in a warp (not in all 32 lanes) and handed to the copying lanes by shuffles."""
    per_warp = block_n // warps
    assert per_warp * warps == block_n and per_warp <= 32, (block_n, warps)
    regs = [[0, 1 << b] for b in range(width.bit_length() - 1)]
    lanes = [[warps << b, 0] if (1 << b) < per_warp else [0, 0] for b in range(5)]
    warp_bases = [[1 << b, 0] for b in range(warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(regs, lanes, warp_bases, [], [block_n, width])


@constexpr_function
def _codes_3d_layout(block_n):
    """The byte slot ``[block_n, 512]`` (``SwizzledSharedLayout(vec=64, max_phase=2)``: odd rows swap the
    64-byte halves of each 128 bytes) seen as ``[block_n, 8, 64]``: offset bit 9 (row parity) also
    flips the channel block's bit 0."""
    bases = [[0, 0, 1 << b] for b in range(6)] + [[0, 1 << b, 0] for b in range(3)] + [[1, 1, 0]]
    bases += [[1 << b, 0, 0] for b in range(1, block_n.bit_length() - 1)]
    return gl.SharedLinearLayout(bases)


@gluon.jit
def _issue_rows(codes_buf, rope_buf, scl_buf, v, loaded, hi, W, K, N_KV, N_CMP, kv_row0, cmp_row0,
                FP8: gl.constexpr, KV_PAGE: gl.constexpr, CMP_PAGE: gl.constexpr, NOPE: gl.constexpr,
                DATA_BYTES: gl.constexpr, SCALE_BYTES: gl.constexpr, row_l: gl.constexpr):
    """``_issue_bytes`` with the rows' indices, addresses and masks computed one row a lane (``v``,
    ``loaded``: ``SliceLayout(1, row_l)``), the scale bytes copied from there, the codes and rope
    by the row's warp."""
    data, scl, lane8 = _entry_pointers(v, _pick_entry_index(v, loaded, W, K), hi, W, N_KV, N_CMP, kv_row0,
                                       cmp_row0, FP8, KV_PAGE, CMP_PAGE, DATA_BYTES, SCALE_BYTES)
    _copy_scale_bytes(scl_buf, scl, lane8, row_l, SCALE_BYTES)
    _copy_data_bytes(codes_buf, rope_buf, data, lane8, NOPE)


@gluon.jit
def _decoder(codes_ring, rope_ring, scl_ring, e_ring, full, empty, cmp_len_row, pid_sp, W, K, N_KV, N_CMP,
             kv_row0, skv_n, cmp_row0, widx_row, swi_w, cidx_row, sci_k,
             FP8: gl.constexpr, KV_PAGE: gl.constexpr, CMP_PAGE: gl.constexpr, NOPE: gl.constexpr,
             DATA_BYTES: gl.constexpr, SCALE_BYTES: gl.constexpr, BLOCK_N: gl.constexpr,
             NUM_STAGES: gl.constexpr, E_STAGES: gl.constexpr, DECODE: gl.constexpr, ONE_STORE: gl.constexpr,
             L3_ROW: gl.constexpr, NUM_SPLITS: gl.constexpr, CODES_SWIZZLE: gl.constexpr,
             DIAG_NO_DECODE: gl.constexpr, DIAG_NO_COPY: gl.constexpr):
    """Every block: its raw bytes landed -> a free E slot -> decoded -> published; its byte slot
    refilled with the block ``NUM_STAGES`` ahead (blocks past the split: every lane masked, no
    memory read). ``DIAG_*`` (timing only, wrong results): no decode (the E slot published as it is),
    no copies (every lane masked: zero-filled, no HBM read)."""
    lo, hi, n_blocks = _split_range(cmp_len_row, N_CMP, W, K, pid_sp, NUM_SPLITS, BLOCK_N)
    if DIAG_NO_COPY:
        hi_copy = lo
    else:
        hi_copy = hi
    row_l: gl.constexpr = _row_lane_layout(BLOCK_N, gl.num_warps(), SCALE_BYTES)
    # the 3D decode's layout: L3_ROW, a row's 8 blocks of 8 channels in one thread (the rope's where
    # folds away), or L3_LANES (v0's: a warp reads 4 blocks x 64 codes of a row)
    L3_rows: gl.constexpr = gl.BlockedLayout([1, 8, 8], [4, 1, 8], [gl.num_warps(), 1, 1], [2, 1, 0])
    L3_lanes: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [gl.num_warps(), 1, 1], [2, 1, 0])
    L3: gl.constexpr = L3_rows if L3_ROW else L3_lanes
    v = lo + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, row_l))
    loaded = _load_entry_index(v, W, K, widx_row, swi_w, cidx_row, sci_k)
    for st in gl.static_range(NUM_STAGES):
        _issue_rows(codes_ring.index(st), rope_ring.index(st), scl_ring.index(st), v, loaded, hi_copy, W, K, N_KV,
                    N_CMP, kv_row0, cmp_row0, FP8, KV_PAGE, CMP_PAGE, NOPE, DATA_BYTES, SCALE_BYTES, row_l)
        cp.commit_group()
        v = v + BLOCK_N
        loaded = _load_entry_index(v, W, K, widx_row, swi_w, cidx_row, sci_k)
    for j in range(n_blocks):
        slot = j % NUM_STAGES
        eslot = j % E_STAGES
        cp.wait_group(NUM_STAGES - 1)  # this thread's copies of block j landed
        gl.thread_barrier()  # ... every decoder thread's
        # E slot's previous block (j - E_STAGES) consumed; the first round is free
        mbarrier.wait(empty.index(eslot), ((j // E_STAGES) + 1) & 1, pred=j >= E_STAGES)
        if DIAG_NO_DECODE:
            pass
        elif ONE_STORE:  # ONE_STORE rows at a time, each decoded whole and stored once
            if CODES_SWIZZLE:  # the swizzled byte slot seen as [BLOCK_N, 8, 64] (a reshape cannot say it)
                codes3 = codes_ring.index(slot)._reinterpret(gl.uint8, [BLOCK_N, 8, 64], _codes_3d_layout(BLOCK_N))
                rope16 = rope_ring.index(slot)._reinterpret(gl.bfloat16, [BLOCK_N, 64], rope_ring.layout)
            else:
                codes3, rope16 = _rows_3d(codes_ring.index(slot), rope_ring.index(slot), BLOCK_N)
            for r in gl.static_range(0, BLOCK_N, ONE_STORE):
                _decode_block_3d(codes3.slice(r, ONE_STORE), rope16.slice(r, ONE_STORE),
                                 scl_ring.index(slot).slice(r, ONE_STORE), e_ring.index(eslot).slice(r, ONE_STORE),
                                 lo + j * BLOCK_N + r, W, widx_row, swi_w, kv_row0, skv_n, N_KV, hi, FP8, NOPE,
                                 ONE_STORE, DECODE, L3)
        else:
            _decode_block(codes_ring.index(slot), rope_ring.index(slot), scl_ring.index(slot), e_ring.index(eslot),
                          lo + j * BLOCK_N, W, widx_row, swi_w, kv_row0, skv_n, N_KV, hi, FP8, NOPE, BLOCK_N, DECODE)
        fence_async_shared()  # the decoded rows (plain stores) visible to the wgmma (async proxy) ...
        gl.thread_barrier()  # ... every decoder thread's; all done reading byte slot `slot`
        mbarrier.arrive(full.index(eslot))
        # this block's indices were loaded an iteration ago, so picking them waits for nothing
        _issue_rows(codes_ring.index(slot), rope_ring.index(slot), scl_ring.index(slot), v, loaded, hi_copy, W, K, N_KV,
                    N_CMP, kv_row0, cmp_row0, FP8, KV_PAGE, CMP_PAGE, NOPE, DATA_BYTES, SCALE_BYTES, row_l)
        cp.commit_group()
        v = v + BLOCK_N
        loaded = _load_entry_index(v, W, K, widx_row, swi_w, cidx_row, sci_k)  # in flight through the next decode
    cp.wait_group(0)  # no copy may outlive the program's shared memory


@gluon.jit
def sparse_attention_gluon_fp8_ws_kernel(
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
    E_STAGES: gl.constexpr, NUM_SPLITS: gl.constexpr, FP8: gl.constexpr, DECODE: gl.constexpr,
    KV_PAGE: gl.constexpr, CMP_PAGE: gl.constexpr, NOPE: gl.constexpr, DATA_BYTES: gl.constexpr,
    SCALE_BYTES: gl.constexpr, DECODER_WARPS: gl.constexpr, DECODER_REGS: gl.constexpr, ONE_STORE: gl.constexpr,
    L3_ROW: gl.constexpr = False, CODES_SWIZZLE: gl.constexpr = False, HELPER_REGS: gl.constexpr = 176,
    Q_REG_COLS: gl.constexpr = 0, STAGED_OUT: gl.constexpr = 1, DIAG_NO_DECODE: gl.constexpr = 0,
    DIAG_NO_COPY: gl.constexpr = 0,
):
    gl.static_assert(gl.num_warps() == 4, "the scorer is the default partition")
    gl.static_assert(NUM_STAGES >= 1)
    gl.static_assert(E_STAGES >= 2)
    gl.static_assert(D == 512)
    gl.static_assert(NOPE == 448)
    gl.static_assert(SCALE_BYTES == 8)
    pid_t = gl.program_id(0)
    pid_sp = gl.program_id(1)
    scale_log2e = scale_log2e.to(gl.float32)
    b = pid_t.to(gl.int64)

    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D], gl.bfloat16)
    e_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16)
    flat_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    v_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D], q_sl)
    e_ring = gl.allocate_shared_memory(gl.bfloat16, [E_STAGES, BLOCK_N, D], e_sl)
    if CODES_SWIZZLE:
        codes_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=64, per_phase=1, max_phase=2, order=[1, 0])
    else:
        codes_sl: gl.constexpr = flat_sl
    codes_ring = gl.allocate_shared_memory(gl.uint8, [NUM_STAGES, BLOCK_N, 512], codes_sl)
    rope_ring = gl.allocate_shared_memory(gl.uint8, [NUM_STAGES, BLOCK_N, 128], flat_sl)
    scl_ring = gl.allocate_shared_memory(gl.uint8, [NUM_STAGES, BLOCK_N, SCALE_BYTES], flat_sl)
    # the bf16 ws kernel's scorer -> helper hand-off: P and the rescale factors, two deep; the final row stats
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_H, BLOCK_N], p_sl)
    alpha_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], v_sl)
    ml_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], v_sl)
    full = gl.allocate_shared_memory(gl.int64, [E_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [E_STAGES, 1], mbarrier.MBarrierLayout())
    pfull = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pfree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(E_STAGES):
        mbarrier.init(full.index(st), count=1)  # one arrival once every decoder thread has fenced
        mbarrier.init(empty.index(st), count=2)  # the scorer's and the helper's P @ rows done
    for st in gl.static_range(2):
        mbarrier.init(pfull.index(st), count=1)
        mbarrier.init(pfree.index(st), count=1)
    mbarrier.init(done.index(0), count=1)

    cmp_len_row = cmp_len_ptr + b * scl_b  # each partition reads its split's range (as the bf16 ws kernel)
    kv_row0 = kv_ptr + b * skv_b
    cmp_row0 = cmp_ptr + b * sc_b
    widx_row = kv_idx_ptr + b * swi_b
    cidx_row = cmp_idx_ptr + b * sci_b

    gl.warp_specialize([
        (_scorer, (q_ptr + b * sq_b, sq_h, q_smem, e_ring, p_smem, alpha_smem, ml_smem, full, empty, pfull, pfree,
                   done, cmp_len_row, pid_sp, scale_log2e, W, K, N_KV, N_CMP, widx_row, swi_w, cidx_row, sci_k,
                   sink_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, b, pid_t, so_b, so_h,
                   D, BLOCK_H, BLOCK_N, E_STAGES, NUM_SPLITS, Q_REG_COLS, STAGED_OUT)),
        (_helper, (q_smem, e_ring, p_smem, alpha_smem, ml_smem, empty, pfull, pfree, done, cmp_len_row, pid_sp,
                   N_CMP, W, K, sink_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, b, pid_t, so_b, so_h,
                   D, BLOCK_H, BLOCK_N, E_STAGES, NUM_SPLITS, STAGED_OUT)),
        (_decoder, (codes_ring, rope_ring, scl_ring, e_ring, full, empty, cmp_len_row, pid_sp, W, K, N_KV, N_CMP,
                    kv_row0, skv_n, cmp_row0, widx_row, swi_w, cidx_row, sci_k, FP8, KV_PAGE, CMP_PAGE, NOPE,
                    DATA_BYTES, SCALE_BYTES, BLOCK_N, NUM_STAGES, E_STAGES, DECODE, ONE_STORE, L3_ROW, NUM_SPLITS,
                    CODES_SWIZZLE, DIAG_NO_DECODE, DIAG_NO_COPY)),
    ], [4, DECODER_WARPS], [HELPER_REGS, DECODER_REGS])
