"""Gluon decode sparse attention over FP8 page caches for sm_90 (bf16 q, V4's widths, one query token): what
``dsv4_ops/ops/attention_sm90.py`` routes FP8 caches to when :func:`serves` them. The contract is the Triton
kernel's FP8 modes (``lowering.triton.sparse_attention``; ``common``): ``FP8`` 2, window and pool in FP8 pages;
``FP8`` 1, a bf16 window ring ``[B, N, D]`` and an FP8 pool.

An entry (``fp8_cache``, FlashMLA's MODEL1 layout) is ``DATA_BYTES`` at ``page_base + t * DATA_BYTES`` (``NOPE``
e4m3 codes, then ``ROPE`` bf16 rope values) and ``SCALE_BYTES`` in the page footer (one ue8m0 exponent a 64-channel
block, then a pad byte). The reader copies entries raw and decodes them to bf16 in shared memory, since the wgmma
reads its operands there:

- **Raw bytes by cp.async** into a byte ring, three buffers a slot: the codes (a power-of-two tile whose columns
  past ``NOPE`` are zero-filled without a read), the rope bytes, the scales. Masked lanes are zero-filled too, and
  codes and scales of 0 decode to +0, so a masked row is exactly 0 (its score is also biased to -inf). The codes
  come in 16-byte copies, which needs 16-byte aligned pages (:func:`serves` and the launcher check them).
- **Decode** by the PTX bit moves of ``fp8_codec._e4m3x4_bf16`` (``E4M3_HW`` 4: exact, subnormals included), times
  the block's scale as the bf16 ``2^(s - 127)`` (``ue8m0 << 7``), into the bf16 row block the wgmma reads; the rope
  is stored as it is. The values equal the Triton kernel's decode bit for bit.
- **Mode 1**: the window lanes' bytes are not copied (zero-filled); the decoder loads their bf16 rows from global
  memory and selects them over the decoded zeros.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.runtime.jit import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from ..triton.fp8_codec import E4M3X4_BF16_ASM
from .common import (HEAD_DIM, check_decode, decode_launches, load_entry_index, pick_entry_index, run,
                     split_range, valid_entries)
from .mma_partitions import helper, mma_buffers, scorer

__all__ = ["sparse_attention_gluon_fp8", "sparse_attention_gluon_fp8_ws_kernel", "gluon_fp8_launch", "serves"]

NAME = "sparse_attention_gluon_fp8"
NOPE, ROPE = 448, 64
DATA_BYTES, SCALE_BYTES = NOPE + 2 * ROPE, 8  # fp8_cache.KVLayout(512, 64)
ENTRY_BYTES = DATA_BYTES + SCALE_BYTES
BLOCK_N, NUM_STAGES, E_STAGES = 32, 2, 3  # rows a block, raw blocks in flight, decoded blocks
NUM_WARPS = 4  # the kernel's: the scorer's (the default partition)
# 4 decoder warps: 8 leave ptxas too few registers a thread for the MMA warps
DECODER_WARPS, DECODER_REGS = 4, 112
HELPER_REGS = 176  # the scorer gets what the helper and the decoder leave
# mode 2: rows decoded as one tensor and stored at once, the fewest rows 4 warps hold without duplicates
DECODE_ROWS = 16


@gluon.jit
def _entry_offsets(i, PAGE: gl.constexpr, DATA_BYTES: gl.constexpr, SCALE_BYTES: gl.constexpr):
    """Byte offsets of entries ``i`` (>= 0) from their token's first page, in a cache of contiguous pages under 2^31
    bytes a token (``_fp8_cache`` checks both; ``serves`` leaves other caches to the Triton kernel): the data bytes
    and the footer's scale bytes. Unsigned 32-bit with constant strides (a shift and a mask for a power-of-two
    page), since every lane of a row issues its copies and this runs in the decoder's loop."""
    u = i.to(gl.uint32)
    page = u // PAGE
    t = u - page * PAGE
    base = page * (PAGE * (DATA_BYTES + SCALE_BYTES))
    return base + t * DATA_BYTES, base + PAGE * DATA_BYTES + t * SCALE_BYTES


