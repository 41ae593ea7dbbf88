"""Gluon decode sparse attention over FP8 KV caches (sm_90, bf16 q, H = 64, D = 512, S = 1).

The FP8 twin of ``lowering/gluon/sparse_attention.py`` (v0): same contract as the tl kernel's
FP8 modes (``lowering.triton.sparse_attention``, ``FP8`` 2: FP8 window pages and FP8 pool pages;
``FP8`` 1: a bf16 float window ``[B, N, D]`` and an FP8 pool), same launch split (one program
per token and split, the virtual entry list window | picked | dense prefix, sink folded at the
end, fp32 partials merged by the tl module's ``combine_kernel``), same scores / softmax / P @ rows
structure as v0 (scores MMA with warps ``[4, 2]``: each warpgroup its own ``BLOCK_N / 2`` score
columns; ``acc[64, 512] += P @ rows`` with each warpgroup its 256 channels; the row max exchanged
per warpgroup through shared memory; the row sum kept per column).

What is new is how a row block reaches the wgmma (FlashMLA's way, adapted):

- **Raw bytes by cp.async.** An entry (``fp8_cache``, MODEL1 layout at D = 512) is 576 data
  bytes at ``page_base + t * 576`` (448 e4m3 codes, then 64 bf16 rope values) and 8 scale
  bytes at ``page_base + PAGE * 576 + t * 8`` (7 ue8m0 exponents + 1 pad). A block's entries
  are copied raw into a ring of ``NUM_STAGES`` slots, three buffers a slot: the codes
  ``[BLOCK_N, 512]`` u8 (bytes 0..447 copied, 448..511 zero-filled without a memory read: a
  power-of-two tile), the rope ``[BLOCK_N, 128]`` u8 (bytes 448..575), the scales
  ``[BLOCK_N, 8]`` u8. 16-byte copies for the codes (576 = 36 x 16: a 16-byte aligned page
  base keeps every entry 16-byte aligned; the launcher checks the cache's base and strides),
  4-byte copies for the rope, 8-byte copies for the scales. Invalid lanes (-1, out of range,
  past the split's end) are zero-filled by cp.async (src-size 0): codes 0 and scale byte 0
  decode to +0, so a masked row is exactly 0 (its score is also biased to -inf, P = 0).
- **Decode in shared memory.** Each thread reads 8 codes (8 bytes) of one 64-channel block,
  decodes them to bf16 by the PTX bit moves of ``fp8_codec._e4m3x4_bf16`` (``E4M3_HW`` 4:
  ``prmt / shl / and`` build the bf16 whose value is ``code * 2^-120``, one ``bf16x2`` multiply
  by ``2^120``, exact incl. subnormals), multiplies by the block's scale as bf16 (``ue8m0 << 7``:
  the bf16 ``2^(s - 127)``, exact, as the tl kernel's ``pow2(sc).to(bf16)``) and stores 16 bytes
  into the decoded row block ``E [BLOCK_N, 512]`` (bf16, the NVMMA layout the wgmma reads).
  The rope bytes are bf16 already: loaded through a bf16 view of the rope buffer, stored as
  they are into ``E[:, 448:512]``. Values equal the tl kernel's decode bit for bit.
- **Mode 1** (float window rows): the window lanes' bytes are not copied (zero-filled); at
  decode time their bf16 row is loaded from global memory (plain loads, the window is 128 of
  the 640 CSA entries) and selected over the decoded zeros.
- **Ordering per block j** (3 CTA barriers of the kernel's own, 4 with one decoded buffer): scores of E[j]
  (async) -> wait (also for P @ rows of j - 1) -> per-warpgroup max to shared memory ->
  ``cp.async.wait_group`` (block j + 1's bytes landed) -> B1 (maxima, bytes visible; every
  warpgroup done with E[j - 1] and P) -> softmax, P to shared memory -> fence -> B2 ->
  ``acc += P @ E[j]`` issued async -> (one decoded buffer: wait for it, barrier) -> decode
  block j + 1 into E[(j + 1) % E_BUFS] (with two buffers this overlaps the P @ rows wgmma) ->
  fence -> B3 (E[j + 1] visible; every thread done reading the byte slot) -> refill that byte
  slot with block j + 1 + NUM_STAGES. ``NUM_STAGES`` byte blocks are in flight. The bias of a
  block (0 / -inf) is stored before B3 into a ring of ``NUM_STAGES + 1`` slots.
- **Barriers the compiler adds.** Triton's membar pass does not tell column slices of one shared
  buffer apart, so the decode's eight stores into ``E`` (one a 64-channel block, ``ONE_STORE`` 0,
  the default) get a CTA barrier each (the sm_90 PTX: 11 ``bar.sync`` a loop iteration).
  ``ONE_STORE`` 1 (``_decode_block_3d``) decodes the row block as one ``[BLOCK_N, 8, 64]`` tensor
  and stores it once (4 a loop iteration), but holds the whole block in registers: 8 B of
  stack at 32-row blocks, ~170 B at 64 (cross-compile). Which is faster is for the H200 sweep.

Shared memory: q 64 KB + ``NUM_STAGES x BLOCK_N x 648`` B of bytes + ``E_BUFS x BLOCK_N`` KB of
decoded rows + P ``64 x BLOCK_N x 2`` B + the bias ring and the maxima (the sm_90 opt-in limit is
232,448 B). Configs: 32-row blocks, 4 stages, two decoded buffers (~215 KB; the default) or
64-row blocks, 2 stages, one decoded buffer (~221 KB).

Variants (``variant=`` of the launchers, ``VARIANTS``): ``v0``, this module's kernel (the one
described above), and ``ws`` (``sparse_attention_fp8_ws.py``, the default since session 21): the
same bytes and decode in 4 decoder warps beside the 8 MMA warps of the bf16 ``ws`` kernel, so the
decode of one block overlaps the MMAs of the previous ones.

Status: routed (``dsv4_ops/ops/attention_sm90.py``) for FP8 window pages from batch 1 on, for a bf16
window ring from batch 64 on. H200, v0 (session 13, 32 x 4 stages, two decoded buffers): CSA 32K
B=64 53.3 us against the tl kernel's 57.7, B=128 83.7 against 97.7; batch 1 22.2 against 20.1.
ws (session 21): B=1 19.2 against 20.3, B=64 44.0, B=128 72.0 (BENCHMARKS.md, session 21). Exact check, GPU tests:
``benchmarks/gluon_fp8_attention_check.py``, ``tests/ops/test_sparse_attention_sm90_fp8.py``;
cross-compile: ``tests/test_gluon_fp8_cross_compile.py``.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma, warpgroup_mma_init,
                                                             warpgroup_mma_wait)

from ..triton._launch import sm_count
from .sparse_attention import _entry_index, _epilogue, _online_softmax, _split_range, combine_launch
from ..triton.sparse_attention import _LOG2E, attention_config

__all__ = ["sparse_attention_gluon_fp8", "sparse_attention_gluon_fp8_kernel", "gluon_fp8_launch", "serves",
           "gluon_fp8_config", "fp8_smem_bytes", "NUM_WARPS", "SMEM_LIMIT", "VARIANTS", "DEFAULT_VARIANT"]

NUM_WARPS = 8  # two warpgroups: the layouts below assume it
BLOCK_H, HEAD_DIM, NOPE, ROPE = 64, 512, 448, 64
DATA_BYTES, SCALE_BYTES = NOPE + 2 * ROPE, 8  # 576 + 8: fp8_cache.KVLayout(512, 64)
ENTRY_BYTES = DATA_BYTES + SCALE_BYTES
SMEM_LIMIT = 232448
# the decode's stores: 0 one a 64-channel block (_decode_block; membar puts a CTA barrier before
# each, 8 a row block; no spills), 1 one store a row block (_decode_block_3d; 2 barriers fewer
# than 8 but spills: 8 B of stack at 32-row blocks, ~170 B at 64; a sweep option)
ONE_STORE_DEFAULT = 0


@gluon.jit
def _entry_offsets(i, PAGE: gl.constexpr, DATA_BYTES: gl.constexpr, SCALE_BYTES: gl.constexpr):
    """Byte offsets of entries ``i`` (>= 0) from their token's first page, in a cache of contiguous
    pages under 2^31 bytes a token (``_fp8_cache`` checks both; ``serves`` leaves other caches to the
    Triton kernel): the 576 data
    bytes and the 8 scale bytes in the page footer. Unsigned 32-bit with constant strides (a shift and
    a mask for a power-of-two page): every lane of a row issues its copies, so this runs 8 times a
    block in each decoder thread."""
    u = i.to(gl.uint32)
    page = u // PAGE
    t = u - page * PAGE
    base = page * (PAGE * (DATA_BYTES + SCALE_BYTES))
    return base + t * DATA_BYTES, base + PAGE * DATA_BYTES + t * SCALE_BYTES


@gluon.jit
def _entry_pointers(v, idx, hi, W, N_KV, N_CMP, kv_row0, cmp_row0, FP8: gl.constexpr, KV_PAGE: gl.constexpr,
                    CMP_PAGE: gl.constexpr, DATA_BYTES: gl.constexpr, SCALE_BYTES: gl.constexpr):
    """(data, scales, copied) of entries ``v`` in ``v``'s layout: the addresses of their 576 data bytes
    and of their 8 footer scale bytes, and which lanes are copied (FP8-valid; the others are zero-filled)."""
    in_w = v < W
    valid = (v < hi) & (idx >= 0) & (idx < gl.where(in_w, N_KV, N_CMP))
    if FP8 == 2:
        lane8 = valid
        i8 = gl.where(lane8, idx, 0)
        # each segment's offsets whole, then a select: selecting the page size first turns both
        # divisions by a constant into one by a register (a ~25-instruction integer division a row)
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
    """cp.async the codes and rope bytes at ``data`` into one ring slot, one row a warp (the calling
    partition's warps); rows not copied: zeros, no memory read. ``data``, ``lane8``: any layout
    (converted to the copies' own)."""
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


@gluon.jit
def _issue_bytes(codes_buf, rope_buf, scl_buf, v, idx, hi, W, N_KV, N_CMP, kv_row0, cmp_row0,
                 FP8: gl.constexpr, KV_PAGE: gl.constexpr, CMP_PAGE: gl.constexpr,
                 NOPE: gl.constexpr, DATA_BYTES: gl.constexpr, SCALE_BYTES: gl.constexpr):
    """cp.async the raw FP8 entries of ``v`` (codes, rope, scales; lanes not FP8-valid: zeros,
    no memory read) into one ring slot; ``v`` in the copies' row layout (one row a warp)."""
    data, scl, lane8 = _entry_pointers(v, idx, hi, W, N_KV, N_CMP, kv_row0, cmp_row0, FP8, KV_PAGE, CMP_PAGE,
                                       DATA_BYTES, SCALE_BYTES)
    scl_l: gl.constexpr = gl.BlockedLayout([1, SCALE_BYTES], [1, 32], [gl.num_warps(), 1], [1, 0])
    _copy_data_bytes(codes_buf, rope_buf, data, lane8, NOPE)
    _copy_scale_bytes(scl_buf, scl, lane8, scl_l, SCALE_BYTES)


@gluon.jit
def _store_bias(bias_buf, v, idx, hi, W, N_KV, N_CMP):
    """The score bias of entries ``v``: 0, or -inf for invalid ones (-1, out of range, past hi)."""
    in_w = v < W
    valid = (v < hi) & (idx >= 0) & (idx < gl.where(in_w, N_KV, N_CMP))
    bias_buf.store(gl.where(valid, 0.0, float("-inf")))


@gluon.jit
def _e4m3x4_bf16(code):
    """``fp8_codec._e4m3x4_bf16`` (the tl kernel's ``E4M3_HW`` 4 decode), the same PTX: four e4m3
    codes of one 32-bit register -> four exact bf16 values (``code * 2^-120`` by bit moves, then
    one ``bf16x2`` multiply by ``2^120`` per two values)."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t0, t1, k;
        mov.b32 k, 0x7B807B80;
        prmt.b32 t0, $2, 0, 0x9180;
        prmt.b32 t1, $2, 0, 0xB3A2;
        shl.b32 t0, t0, 4;
        shl.b32 t1, t1, 4;
        and.b32 t0, t0, 0x87F087F0;
        and.b32 t1, t1, 0x87F087F0;
        mul.rn.bf16x2 $0, t0, k;
        mul.rn.bf16x2 $1, t1, k;
        }""",
        constraints="=r,=r,r", args=[code], dtype=gl.bfloat16, is_pure=True, pack=4)


@gluon.jit
def _rows_3d(codes_buf, rope_buf, BLOCK_N: gl.constexpr):
    """One byte slot's views for ``_decode_block_3d``: the codes as ``[BLOCK_N, 8, 64]`` u8, the
    rope bytes as ``[BLOCK_N, 64]`` bf16 (row slices of these views are what the ws decoder takes)."""
    return codes_buf.reshape([BLOCK_N, 8, 64]), rope_buf._reinterpret(gl.bfloat16, [BLOCK_N, 64], rope_buf.layout)


@gluon.jit
def _decode_block_3d(codes3, rope16, scl_buf, e_buf, start, W, widx_row, swi_w, kv_row0, skv_n, N_KV, hi,
                     FP8: gl.constexpr, NOPE: gl.constexpr, BLOCK_N: gl.constexpr, DECODE: gl.constexpr,
                     L3: gl.constexpr):
    """``_decode_block`` as one ``[BLOCK_N, 8, 64]`` tensor and ONE store of the whole row block
    (the per-block stores of ``_decode_block`` each get a CTA barrier from Triton's membar pass,
    which does not tell the column slices of one buffer apart). ``codes3``, ``rope16``: the slot's
    views (``_rows_3d``). Block 7 is the rope (broadcast over the block lanes, selected by ``where``).
    ``L3``: the tensor's layout (v0: ``L3_LANES``, a warp reads 4 blocks x 64 codes of a row, 8 a
    lane, so the row's 512 bytes come without bank conflicts; the ws decoder: ``L3_ROW``, a row's
    8 blocks in one thread's registers, which folds the rope's ``where`` away at compile time)."""
    code = codes3.load(L3)  # block 7: zero-filled bytes
    sbyte = scl_buf.load(gl.SliceLayout(2, L3))  # [BLOCK_N, 8] (byte 7: the pad)
    scale = (sbyte.to(gl.int16) << 7).to(gl.bfloat16, bitcast=True)
    if DECODE == 4:
        val = _e4m3x4_bf16(code)
    else:
        c = code.to(gl.int16)
        bits = ((c & 0x80) << 8) | ((c & 0x7F) << 4)
        val = bits.to(gl.bfloat16, bitcast=True) * gl.full([BLOCK_N, 8, 64], 2.0**120, gl.bfloat16, L3)
    val = val * gl.expand_dims(scale, 2)
    rope = rope16.load(gl.SliceLayout(1, L3))
    blk = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    is_rope = gl.expand_dims(gl.expand_dims(blk, 0), 2) == NOPE // 64
    val = gl.where(is_rope, gl.expand_dims(rope, 1), val)
    if FP8 == 1:
        vd = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        wi = gl.load(widx_row + vd * swi_w, mask=vd < W, other=-1)
        win = (vd < W) & (vd < hi) & (wi >= 0) & (wi < N_KV)
        wrow = kv_row0 + gl.where(win, wi, 0).to(gl.int64) * skv_n
        ch = gl.expand_dims(gl.expand_dims(blk, 0), 2) * 64 + gl.expand_dims(
            gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3))), 0), 1)
        win3 = gl.expand_dims(gl.expand_dims(win, 1), 2)
        ew = gl.load(gl.expand_dims(gl.expand_dims(wrow, 1), 2) + ch, mask=win3, other=0.0)
        val = gl.where(win3, ew.to(gl.bfloat16), val)
    e_buf.store(gl.reshape(val, [BLOCK_N, 8 * 64]))


