"""Triton compressor emission fused with RMSNorm, RoPE and the pool write.
Contract: ``dsv4_ops.reference.compress``.

Grid ``(B * E,)``: one program per ``(b, e)`` emit slot; ``emit[b, e] = -1`` returns at once.
Everything after the pooling needs the whole pooled row (the RMSNorm's sum, the rope pairs, the
FP8 block scales), so one program owns all ``d`` channels (``BLOCK_D >= d``) and the block's
intermediate never leaves registers. For block ``i = emit[b, e]`` the program walks the
block's slots in chunks of ``BLOCK_M`` rows:

- slot rows come from ``new_*`` (row ``p - start``) when position ``p >= start``, else from the
  ring (slot ``p % R``), exactly as the reference gathers them; with ``overlap`` (CSA) there
  are ``2m`` slots: the first halves (channels ``[0, d)``) of block ``i-1``'s rows, then the
  second halves (``[d, 2d)``) of block ``i``'s; block ``-1``'s slots are masked (weight 0);
- per-channel softmax over the slots, online (running max / sum / weighted sum, fp32), so the
  ``m = 128`` HCA block never needs ``128 x d`` registers;
- RMSNorm with the weight over the ``d`` pooled channels, then interleaved RoPE of the last
  ``r = 2 * half`` channels at position ``m * i`` (``cos``/``sin`` row ``m * i``): the channel
  vector is viewed as ``[BLOCK_D / 2, 2]`` pairs and split into even / odd lanes. Lanes are
  shifted by ``PAR = (d - r) % 2`` so that every rope pair is a lane pair;
- one rounding to ``pool.dtype`` and a store to ``pool[b, i]`` (skipped when ``i >= N``);
  or, into an FP8 pool (``FMT`` 1: KV format, 2: indexer keys; ``dsv4_ops/reference/fp8_cache.py``),
  quantisation in registers and a store of the entry's data and footer-scale rows (indexer keys
  are Hadamard-rotated first, by the same butterfly as the reference).

Paged pools (``PAGED``, a ``block_table [B, P]``; ``dsv4_ops.reference.ops.paged_rows``): the
entry's page is looked up in the row's block-table row, and dim 0 of the pool is the page, at its
own stride (which may be padded, as FlashMLA pads FP8 pages to a multiple of 576 bytes). A
constexpr switch, so the per-row kernel is unchanged.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# by name, not as `fc.<name>`: Inductor copies a wrap_triton kernel's source with the jit
# functions it names, never a module attribute (NameError 'fc' in a compiled graph)
from .fp8_codec import e4m3_encode, pow2, scale_exponent, store_kv_entry
from .launch import Launch, block_table_args, launch, next_pow2

__all__ = ["compress", "compress_kernel", "compress_config", "compress_launch"]


@triton.jit
def _slot_ptrs(pos, fresh, nrow, rrow, chan, new_row0, sn_s, sn_c, ring_row0, sr_r, sr_c):
    """[BLOCK_M, BLOCK_D] pointers: new rows for fresh positions, ring slots otherwise."""
    from_new = new_row0 + nrow[:, None] * sn_s + chan * sn_c
    from_ring = ring_row0 + rrow[:, None] * sr_r + chan * sr_c
    return tl.where(fresh[:, None], from_new, from_ring)


@triton.jit
def _store_keys_fp8(y, data, scales, BLOCK_D: tl.constexpr):
    """Rotate the indexer key ``y [BLOCK_D]`` (``BLOCK_D == d``, a power of two) by the fast
    Walsh-Hadamard butterfly, then quantise it with one fp32 power-of-two scale."""
    for stage in tl.static_range(12):  # h = 2^stage < BLOCK_D: log2(BLOCK_D) stages
        if (1 << stage) < BLOCK_D:
            pairs = tl.permute(tl.reshape(y, (BLOCK_D // (2 << stage), 2, 1 << stage)), (0, 2, 1))  # [.., h, 2]
            a, b = tl.split(pairs)
            y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (BLOCK_D,))
    y = y * (BLOCK_D ** -0.5)
    exp = scale_exponent(tl.max(tl.abs(y), 0))
    j = tl.arange(0, BLOCK_D)
    tl.store(data + j, e4m3_encode(y * pow2(254 - exp)).to(tl.uint8))
    q = tl.arange(0, 4)
    tl.store(scales + q, ((exp << 23) >> (8 * q) & 0xFF).to(tl.uint8))


@triton.jit
def compress_kernel(
    ring_kv_ptr, ring_gate_ptr, new_kv_ptr, new_gate_ptr, start_ptr, emit_ptr,
    norm_w_ptr, cos_ptr, sin_ptr, pool_ptr, block_table_ptr,
    eps,
    E, S, R, N, P, d, half, ratio, NUM_PAGES,
    srk_b, srk_r, srk_c,
    srg_b, srg_r, srg_c,
    snk_b, snk_s, snk_c,
    sng_b, sng_s, sng_c,
    sst_b,
    se_b, se_e,
    snw,
    scos_p, scos_h,
    ssin_p, ssin_h,
    sp_b, sp_n, sp_c,
    sbt_b, sbt_p,
    PAGE, NOPE, DATA_BYTES, SCALE_BYTES,
    OVERLAP: tl.constexpr, PAR: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    FMT: tl.constexpr, BLOCK_SB: tl.constexpr, PAGED: tl.constexpr,
):
    pid = tl.program_id(0)  # b * E + e
    b = (pid // E).to(tl.int64)
    e = (pid % E).to(tl.int64)
    blk = tl.load(emit_ptr + b * se_b + e * se_e).to(tl.int64)
    if (blk >= 0) & (blk < N):
        st = tl.load(start_ptr + b * sst_b).to(tl.int64)
        lane = tl.arange(0, BLOCK_D)
        ch = lane - PAR  # channel of each lane
        ch_ok = (ch >= 0) & (ch < d)
        if OVERLAP:
            n_slots = 2 * ratio
        else:
            n_slots = ratio

        m_i = tl.full([BLOCK_D], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_D], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for v0 in range(0, n_slots, BLOCK_M):
            v = v0 + tl.arange(0, BLOCK_M)
            if OVERLAP:
                prev = v < ratio
                pos = tl.where(prev, (blk - 1) * ratio + v, blk * ratio + (v - ratio))
                choff = tl.where(prev, 0, d)
            else:
                pos = blk * ratio + v
                choff = tl.zeros([BLOCK_M], tl.int32)
            ok = (v < n_slots) & (pos >= 0)
            fresh = (pos >= st) & (S > 0)
            nrow = tl.minimum(tl.maximum(pos - st, 0), S - 1)
            rrow = tl.where(pos >= 0, pos % R, 0)
            chan = choff[:, None] + ch[None, :]
            mask = ok[:, None] & ch_ok[None, :]
            x = tl.load(_slot_ptrs(pos, fresh, nrow, rrow, chan, new_kv_ptr + b * snk_b, snk_s, snk_c,
                                   ring_kv_ptr + b * srk_b, srk_r, srk_c), mask=mask, other=0.0).to(tl.float32)
            g = tl.load(_slot_ptrs(pos, fresh, nrow, rrow, chan, new_gate_ptr + b * sng_b, sng_s, sng_c,
                                   ring_gate_ptr + b * srg_b, srg_r, srg_c),
                        mask=mask, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m_i, tl.max(g, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing valid yet
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(g - m_safe[None, :])
            l_i = l_i * alpha + tl.sum(p, 0)
            acc = acc * alpha + tl.sum(p * x, 0)
            m_i = m_new
        pooled = tl.where(ch_ok, acc / tl.where(ch_ok, l_i, 1.0), 0.0)

        # RMSNorm (fp32) with the weight
        inv = 1.0 / tl.sqrt(tl.sum(pooled * pooled, 0) / d + tl.cast(eps, tl.float32))  # fp64 under Inductor
        w = tl.load(norm_w_ptr + ch * snw, mask=ch_ok, other=0.0).to(tl.float32)
        y = pooled * inv * w

        # interleaved RoPE of the last 2 * half channels at position ratio * blk
        ye, yo = tl.split(tl.reshape(y, (BLOCK_D // 2, 2)))
        k = tl.arange(0, BLOCK_D // 2)
        i = k - (d - 2 * half + PAR) // 2  # rope pair of lane pair k
        bpos = blk * ratio
        rope = (i >= 0) & (i < half) & (bpos < P)
        c = tl.load(cos_ptr + bpos * scos_p + i * scos_h, mask=rope, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + bpos * ssin_p + i * ssin_h, mask=rope, other=0.0).to(tl.float32)
        oe = tl.where(rope, ye * c - yo * s, ye)
        oo = tl.where(rope, yo * c + ye * s, yo)

        if PAGED:  # dim 0 of a paged pool is the page: sp_b is the page stride
            page = tl.load(block_table_ptr + b * sbt_b + (blk // PAGE) * sbt_p).to(tl.int64)
            page_base = pool_ptr + tl.minimum(tl.maximum(page, 0), NUM_PAGES - 1) * sp_b
            row = page_base + (blk % PAGE) * sp_n
        elif FMT == 0:
            row = pool_ptr + b * sp_b + blk * sp_n
        else:
            page_base = pool_ptr + b * sp_b + (blk // PAGE) * sp_n
        if FMT == 0:
            ce = 2 * k - PAR  # channels of the even / odd lanes
            co = ce + 1
            ty = pool_ptr.dtype.element_ty
            tl.store(row + ce * sp_c, oe.to(ty), mask=(ce >= 0) & (ce < d))
            tl.store(row + co * sp_c, oo.to(ty), mask=(co >= 0) & (co < d))
        else:  # FP8 page: PAR == 0, so the lanes are the channels
            y = tl.interleave(oe, oo)
            data = page_base + (blk % PAGE) * DATA_BYTES
            scales = page_base + PAGE * DATA_BYTES + (blk % PAGE) * SCALE_BYTES
            if FMT == 1:
                store_kv_entry(y, data, scales, d, NOPE, SCALE_BYTES, BLOCK_D, BLOCK_SB)
            else:
                _store_keys_fp8(y, data, scales, BLOCK_D)


def compress_config(d: int, half: int, ratio: int, overlap: bool) -> dict:
    """Static: all ``d`` channels per program; ``BLOCK_M`` slot rows per chunk so that a
    ``[BLOCK_M, BLOCK_D]`` tile is at most 4096 elements (d = 512: 8 rows, the whole CSA
    ``2m = 8`` window in one chunk; HCA m = 128: 16 chunks)."""
    par = (d - 2 * half) % 2
    block_d = max(2, next_pow2(d + par))
    slots = (2 if overlap else 1) * ratio
    block_m = max(1, min(next_pow2(slots), 4096 // block_d))
    return dict(PAR=par, BLOCK_D=block_d, BLOCK_M=block_m, num_warps=4 if block_d <= 512 else 8)


def compress_launch(
    ring_kv: torch.Tensor,
    ring_gate: torch.Tensor,
    new_kv: torch.Tensor,
    new_gate: torch.Tensor,
    start: torch.Tensor,
    emit: torch.Tensor,
    norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pool: torch.Tensor,
    ratio: int,
    overlap: bool,
    eps: float,
    block_table: torch.Tensor | None = None,
) -> Launch | None:
    """The ``compress_kernel`` launch (``None``: nothing to emit). An FP8 ``pool`` (rank-4 uint8,
    or rank-3 uint8 pages with ``block_table``) takes the quantising epilogue: the KV layout, or
    indexer keys when ``entry_bytes == d + 4``. ``block_table [B, P]``: ``pool`` is paged,
    ``[num_pages, page, ...]``."""
    B, E = emit.shape
    c = 2 if overlap else 1
    d = new_kv.shape[-1] // c
    half = cos.shape[-1]
    paged = block_table is not None
    fmt, page, nope, data_bytes, scale_bytes = 0, 1, 0, 0, 0
    if pool.dtype == torch.uint8:  # FP8: [B, pages, page, entry_bytes] or pages [num_pages, page, entry_bytes]
        page, eb = pool.shape[-2], pool.shape[-1]
        fmt = 2 if eb == d + 4 else 1
        nope = d if fmt == 2 else d - 2 * half
        data_bytes = d if fmt == 2 else nope + 4 * half
        scale_bytes = eb - data_bytes
        pool_strides = (pool.stride(0), 0 if paged else pool.stride(1), 1)
    else:
        page = pool.shape[1] if paged else 1
        pool_strides = pool.stride()
    N = block_table.shape[1] * page if paged else pool.shape[1] * page
    table, num_pages, *table_strides = block_table_args(block_table, pool, emit)
    R, S = ring_kv.shape[1], new_kv.shape[1]
    if B * E == 0 or N * d == 0:
        return None
    if S == 0:  # never read (no position is fresh), but the kernel needs real pointers
        new_kv, new_gate = ring_kv, ring_gate
    cfg = compress_config(d, half, ratio, overlap)
    args = (ring_kv, ring_gate, new_kv, new_gate, start, emit, norm_weight, cos, sin, pool, table,
            float(eps),
            E, S, R, N, cos.shape[0], d, half, ratio, num_pages,
            *ring_kv.stride(), *ring_gate.stride(), *new_kv.stride(), *new_gate.stride(),
            start.stride(0), *emit.stride(), norm_weight.stride(0), *cos.stride(), *sin.stride(), *pool_strides,
            *table_strides,
            page, nope, data_bytes, scale_bytes)
    meta = dict(OVERLAP=bool(overlap), PAR=cfg["PAR"], BLOCK_D=cfg["BLOCK_D"], BLOCK_M=cfg["BLOCK_M"],
                FMT=fmt, BLOCK_SB=max(2, next_pow2(scale_bytes)), PAGED=paged, num_warps=cfg["num_warps"])
    return Launch((B * E,), args, meta)


def compress(*args, **kwargs) -> None:
    """Raw launcher with the reference signature (that of :func:`compress_launch`); writes
    ``pool`` in place, returns ``None``.
    Emitted blocks outside ``[0, N)`` are skipped like ``-1``; rope rows ``>= P`` are left
    unrotated (the raw-op contract, shared with the reference)."""
    launch(compress_kernel, compress_launch(*args, **kwargs))