@gluon.jit
def _entry_pointers(v, idx, hi, W, N_KV, N_CMP, kv_row0, cmp_row0, FP8: gl.constexpr, KV_PAGE: gl.constexpr,
                    CMP_PAGE: gl.constexpr, DATA_BYTES: gl.constexpr, SCALE_BYTES: gl.constexpr):
    """(data, scales, copied) of entries ``v`` in ``v``'s layout: the addresses of their data bytes and of their
    footer scale bytes, and which lanes are copied (FP8 and valid; the others are zero-filled)."""
    in_w = v < W
    valid = valid_entries(v, idx, hi, W, N_KV, N_CMP)
    if FP8 == 2:
        lane8 = valid
        i8 = gl.where(lane8, idx, 0)
        # each segment's offsets whole, then a select: selecting the page size first turns both
        # divisions by a constant into one by a register (a long integer division a row)
        data_w, scl_w = _entry_offsets(i8, KV_PAGE, DATA_BYTES, SCALE_BYTES)
        data_c, scl_c = _entry_offsets(i8, CMP_PAGE, DATA_BYTES, SCALE_BYTES)
        row0 = gl.where(in_w, kv_row0, cmp_row0)
        data = row0 + gl.where(in_w, data_w, data_c)
        scl = row0 + gl.where(in_w, scl_w, scl_c)
    else:
        lane8 = valid & (v >= W)
        data_c, scl_c = _entry_offsets(gl.where(lane8, idx, 0), CMP_PAGE, DATA_BYTES, SCALE_BYTES)
        data = cmp_row0 + data_c
        scl = cmp_row0 + scl_c
    return data, scl, lane8


@gluon.jit
def _copy_data_bytes(codes_buf, rope_buf, data, lane8, NOPE: gl.constexpr):
    """cp.async the codes and rope bytes at ``data`` into one ring slot, one row a warp; rows not copied: zeros, no
    memory read. ``data``, ``lane8``: any layout (converted to the copies' own)."""
    codes_l: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [gl.num_warps(), 1], [1, 0])
    rope_l: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [gl.num_warps(), 1], [1, 0])
    # the codes: a power-of-two tile [BLOCK_N, 512]; columns NOPE.. zero-filled (no read)
    offs_c = gl.arange(0, 512, layout=gl.SliceLayout(0, codes_l))
    m_c = gl.convert_layout(lane8, gl.SliceLayout(1, codes_l))
    p_c = gl.convert_layout(data, gl.SliceLayout(1, codes_l))
    cp.async_copy_global_to_shared(codes_buf, p_c[:, None] + offs_c[None, :],
                                   mask=m_c[:, None] & (offs_c < NOPE)[None, :])
    offs_r = gl.arange(0, 128, layout=gl.SliceLayout(0, rope_l))
    m_r = gl.convert_layout(m_c, gl.SliceLayout(1, rope_l), assert_trivial=True)
    p_r = gl.convert_layout(p_c, gl.SliceLayout(1, rope_l), assert_trivial=True)
    cp.async_copy_global_to_shared(rope_buf, (p_r + NOPE)[:, None] + offs_r[None, :], mask=m_r[:, None])


@gluon.jit
def _copy_scale_bytes(scl_buf, scl, lane8, scl_l: gl.constexpr, SCALE_BYTES: gl.constexpr):
    """cp.async each row's footer scale bytes at ``scl`` into one ring slot, in ``scl_l`` (rows as ``scl``'s)."""
    offs_s = gl.arange(0, SCALE_BYTES, layout=gl.SliceLayout(0, scl_l))
    m_s = gl.convert_layout(lane8, gl.SliceLayout(1, scl_l), assert_trivial=True)
    p_s = gl.convert_layout(scl, gl.SliceLayout(1, scl_l), assert_trivial=True)
    cp.async_copy_global_to_shared(scl_buf, p_s[:, None] + offs_s[None, :], mask=m_s[:, None])