@gluon.jit
def _decode_block(codes_buf, rope_buf, scl_buf, e_buf, start, W, widx_row, swi_w, kv_row0, skv_n, N_KV, hi,
                  FP8: gl.constexpr, NOPE: gl.constexpr, BLOCK_N: gl.constexpr, DECODE: gl.constexpr):
    """Raw bytes of one ring slot -> bf16 rows in ``e_buf`` (NVMMA, what the wgmma reads), one
    64-channel block at a time: 8 codes a thread (one 8-byte shared load), x the block's scale,
    16 bytes stored; the rope as bf16. Mode 1: window lanes from the float window rows."""
    dec_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    offs_c = gl.arange(0, 64, layout=gl.SliceLayout(0, dec_l))
    if FP8 == 1:
        # window lanes of this block: their row pointers (the indices again, an L1/L2 hit)
        vd = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, dec_l))
        wi = gl.load(widx_row + vd * swi_w, mask=vd < W, other=-1)
        win = (vd < W) & (vd < hi) & (wi >= 0) & (wi < N_KV)
        wrow = kv_row0 + gl.where(win, wi, 0).to(gl.int64) * skv_n
    for k in gl.static_range(NOPE // 64):
        code = codes_buf.slice(64 * k, 64, dim=1).load(dec_l)  # [BLOCK_N, 64] u8
        sbyte = scl_buf.slice(k, 1, dim=1).load(dec_l)  # [BLOCK_N, 1] u8, broadcast
        scale = (sbyte.to(gl.int16) << 7).to(gl.bfloat16, bitcast=True)  # 2^(s - 127), s = 0: +0
        if DECODE == 4:
            val = _e4m3x4_bf16(code)
        else:  # the same bits in Gluon (fp8_codec.e4m3_to, HW 3)
            c = code.to(gl.int16)
            bits = ((c & 0x80) << 8) | ((c & 0x7F) << 4)
            val = bits.to(gl.bfloat16, bitcast=True) * gl.full([BLOCK_N, 64], 2.0**120, gl.bfloat16, dec_l)
        val = val * scale
        if FP8 == 1:
            ew = gl.load(wrow[:, None] + (64 * k + offs_c)[None, :], mask=win[:, None], other=0.0)
            val = gl.where(win[:, None], ew.to(gl.bfloat16), val)
        e_buf.slice(64 * k, 64, dim=1).store(val)
    rope = rope_buf._reinterpret(gl.bfloat16, [BLOCK_N, 64], rope_buf.layout).load(dec_l)
    if FP8 == 1:
        ew = gl.load(wrow[:, None] + (NOPE + offs_c)[None, :], mask=win[:, None], other=0.0)
        rope = gl.where(win[:, None], ew.to(gl.bfloat16), rope)
    e_buf.slice(NOPE, 64, dim=1).store(rope)


@gluon.jit
def sparse_attention_gluon_fp8_kernel(
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
    E_BUFS: gl.constexpr, NUM_SPLITS: gl.constexpr, FP8: gl.constexpr, DECODE: gl.constexpr,
    ONE_STORE: gl.constexpr,
    KV_PAGE: gl.constexpr, CMP_PAGE: gl.constexpr, NOPE: gl.constexpr, DATA_BYTES: gl.constexpr,
    SCALE_BYTES: gl.constexpr,
):
    gl.static_assert(gl.num_warps() == 8, "two warpgroups")
    gl.static_assert(NUM_STAGES >= 2)
    gl.static_assert((E_BUFS == 1) | (E_BUFS == 2))
    gl.static_assert(D == 512)
    gl.static_assert(NOPE == 448)
    gl.static_assert(SCALE_BYTES == 8)
    pid_t = gl.program_id(0)  # query token b (S = 1)
    pid_sp = gl.program_id(1)  # split of the entry list
    scale_log2e = scale_log2e.to(gl.float32)
    b = pid_t.to(gl.int64)
    NBIAS: gl.constexpr = NUM_STAGES + 1  # a block's bias lives from its issue to its softmax

    # q: a warp reads 512 contiguous bytes of a row, 16 B a thread
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    # gathers: one row a warp (the rows' layout shared by the three byte gathers)
    codes_l: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [8, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, codes_l)
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_N // 2, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, D // 2, 16])
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D], gl.bfloat16)
    e_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16)
    flat_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    red_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    row_l: gl.constexpr = gl.SliceLayout(1, s_l)
    pair_l: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [8, 0]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0], [0, 0]], block_bases=[], shape=[BLOCK_H, 2])
    bias_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])

    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, q_l))
    offs_hq = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_l))
    q = gl.load(q_ptr + b * sq_b + offs_hq[:, None] * sq_h + offs_d[None, :])
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D], q_sl, q)
    codes_ring = gl.allocate_shared_memory(gl.uint8, [NUM_STAGES, BLOCK_N, 512], flat_sl)
    rope_ring = gl.allocate_shared_memory(gl.uint8, [NUM_STAGES, BLOCK_N, 128], flat_sl)
    scl_ring = gl.allocate_shared_memory(gl.uint8, [NUM_STAGES, BLOCK_N, SCALE_BYTES], flat_sl)
    e_smem = gl.allocate_shared_memory(gl.bfloat16, [E_BUFS, BLOCK_N, D], e_sl)
    bias_ring = gl.allocate_shared_memory(gl.float32, [NBIAS, BLOCK_N], bias_sl)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], p_sl)
    red_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H, 2], red_sl)

    lo, hi, n_blocks = _split_range(cmp_len_ptr + b * scl_b, N_CMP, W, K, pid_sp, NUM_SPLITS, BLOCK_N)

    kv_row0 = kv_ptr + b * skv_b
    cmp_row0 = cmp_ptr + b * sc_b
    widx_row = kv_idx_ptr + b * swi_b
    cidx_row = cmp_idx_ptr + b * sci_b

    # prologue: blocks 0 .. NUM_STAGES - 1 in flight (blocks past hi: all lanes masked, no traffic)
    v = lo + gl.arange(0, BLOCK_N, layout=rows_l)
    idx = _entry_index(v, W, K, widx_row, swi_w, cidx_row, sci_k)
    for st in gl.static_range(NUM_STAGES):
        _store_bias(bias_ring.index(st), v, idx, hi, W, N_KV, N_CMP)
        _issue_bytes(codes_ring.index(st), rope_ring.index(st), scl_ring.index(st), v, idx, hi,
                     W, N_KV, N_CMP, kv_row0, cmp_row0, FP8, KV_PAGE, CMP_PAGE, NOPE, DATA_BYTES, SCALE_BYTES)
        cp.commit_group()
        v = v + BLOCK_N
        idx = _entry_index(v, W, K, widx_row, swi_w, cidx_row, sci_k)
    # block 0: decoded before the loop
    cp.wait_group(NUM_STAGES - 1)  # this thread's copies of block 0 landed
    gl.thread_barrier()  # ... every thread's
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [8, 1, 1], [2, 1, 0])  # ONE_STORE's (L3_LANES)
    if ONE_STORE:
        codes3, rope16 = _rows_3d(codes_ring.index(0), rope_ring.index(0), BLOCK_N)
        _decode_block_3d(codes3, rope16, scl_ring.index(0), e_smem.index(0), lo, W,
                         widx_row, swi_w, kv_row0, skv_n, N_KV, hi, FP8, NOPE, BLOCK_N, DECODE, L3)
    else:
        _decode_block(codes_ring.index(0), rope_ring.index(0), scl_ring.index(0), e_smem.index(0), lo, W, widx_row,
                      swi_w, kv_row0, skv_n, N_KV, hi, FP8, NOPE, BLOCK_N, DECODE)
    _store_bias(bias_ring.index(NUM_STAGES % NBIAS), v, idx, hi, W, N_KV, N_CMP)
    fence_async_shared()  # decoded rows visible to wgmma (async proxy)
    gl.thread_barrier()  # ... every thread's; every thread done reading byte slot 0
    # v is now block NUM_STAGES's entries: refill slot 0
    _issue_bytes(codes_ring.index(0), rope_ring.index(0), scl_ring.index(0), v, idx, hi, W, N_KV, N_CMP, kv_row0, cmp_row0, FP8,
                 KV_PAGE, CMP_PAGE, NOPE, DATA_BYTES, SCALE_BYTES)
    cp.commit_group()
    v = v + BLOCK_N
    idx = _entry_index(v, W, K, widx_row, swi_w, cidx_row, sci_k)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, row_l)
    l_i = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_l)  # per column, summed at the end (v0)
    acc = warpgroup_mma_init(gl.zeros([BLOCK_H, D], gl.float32, o_l))
    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_l)
    for j in range(n_blocks):
        e = e_smem.index(j % E_BUFS)
        s = warpgroup_mma(q_smem, e.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        bias = bias_ring.index(j % NBIAS).load(gl.SliceLayout(0, s_l))
        s, acc = warpgroup_mma_wait(0, deps=[s, acc])  # also P @ E of block j - 1 (this warpgroup's)
        logits = s * scale_log2e + bias[None, :]
        m_wg = gl.max(gl.reshape(logits, [BLOCK_H, 2, BLOCK_N // 2]), 2)
        red_smem.store(m_wg)
        cp.wait_group(NUM_STAGES - 1)  # this thread's copies of block j + 1 landed
        # B1: maxima written; block j + 1's bytes visible; every warpgroup done with P and E[j - 1]
        gl.thread_barrier()
        m_blk = gl.convert_layout(gl.max(red_smem.load(pair_l), 1), row_l, assert_trivial=True)
        p, alpha, l_i, m_i = _online_softmax(logits, m_i, m_blk, l_i)
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()  # B2: P visible to wgmma
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l), assert_trivial=True)[:, None]
        acc = warpgroup_mma(p_smem, e, acc, is_async=True)
        if E_BUFS == 1:  # one decoded buffer: P @ E[j] must be done (both warpgroups) before block j + 1 lands there
            acc = warpgroup_mma_init(warpgroup_mma_wait(0, deps=[acc]))  # (the loop-carried type)
            gl.thread_barrier()
        # decode block j + 1 (with two buffers: while P @ E[j] runs)
        nslot = (j + 1) % NUM_STAGES
        if ONE_STORE:
            codes3, rope16 = _rows_3d(codes_ring.index(nslot), rope_ring.index(nslot), BLOCK_N)
            _decode_block_3d(codes3, rope16, scl_ring.index(nslot),
                             e_smem.index((j + 1) % E_BUFS), lo + (j + 1) * BLOCK_N, W, widx_row, swi_w, kv_row0,
                             skv_n, N_KV, hi, FP8, NOPE, BLOCK_N, DECODE, L3)
        else:
            _decode_block(codes_ring.index(nslot), rope_ring.index(nslot), scl_ring.index(nslot),
                          e_smem.index((j + 1) % E_BUFS), lo + (j + 1) * BLOCK_N, W, widx_row, swi_w, kv_row0, skv_n,
                          N_KV, hi, FP8, NOPE, BLOCK_N, DECODE)
        # the bias of block j + 1 + NUM_STAGES (its slot's last reader, block j, read it before B1)
        _store_bias(bias_ring.index((j + 1 + NUM_STAGES) % NBIAS), v, idx, hi, W, N_KV, N_CMP)
        fence_async_shared()
        gl.thread_barrier()  # B3: E[j + 1] visible; every thread done reading byte slot nslot
        # refill it with block j + 1 + NUM_STAGES
        _issue_bytes(codes_ring.index(nslot), rope_ring.index(nslot), scl_ring.index(nslot), v, idx, hi, W, N_KV, N_CMP, kv_row0,
                     cmp_row0, FP8, KV_PAGE, CMP_PAGE, NOPE, DATA_BYTES, SCALE_BYTES)
        cp.commit_group()
        v = v + BLOCK_N
        idx = _entry_index(v, W, K, widx_row, swi_w, cidx_row, sci_k)
    acc = warpgroup_mma_wait(0, deps=[acc])
    cp.wait_group(0)  # no copy may outlive the program's shared memory
    _epilogue(acc, m_i, gl.sum(l_i, 1), sink_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, b, pid_t, pid_sp,
              so_b, so_h, s_l, o_l, D, BLOCK_H, NUM_SPLITS)


def fp8_smem_bytes(block_n: int, num_stages: int, e_bufs: int, variant: str = "v0") -> int:
    """The kernel's explicit shared memory (the compiler may add a little for layout conversions).
    ws: no bias ring (the scorer computes the bias), ``e_bufs`` decoded slots (its ``E_STAGES``), P two deep
    and the rescale factors and final row stats handed between its two MMA warpgroups."""
    if variant == "v0":
        extra = (num_stages + 1) * block_n * 4 + BLOCK_H * block_n * 2 + BLOCK_H * 2 * 4  # bias ring, P, maxima
    else:
        extra = 2 * BLOCK_H * block_n * 2 + 4 * BLOCK_H * 4
    return (BLOCK_H * HEAD_DIM * 2 + num_stages * block_n * (512 + 128 + SCALE_BYTES)
            + e_bufs * block_n * HEAD_DIM * 2 + extra)


# variant -> (BLOCK_N, NUM_STAGES byte blocks, decoded buffers or None: two when they fit) unless told.
# v0: the session-13 kernel; ws: sparse_attention_fp8_ws.py (decoder warps beside the MMA warps)
VARIANTS = {"v0": (32, 4, None), "ws": (32, 2, 3)}
DEFAULT_VARIANT = "ws"


def gluon_fp8_config(B: int, max_entries: int, sms: int = 132, num_splits: int | None = None,
                     block_n: int | None = None, num_stages: int | None = None, e_bufs: int | None = None,
                     variant: str = DEFAULT_VARIANT) -> dict:
    """Block rows, byte-ring depth, decoded buffers and splits (the tl kernel's split rule).
    ``e_bufs`` None: the variant's default (v0: two decoded buffers when they fit ``SMEM_LIMIT``)."""
    if variant not in VARIANTS:
        raise _err(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    d_block_n, d_stages, d_bufs = VARIANTS[variant]
    block_n = d_block_n if block_n is None else block_n
    num_stages = d_stages if num_stages is None else num_stages
    if e_bufs is None:
        e_bufs = d_bufs
    if e_bufs is None:
        e_bufs = 2 if fp8_smem_bytes(block_n, num_stages, 2) <= SMEM_LIMIT else 1
    if variant == "ws" and (e_bufs < 2 or num_stages < 1):
        raise _err(f"variant ws needs e_bufs >= 2 and num_stages >= 1, got {e_bufs} and {num_stages}")
    cfg = attention_config(B, 1, BLOCK_H, HEAD_DIM, max_entries, sms, num_splits)
    return dict(BLOCK_N=block_n, NUM_STAGES=num_stages, E_BUFS=e_bufs, NUM_SPLITS=cfg["NUM_SPLITS"], variant=variant)


def _err(msg: str) -> ValueError:
    return ValueError(f"sparse_attention_gluon_fp8: {msg}")


def _fp8_cache(name: str, t: torch.Tensor) -> int:
    """Check an FP8 page cache of 512-wide entries (448 nope + 64 rope, 584 B); its page size."""
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
    if q.dim() != 4:
        raise _err(f"q must be [B, S, H, D], got {tuple(q.shape)}")
    B, S, H, D = q.shape
    if q.dtype != torch.bfloat16:
        raise _err(f"q must be bf16, got {q.dtype}")
    if H != BLOCK_H:
        raise _err(f"H (q.shape[2]) must be {BLOCK_H}, got {H}")
    if D != HEAD_DIM:
        raise _err(f"D (q.shape[3]) must be {HEAD_DIM}, got {D}")
    if S != 1:
        raise _err(f"S (q.shape[1]) must be 1 (decode), got {S}")
    for name, t in (("kv_idx", kv_idx), ("cmp_idx", cmp_idx), ("cmp_len", cmp_len)):
        if t.dtype != torch.int32:
            raise _err(f"{name} must be int32, got {t.dtype}")
    if sink is not None and sink.numel() != H:
        raise _err(f"sink must have {H} entries, got {sink.numel()}")
    if kv.dim() == 4:
        fp8 = 2
    elif kv.dim() == 3 and kv.dtype == torch.bfloat16 and kv.shape[-1] == D:
        fp8 = 1
    else:
        raise _err(f"kv must be an FP8 page cache (uint8, rank 4) or a bf16 window [B, N, {D}], got {kv.dtype} "
                   f"{tuple(kv.shape)}")
    if cmp.dim() != 4:
        if fp8 == 2 and cmp.dim() == 3 and cmp.shape[1] == 0:
            return fp8  # a sliding-window layer: no pool (the window pages stand in)
        raise _err(f"cmp must be an FP8 page cache (uint8, rank 4), got {cmp.dtype} {tuple(cmp.shape)} "
                   "(float pools: lowering.gluon.sparse_attention)")
    return fp8


def gluon_fp8_launch(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale, num_splits=None, block_n=None, num_stages=None,
                     out=None, e_bufs=None, decode=4, one_store=None, variant=DEFAULT_VARIANT, codes_swizzle=None):
    """(out, [(kernel, grid, args, meta), ...]) of one call: the attention and, when split,
    ``combine_kernel``; the cross-compile test compiles these without a GPU. ``codes_swizzle`` (ws, the
    one-store decode): the byte ring's rows swizzled against bank conflicts (None: ``CODES_SWIZZLE``)."""
    fp8 = _check(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink)
    B, _, H, D = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    sink = sink.contiguous()
    W, K = kv_idx.shape[-1], cmp_idx.shape[-1]
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
    if fp8 == 2 and (n_kv == 0 or W == 0):
        kv, kv_page = cmp, cmp_page  # never read
    if fp8 == 1 and kv.numel() == 0:
        kv = q  # a bf16 pointer, never read
    if n_kv == 0 and n_cmp == 0:
        raise _err("kv and cmp are both empty (no rows to attend to)")
    if W == 0:
        kv_idx = cmp_len[..., None]
    if K == 0:
        cmp_idx = cmp_len[..., None]
    cfg = gluon_fp8_config(B, W + (K if K else n_cmp), sm_count(q.device), num_splits, block_n, num_stages, e_bufs,
                           variant)
    smem = fp8_smem_bytes(cfg["BLOCK_N"], cfg["NUM_STAGES"], cfg["E_BUFS"], variant)
    if smem > SMEM_LIMIT:
        raise _err(f"block_n={cfg['BLOCK_N']} x num_stages={cfg['NUM_STAGES']} x {cfg['E_BUFS']} decoded buffers "
                   f"({variant}) needs {smem} B of shared memory (> {SMEM_LIMIT})")
    splits = cfg["NUM_SPLITS"]
    if out is None:
        out = torch.empty_like(q)
    if out.stride(-1) != 1:
        raise _err("out must be contiguous in its last dim")
    if splits > 1:
        part_m = torch.empty((B, splits, H), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((B, splits, H, D), dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused
    args = (q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, out, part_m, part_l, part_acc, float(scale) * _LOG2E,
            n_kv if W else 0, n_cmp, W, K,
            q.stride(0), q.stride(2), kv.stride(0), kv.stride(1), kv_idx.stride(0), kv_idx.stride(2),
            cmp.stride(0), cmp.stride(1), cmp_idx.stride(0), cmp_idx.stride(2), cmp_len.stride(0),
            out.stride(0), out.stride(2))
    meta = dict(D=D, BLOCK_H=BLOCK_H, BLOCK_N=cfg["BLOCK_N"], NUM_STAGES=cfg["NUM_STAGES"], NUM_SPLITS=splits,
                FP8=fp8, DECODE=decode, KV_PAGE=kv_page if fp8 == 2 else 1, CMP_PAGE=cmp_page, NOPE=NOPE,
                DATA_BYTES=DATA_BYTES, SCALE_BYTES=SCALE_BYTES, num_warps=NUM_WARPS)
    if variant == "ws":
        from . import sparse_attention_fp8_ws as ws  # noqa: PLC0415 (it imports this module's helpers)
        if one_store is None:  # mode 1 loads window rows inside the decode: the 3D decode spills there
            one_store = ws.ONE_STORE_ROWS if fp8 == 2 else 0
        if one_store and (one_store % 8 or cfg["BLOCK_N"] % one_store):
            raise _err(f"variant ws decodes one_store rows at a time: 0 (a 64-channel block at a time) or a "
                       f"multiple of 8 dividing block_n={cfg['BLOCK_N']}, got {one_store}")
        if codes_swizzle is None:
            codes_swizzle = ws.CODES_SWIZZLE
        meta.update(L3_ROW=ws.L3_ROW, CODES_SWIZZLE=bool(codes_swizzle and one_store))
        kernel = ws.sparse_attention_gluon_fp8_ws_kernel
        meta.update(E_STAGES=cfg["E_BUFS"], DECODER_WARPS=ws.DECODER_WARPS, DECODER_REGS=ws.DECODER_REGS,
                    HELPER_REGS=ws.HELPER_REGS, Q_REG_COLS=ws.Q_REG_COLS, STAGED_OUT=ws.STAGED_OUT,
                    DIAG_NO_DECODE=ws.DIAG_NO_DECODE, DIAG_NO_COPY=ws.DIAG_NO_COPY, num_warps=ws.NUM_WARPS)
    else:
        kernel = sparse_attention_gluon_fp8_kernel
        meta.update(E_BUFS=cfg["E_BUFS"])
        if one_store is None:
            one_store = ONE_STORE_DEFAULT
    meta.update(ONE_STORE=int(one_store))
    launches = [(kernel, (B, splits), args, meta)]
    if splits > 1:
        launches.append(combine_launch(part_m, part_l, part_acc, sink, out))
    return out, launches


def sparse_attention_gluon_fp8(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale, num_splits=None, *,
                               block_n=None, num_stages=None, out=None, e_bufs=None, decode=4,
                               one_store=None, variant=DEFAULT_VARIANT, codes_swizzle=None) -> torch.Tensor:
    """``lowering.triton.sparse_attention.sparse_attention`` for bf16 decode over FP8 caches at
    V4-Flash widths (H = 64, D = 512, S = 1; FP8 mode 2: FP8 window and pool pages, mode 1: bf16
    window rows and an FP8 pool); ValueError for anything else."""
    out, launches = gluon_fp8_launch(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale, num_splits, block_n,
                                     num_stages, out, e_bufs, decode, one_store, variant, codes_swizzle)
    for kernel, grid, args, meta in launches:
        kernel[grid](*args, **meta)
    return out