@constexpr_function
def _row_lane_layout(block_n, warps, width):
    """``[block_n, width]`` with a row's ``width`` bytes in one thread and the rows over the lanes: warp ``w`` holds
    rows ``w, w + warps, ...`` (the rows it copies: one a warp at a time, as ``_copy_data_bytes``), one a lane; the
    lanes past ``block_n / warps`` repeat them. A row's address is then computed once in a warp (not in all its
    lanes) and handed to the copying lanes by shuffles."""
    per_warp = block_n // warps
    assert per_warp * warps == block_n and per_warp <= 32, (block_n, warps)
    regs = [[0, 1 << b] for b in range(width.bit_length() - 1)]
    lanes = [[warps << b, 0] if (1 << b) < per_warp else [0, 0] for b in range(5)]
    warp_bases = [[1 << b, 0] for b in range(warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(regs, lanes, warp_bases, [], [block_n, width])


@constexpr_function
def _codes_3d_layout(block_n):
    """The byte slot ``[block_n, 512]`` (``SwizzledSharedLayout(vec=64, max_phase=2)``: odd rows swap the 64-byte
    halves of each 128 bytes) seen as ``[block_n, 8, 64]``: offset bit 9 (row parity) also flips the channel
    block's bit 0."""
    bases = [[0, 0, 1 << b] for b in range(6)] + [[0, 1 << b, 0] for b in range(3)] + [[1, 1, 0]]
    bases += [[1 << b, 0, 0] for b in range(1, block_n.bit_length() - 1)]
    return gl.SharedLinearLayout(bases)


@gluon.jit
def _issue_rows(codes_buf, rope_buf, scl_buf, v, loaded, hi, W, K, L, N_KV, N_CMP, kv_row0, cmp_row0,
                FP8: gl.constexpr, KV_PAGE: gl.constexpr, CMP_PAGE: gl.constexpr, NOPE: gl.constexpr,
                DATA_BYTES: gl.constexpr, SCALE_BYTES: gl.constexpr, row_l: gl.constexpr):
    """cp.async the raw entries of ``v`` (codes, rope, scales; lanes not copied: zeros, no memory read) into one
    ring slot, the rows' indices, addresses and masks computed one row a lane (``v``, ``loaded``:
    ``SliceLayout(1, row_l)``), the scale bytes copied from there, the codes and rope by the row's warp."""
    data, scl, lane8 = _entry_pointers(v, pick_entry_index(v, loaded, W, K, L), hi, W, N_KV, N_CMP, kv_row0,
                                       cmp_row0, FP8, KV_PAGE, CMP_PAGE, DATA_BYTES, SCALE_BYTES)
    _copy_scale_bytes(scl_buf, scl, lane8, row_l, SCALE_BYTES)
    _copy_data_bytes(codes_buf, rope_buf, data, lane8, NOPE)


@gluon.jit
def _e4m3x4_bf16(code):
    """``fp8_codec._e4m3x4_bf16`` (the Triton kernel's ``E4M3_HW`` 4 decode), the same PTX: four e4m3 codes of one
    32-bit register -> four exact bf16 values (``code * 2^-120`` by bit moves, then one ``bf16x2`` multiply by
    ``2^120`` per two values)."""
    return gl.inline_asm_elementwise(asm=E4M3X4_BF16_ASM, constraints="=r,=r,r", args=[code], dtype=gl.bfloat16,
                                     is_pure=True, pack=4)


@gluon.jit
def _decode_rows(codes3, rope16, scl_buf, e_buf, ROWS: gl.constexpr, NOPE: gl.constexpr, L3: gl.constexpr):
    """Mode 2: ``ROWS`` rows decoded as one ``[ROWS, 8, 64]`` tensor (``L3``: a row's 8 channel blocks in one
    thread, so the rope's select folds away at compile time) and stored to ``e_buf`` at once. Triton's membar pass
    does not tell column slices of one buffer apart, so a store a 64-channel block would get a CTA barrier each.
    ``codes3``, ``rope16``: the slot's codes as ``[ROWS, 8, 64]`` u8 and rope as ``[ROWS, 64]`` bf16; block 7 (the
    codes' zero-filled columns) takes the rope."""
    code = codes3.load(L3)
    sbyte = scl_buf.load(gl.SliceLayout(2, L3))  # [ROWS, 8] (byte 7: the pad)
    scale = (sbyte.to(gl.int16) << 7).to(gl.bfloat16, bitcast=True)  # 2^(s - 127), s = 0: +0
    val = _e4m3x4_bf16(code) * gl.expand_dims(scale, 2)
    rope = rope16.load(gl.SliceLayout(1, L3))
    blk = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    is_rope = gl.expand_dims(gl.expand_dims(blk, 0), 2) == NOPE // 64
    val = gl.where(is_rope, gl.expand_dims(rope, 1), val)
    e_buf.store(gl.reshape(val, [ROWS, 8 * 64]))


@gluon.jit
def _decode_with_window(codes_buf, rope_buf, scl_buf, e_buf, start, W, widx_row, swi_w, kv_row0, skv_n, N_KV, hi,
                        NOPE: gl.constexpr, BLOCK_N: gl.constexpr):
    """Mode 1: raw bytes of one ring slot -> bf16 rows in ``e_buf``, one 64-channel block at a time (8 codes a
    thread, times the block's scale), the window lanes' rows loaded from the bf16 window instead. Decoded whole,
    the block and its window rows would not fit the decoder's registers."""
    dec_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    offs_c = gl.arange(0, 64, layout=gl.SliceLayout(0, dec_l))
    # window lanes of this block: their row pointers (the indices again, an L1/L2 hit)
    vd = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, dec_l))
    wi = gl.load(widx_row + vd * swi_w, mask=vd < W, other=-1)
    win = (vd < W) & (vd < hi) & (wi >= 0) & (wi < N_KV)
    wrow = kv_row0 + gl.where(win, wi, 0).to(gl.int64) * skv_n
    for k in gl.static_range(NOPE // 64):
        code = codes_buf.slice(64 * k, 64, dim=1).load(dec_l)  # [BLOCK_N, 64] u8
        sbyte = scl_buf.slice(k, 1, dim=1).load(dec_l)  # [BLOCK_N, 1] u8, broadcast
        scale = (sbyte.to(gl.int16) << 7).to(gl.bfloat16, bitcast=True)  # 2^(s - 127), s = 0: +0
        val = _e4m3x4_bf16(code) * scale
        ew = gl.load(wrow[:, None] + (64 * k + offs_c)[None, :], mask=win[:, None], other=0.0)
        val = gl.where(win[:, None], ew.to(gl.bfloat16), val)
        e_buf.slice(64 * k, 64, dim=1).store(val)
    rope = rope_buf._reinterpret(gl.bfloat16, [BLOCK_N, 64], rope_buf.layout).load(dec_l)
    ew = gl.load(wrow[:, None] + (NOPE + offs_c)[None, :], mask=win[:, None], other=0.0)
    rope = gl.where(win[:, None], ew.to(gl.bfloat16), rope)
    e_buf.slice(NOPE, 64, dim=1).store(rope)


@gluon.jit
def _decoder(codes_ring, rope_ring, scl_ring, e_ring, full, empty, cmp_len_row, pid_sp, W, K, L, N_KV, N_CMP,
             kv_row0, skv_n, cmp_row0, widx_row, swi_w, cidx_row, sci_k,
             FP8: gl.constexpr, KV_PAGE: gl.constexpr, CMP_PAGE: gl.constexpr, NOPE: gl.constexpr,
             DATA_BYTES: gl.constexpr, SCALE_BYTES: gl.constexpr, BLOCK_N: gl.constexpr,
             NUM_STAGES: gl.constexpr, E_STAGES: gl.constexpr, DECODE_ROWS: gl.constexpr, NUM_SPLITS: gl.constexpr):
    """Every block: its raw bytes landed -> a free E slot -> decoded -> published; its byte slot refilled with the
    block ``NUM_STAGES`` ahead (blocks past the split: every lane masked, no memory read). Each block's indices
    are loaded an iteration before they are picked, so picking them waits for nothing."""
    lo, hi, n_blocks = split_range(cmp_len_row, N_CMP, W, K, pid_sp, NUM_SPLITS, BLOCK_N)
    row_l: gl.constexpr = _row_lane_layout(BLOCK_N, gl.num_warps(), SCALE_BYTES)
    L3: gl.constexpr = gl.BlockedLayout([1, 8, 8], [4, 1, 8], [gl.num_warps(), 1, 1], [2, 1, 0])
    v = lo + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, row_l))
    loaded = load_entry_index(v, W, L, widx_row, swi_w, cidx_row, sci_k)
    for st in gl.static_range(NUM_STAGES):
        _issue_rows(codes_ring.index(st), rope_ring.index(st), scl_ring.index(st), v, loaded, hi, W, K, L, N_KV,
                    N_CMP, kv_row0, cmp_row0, FP8, KV_PAGE, CMP_PAGE, NOPE, DATA_BYTES, SCALE_BYTES, row_l)
        cp.commit_group()
        v = v + BLOCK_N
        loaded = load_entry_index(v, W, L, widx_row, swi_w, cidx_row, sci_k)
    for j in range(n_blocks):
        slot = j % NUM_STAGES
        eslot = j % E_STAGES
        cp.wait_group(NUM_STAGES - 1)  # this thread's copies of block j landed
        gl.thread_barrier()  # ... every decoder thread's
        # E slot's previous block (j - E_STAGES) consumed; the first round is free
        mbarrier.wait(empty.index(eslot), ((j // E_STAGES) + 1) & 1, pred=j >= E_STAGES)
        if FP8 == 2:  # the swizzled byte slot seen as [BLOCK_N, 8, 64] (a reshape cannot say it)
            codes3 = codes_ring.index(slot)._reinterpret(gl.uint8, [BLOCK_N, 8, 64], _codes_3d_layout(BLOCK_N))
            rope16 = rope_ring.index(slot)._reinterpret(gl.bfloat16, [BLOCK_N, 64], rope_ring.layout)
            for r in gl.static_range(0, BLOCK_N, DECODE_ROWS):
                _decode_rows(codes3.slice(r, DECODE_ROWS), rope16.slice(r, DECODE_ROWS),
                             scl_ring.index(slot).slice(r, DECODE_ROWS), e_ring.index(eslot).slice(r, DECODE_ROWS),
                             DECODE_ROWS, NOPE, L3)
        else:
            _decode_with_window(codes_ring.index(slot), rope_ring.index(slot), scl_ring.index(slot),
                                e_ring.index(eslot), lo + j * BLOCK_N, W, widx_row, swi_w, kv_row0, skv_n, N_KV, hi,
                                NOPE, BLOCK_N)
        fence_async_shared()  # the decoded rows (plain stores) visible to the wgmma (async proxy) ...
        gl.thread_barrier()  # ... every decoder thread's; all done reading byte slot `slot`
        mbarrier.arrive(full.index(eslot))
        _issue_rows(codes_ring.index(slot), rope_ring.index(slot), scl_ring.index(slot), v, loaded, hi, W, K, L, N_KV,
                    N_CMP, kv_row0, cmp_row0, FP8, KV_PAGE, CMP_PAGE, NOPE, DATA_BYTES, SCALE_BYTES, row_l)
        cp.commit_group()
        v = v + BLOCK_N
        loaded = load_entry_index(v, W, L, widx_row, swi_w, cidx_row, sci_k)  # in flight through the next decode
    cp.wait_group(0)  # no copy may outlive the program's shared memory


@gluon.jit
def sparse_attention_gluon_fp8_ws_kernel(
    q_ptr, kv_ptr, kv_idx_ptr, cmp_ptr, cmp_idx_ptr, cmp_len_ptr, sink_ptr, out_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,
    scale_log2e,
    N_KV, N_CMP, W, K, L,
    sq_b, sq_h, skv_b, skv_n, swi_b, swi_w,  # strides: q, kv, window index,
    sc_b, sc_n, sci_b, sci_k, scl_b, so_b, so_h,  # compressed kv, its index and length, out
    D: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    E_STAGES: gl.constexpr, NUM_SPLITS: gl.constexpr, FP8: gl.constexpr,
    KV_PAGE: gl.constexpr, CMP_PAGE: gl.constexpr, NOPE: gl.constexpr, DATA_BYTES: gl.constexpr,
    SCALE_BYTES: gl.constexpr, DECODE_ROWS: gl.constexpr, DECODER_WARPS: gl.constexpr, DECODER_REGS: gl.constexpr,
    HELPER_REGS: gl.constexpr,
):
    """One program per token and split, in three partitions (``gl.warp_specialize``), so that the decode of one
    block runs beside the MMAs of the ones before it instead of between them:

    - the decoder (``_decoder``, ``DECODER_WARPS`` warps) copies each block's raw bytes by ``cp.async`` into a byte
      ring of ``NUM_STAGES`` slots, and decodes a landed block into a ring of ``E_STAGES`` bf16 row blocks once
      its slot is free (``empty``), then publishes it (a proxy fence, a partition barrier, one arrival on
      ``full``) and refills the byte slot with the block ``NUM_STAGES`` ahead. Mode 2 decodes ``DECODE_ROWS`` rows
      at a time from a byte ring whose odd rows are swizzled, against the bank conflicts of reading rows at one
      column offset; mode 1 decodes a 64-channel block at a time beside its window rows' loads;
    - the scorer and the helper (``mma_partitions``) read the decoded ring as the bf16 kernel's read its row ring.

    Splits as the bf16 kernel's (the Triton kernel's rule). ``setmaxnreg`` gives the decoder ``DECODER_REGS``, the
    helper ``HELPER_REGS`` and the scorer the rest."""
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
    flat_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D], q_sl)
    e_ring = gl.allocate_shared_memory(gl.bfloat16, [E_STAGES, BLOCK_N, D], e_sl)
    if FP8 == 2:  # odd rows swap the 64-byte halves of each 128 bytes (``_codes_3d_layout``)
        codes_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=64, per_phase=1, max_phase=2, order=[1, 0])
    else:
        codes_sl: gl.constexpr = flat_sl
    codes_ring = gl.allocate_shared_memory(gl.uint8, [NUM_STAGES, BLOCK_N, 512], codes_sl)
    rope_ring = gl.allocate_shared_memory(gl.uint8, [NUM_STAGES, BLOCK_N, 128], flat_sl)
    scl_ring = gl.allocate_shared_memory(gl.uint8, [NUM_STAGES, BLOCK_N, SCALE_BYTES], flat_sl)
    # one arrival publishes a slot, once every decoder thread has fenced its decoded rows
    p_smem, alpha_smem, ml_smem, full, empty, pfull, pfree, done = mma_buffers(BLOCK_H, BLOCK_N, E_STAGES, 1)

    cmp_len_row = cmp_len_ptr + b * scl_b  # each partition reads its split's range
    kv_row0 = kv_ptr + b * skv_b
    cmp_row0 = cmp_ptr + b * sc_b
    widx_row = kv_idx_ptr + b * swi_b
    cidx_row = cmp_idx_ptr + b * sci_b

    gl.warp_specialize([
        (scorer, (q_ptr + b * sq_b, sq_h, q_smem, e_ring, p_smem, alpha_smem, ml_smem, full, empty, pfull, pfree,
                  done, cmp_len_row, pid_sp, scale_log2e, W, K, L, N_KV, N_CMP, widx_row, swi_w, cidx_row, sci_k,
                  sink_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, b, pid_t, so_b, so_h,
                  D, BLOCK_H, BLOCK_N, E_STAGES, NUM_SPLITS)),
        (helper, (q_smem, e_ring, p_smem, alpha_smem, ml_smem, empty, pfull, pfree, done, cmp_len_row, pid_sp,
                  N_CMP, W, K, sink_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, b, pid_t, so_b, so_h,
                  D, BLOCK_H, BLOCK_N, E_STAGES, NUM_SPLITS)),
        (_decoder, (codes_ring, rope_ring, scl_ring, e_ring, full, empty, cmp_len_row, pid_sp, W, K, L, N_KV, N_CMP,
                    kv_row0, skv_n, cmp_row0, widx_row, swi_w, cidx_row, sci_k, FP8, KV_PAGE, CMP_PAGE, NOPE,
                    DATA_BYTES, SCALE_BYTES, BLOCK_N, NUM_STAGES, E_STAGES, DECODE_ROWS, NUM_SPLITS)),
    ], [4, DECODER_WARPS], [HELPER_REGS, DECODER_REGS])


def _err(msg: str) -> ValueError:
    return ValueError(f"{NAME}: {msg}")


def _fp8_cache(name: str, t: torch.Tensor) -> int:
    """Check an FP8 page cache of ``HEAD_DIM``-wide entries (``NOPE`` + ``ROPE``, ``ENTRY_BYTES``); its page size."""
    if t.dtype != torch.uint8 or t.dim() != 4:
        raise _err(f"{name} must be an FP8 page cache uint8 [B, pages, page, {ENTRY_BYTES}], got {t.dtype} "
                   f"{tuple(t.shape)}")
    if t.shape[3] != ENTRY_BYTES:
        raise _err(f"{name} entries must be {ENTRY_BYTES} bytes (D = {HEAD_DIM}: {NOPE} nope + {ROPE} rope), "
                   f"got {t.shape[3]}")
    if t.stride(3) != 1 or t.stride(2) != ENTRY_BYTES or t.stride(1) != t.shape[2] * ENTRY_BYTES:
        raise _err(f"{name}: each page must be contiguous, got strides {t.stride()}")
    # the decoder addresses a token's pages by unsigned 32-bit offsets (_entry_offsets)
    if t.shape[1] * t.shape[2] * ENTRY_BYTES >= 2**31:
        raise _err(f"{name}: a token's {t.shape[1]} pages of {t.shape[2]} entries span "
                   f"{t.shape[1] * t.shape[2] * ENTRY_BYTES} bytes; the reader addresses them in 32 bits "
                   f"(fewer than 2^31 bytes a token)")
    # 16-byte cp.async of the codes: every entry on a 16-byte boundary
    if t.storage_offset() % 16 or t.stride(0) % 16 or t.stride(1) % 16:
        raise _err(f"{name}: pages must be 16-byte aligned (storage offset {t.storage_offset()}, strides "
                   f"{t.stride()})")
    return t.shape[2]


def serves(q, kv, kv_idx, cmp, cmp_idx, cmp_len) -> bool:
    """Static (dtypes, shapes, strides; never values): whether the launcher accepts these caches
    (what ``dsv4_ops/ops/attention_sm90.py`` routes on)."""
    try:
        fp8 = _check(q, kv, kv_idx, cmp, cmp_idx, cmp_len)
        n_kv = kv.shape[1] * _fp8_cache("kv", kv) if fp8 == 2 else kv.shape[1]
        n_cmp = cmp.shape[1] * _fp8_cache("cmp", cmp) if cmp.dim() == 4 else 0
    except ValueError:
        return False
    return n_kv + n_cmp > 0 and q.shape[0] > 0


def _check(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink=None):
    """ValueError naming the argument outside the cases this kernel serves; the FP8 mode."""
    check_decode(NAME, q, kv_idx, cmp_idx, cmp_len, sink)
    if kv.dim() == 4:
        fp8 = 2
    elif kv.dim() == 3 and kv.dtype == torch.bfloat16 and kv.shape[-1] == HEAD_DIM:
        fp8 = 1
    else:
        raise _err(f"kv must be an FP8 page cache (uint8, rank 4) or a bf16 window [B, N, {HEAD_DIM}], got {kv.dtype} "
                   f"{tuple(kv.shape)}")
    if cmp.dim() != 4:
        if fp8 == 2 and cmp.dim() == 3 and cmp.shape[1] == 0:
            return fp8  # a sliding-window layer: no pool (the window pages stand in)
        raise _err(f"cmp must be an FP8 page cache (uint8, rank 4), got {cmp.dtype} {tuple(cmp.shape)} "
                   "(float pools: lowering.gluon.sparse_attention)")
    return fp8


def gluon_fp8_launch(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale, num_splits=None, out=None, picks=None):
    """(out, [(kernel, grid, args, meta), ...]) of one call: the attention and, when split, ``combine_kernel``;
    the cross-compile tests compile these without a GPU."""
    fp8 = _check(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if fp8 == 2:
        kv_page = _fp8_cache("kv", kv)
        n_kv = kv.shape[1] * kv_page
    else:
        if kv.stride(-1) != 1:
            kv = kv.contiguous()
        n_kv = kv.shape[1]
    if cmp.dim() == 4:
        cmp_page = _fp8_cache("cmp", cmp)
        n_cmp = cmp.shape[1] * cmp_page
    else:  # no pool: the window pages stand in, never read
        cmp, cmp_page, n_cmp = kv, kv_page, 0
    if fp8 == 2 and (n_kv == 0 or kv_idx.shape[-1] == 0):
        kv, kv_page = cmp, cmp_page  # never read
    if fp8 == 1 and kv.numel() == 0:
        kv = q  # a bf16 pointer, never read
    meta = dict(BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES, E_STAGES=E_STAGES, FP8=fp8,
                KV_PAGE=kv_page if fp8 == 2 else 1, CMP_PAGE=cmp_page, NOPE=NOPE, DATA_BYTES=DATA_BYTES,
                SCALE_BYTES=SCALE_BYTES, DECODE_ROWS=DECODE_ROWS, DECODER_WARPS=DECODER_WARPS,
                DECODER_REGS=DECODER_REGS, HELPER_REGS=HELPER_REGS, num_warps=NUM_WARPS)
    return decode_launches(NAME, sparse_attention_gluon_fp8_ws_kernel, meta, q, kv, kv_idx, cmp, cmp_idx, cmp_len,
                           sink.contiguous(), scale, n_kv, n_cmp, num_splits, out, picks)


def sparse_attention_gluon_fp8(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale, num_splits=None, *,
                               out=None, picks=None) -> torch.Tensor:
    """``lowering.triton.sparse_attention.sparse_attention`` for bf16 decode over FP8 caches at V4's widths (FP8
    mode 2: FP8 window and pool pages, mode 1: bf16 window rows and an FP8 pool); ValueError for anything else.
    ``picks``: ``common.decode_launches``."""
    return run(*gluon_fp8_launch(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale, num_splits, out, picks))
