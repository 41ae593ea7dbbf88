"""Triton lightning indexer: scores, then top-k with -1 sentinels.
Contract: ``dsv4_ops.reference.indexer_scores`` / ``indexer_topk``.

Scores (``indexer_scores_kernel``, grid ``(B * S, cdiv(N, CHUNK))``): a program scores one query
token over ``CHUNK`` entries, all heads at once, in pipelined blocks of ``BLOCK_N`` keys:
``score = sum_h w[h] * relu(keys @ q[h])`` (fp32 accumulate), ``-inf`` past ``visible`` (those
keys are never loaded). The pass is bound by the keys' bytes, so ``q`` is loaded once per program
and ``CHUNK`` sizes the grid to one wave (:func:`scores_chunk`). FP8 keys (``KEYS_FP8``): the
queries are quantised per head to e4m3 with one power-of-two scale folded into ``w[h]``
(``fp8_cache.simulate_queries``; exact, as relu and the head sum commute with it); with
``FP8_DOT`` (bf16 queries, sm_89+) the codes meet on the FP8 tensor cores, elsewhere both sides
are decoded exactly. Paged keys (``KEYS_PAGED``, ``block_table [B, P]``;
``dsv4_ops.reference.ops.paged_rows``): each lane looks its entry's page up in the row's
block-table row (dim 0 of the keys is the page, at its own, possibly padded, stride); scores and
picks stay indexed by entry.

Top-k, exact and deterministic, without sorting the row:
  1. radix select of the k-th largest score over order-preserving uint32 keys (``-0.0`` folded
     into ``+0.0``, as ``torch.sort`` treats them equal): the threshold key ``T`` and the count
     ``r`` of entries equal to ``T`` still picked;
  2. one compaction keeps every ``key > T`` and the first ``r`` (by index) with ``key == T``:
     the stable sort's choice;
  3. the ``min(topk, visible)`` picks, packed as uint64 ``key << 32 | ~index``, are
     bitonic-sorted descending (score, then lower index); the other slots get -1.
One program per row (``topk_row_kernel``: the row in registers; ``topk_kernel``: blocks of
longer rows), or with too few rows to fill the GPU the split top-k (``topk_row_kernel``
``STAGE`` 1: a program per ``SEG``-entry segment does steps 1-2 into ``[B, S, P * topk]``
candidate buffers; ``STAGE`` 2: a program per row merges them; exact, as an entry beaten by
fewer than ``topk`` entries of its row is beaten by fewer in its segment), or once the rows fill
the GPU the fused top-k (``indexer_scores_kernel`` ``TOPK_FUSED`` does stage 1 over its own
chunk: a launch and a second read of the scores less). The shared helpers take no pointers, so
torch's mutation analysis sees exactly the buffers each kernel writes.

Where the CUDA top-k builds (``dsv4_ops/ops/topk_cuda.py``), ``dsv4::indexer_topk`` takes it
after these scores; these top-k kernels serve the rest (ROCm, no nvcc, longer rows, AOTInductor
packages). Configuration: :func:`indexer_config`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# by name, not as `fc.<name>`: Inductor copies a wrap_triton kernel's source with the jit
# functions it names, never a module attribute (NameError 'fc' in a compiled graph)
from .fp8_codec import bytes_of_words, e4m3_encode, e4m3_hw, e4m3_to, pow2, scale_exponent, word_aligned
from .launch import (Launch, backend, block_table_args, cached_config, capability, device_index, entries, launch,
                     next_pow2, sm_count)
from .sparse_attention import INTERPRET, ieee_dot

__all__ = ["indexer_scores", "indexer_topk", "topk_from_scores", "indexer_scores_kernel", "topk_kernel",
           "topk_row_kernel", "indexer_config", "scores_chunk", "topk_segment", "topk_fused_chunk", "fused_warps",
           "indexer_launches", "scores_launch", "fp8_dot_serves", "topk_launches", "fused_launches", "IndexerLaunches"]


@triton.jit
def indexer_scores_kernel(
    q_ptr, w_ptr, k_ptr, vis_ptr, out_ptr, cand_idx_ptr, cand_score_ptr, block_table_ptr,
    S, HI, N, TOPK, NUM_PAGES,
    sq_b, sq_s, sq_h, sq_d,
    sw_b, sw_s, sw_h,
    sk_b, sk_n, sk_d,
    sv_b, sv_s,
    so_b, so_s, so_n,
    sc_b, sc_s, sc_k,
    sbt_b, sbt_p,
    DI: tl.constexpr, BLOCK_DI: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr, UPCAST_DOT: tl.constexpr, KEYS_FP8: tl.constexpr, E4M3_HW: tl.constexpr,
    KEY_PAGE: tl.constexpr,  # FP8 keys a page: static, so the page arithmetic is shifts
    FP8_DOT: tl.constexpr,  # FP8 keys: the dot on e4m3 codes (tensor cores), not on decoded bf16 / fp32
    TOPK_FUSED: tl.constexpr, KPAD: tl.constexpr, BITS: tl.constexpr,
    KEYS_PAGED: tl.constexpr,  # keys are pages [num_pages, KEY_PAGE, ...] through the block table (sk_b: page stride)
):
    """Scores of query token ``pid 0`` over entries ``[pid 1 * CHUNK, +CHUNK)`` into ``out_ptr``
    (``[B, S, N]``; ``cand_*`` unused). ``TOPK_FUSED`` 1: ``out_ptr`` is scratch, written only
    where visible, and the program then does the split top-k's stage 1 over its chunk
    (``SEG = CHUNK``): exactly what ``topk_row_kernel`` ``STAGE`` 1 writes, into ``cand_idx_ptr``
    and ``cand_score_ptr`` (``[B, S, P * TOPK]``, strides ``sc_*``) at ``pid 1 * TOPK``."""
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)  # chunk of CHUNK entries
    b = (pid_t // S).to(tl.int64)
    s = (pid_t % S).to(tl.int64)
    vis = tl.load(vis_ptr + b * sv_b + s * sv_s)
    vis = tl.minimum(tl.maximum(vis, 0), N)
    lo = pid_c * CHUNK
    hi = tl.minimum(lo + CHUNK, N)
    live_hi = tl.minimum(hi, vis)  # [lo, live_hi) is scored, [live_hi, hi) is -inf
    out_row = out_ptr + b * so_b + s * so_s
    if lo < live_hi:
        offs_h = tl.arange(0, BLOCK_HI)
        h_mask = offs_h < HI
        offs_d = tl.arange(0, BLOCK_DI)
        d_mask = offs_d < DI
        # q^T [DI, HI], loaded once per program: dots^T = keys @ q^T puts the entries on the
        # MMA's M side and the heads on N, so the head sum stays within a warp
        q_t = tl.load(
            q_ptr + b * sq_b + s * sq_s + offs_h[None, :] * sq_h + offs_d[:, None] * sq_d,
            mask=h_mask[None, :] & d_mask[:, None], other=0.0,
        )
        w = tl.load(w_ptr + b * sw_b + s * sw_s + offs_h * sw_h, mask=h_mask, other=0.0).to(tl.float32)
        if KEYS_FP8:  # FP8 queries (fp8_cache.simulate_queries): one power-of-two scale a head, in its weight
            q_f = q_t.to(tl.float32)
            q_exp = scale_exponent(tl.max(tl.abs(q_f), 0))
            q_scaled = q_f * pow2(254 - q_exp)[None, :]  # |q_scaled| <= 448: no saturation
            w = w * pow2(q_exp)
            if FP8_DOT:  # sm_89+: the hardware's round-to-nearest-even convert, the integer encode's codes
                q_t = q_scaled.to(tl.float8e4nv)
            else:
                q_t = e4m3_to(e4m3_encode(q_scaled).to(tl.uint8), q_t.dtype, E4M3_HW)
        key_row0 = k_ptr + b * sk_b
        for start in range(lo, live_hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            live = offs_n < live_hi
            if KEYS_PAGED:  # the page of each entry, from the row's block-table row
                page = tl.load(block_table_ptr + b * sbt_b + (offs_n // KEY_PAGE) * sbt_p, mask=live, other=0)
                page_base = k_ptr + tl.minimum(tl.maximum(page, 0), NUM_PAGES - 1).to(tl.int64) * sk_b
            if KEYS_FP8:  # page of entry n: DI code bytes at t * DI, fp32 scale in the footer
                if KEYS_PAGED:
                    pbase = page_base
                else:
                    pbase = key_row0 + (offs_n // KEY_PAGE).to(tl.int64) * sk_n
                t = offs_n % KEY_PAGE
                sp = pbase + KEY_PAGE * DI + t * 4
                if KEYS_FP8 == 2:  # 4-byte aligned: the scale as one fp32, codes as words (HW: bytes, vectorised)
                    if E4M3_HW:
                        code = tl.load(pbase[:, None] + t[:, None] * DI + offs_d[None, :],
                                       mask=live[:, None] & d_mask[None, :], other=0)
                    else:
                        wd = tl.arange(0, BLOCK_DI // 4)
                        words = tl.load((pbase + t * DI).to(tl.pointer_type(tl.int32))[:, None] + wd[None, :],
                                        mask=live[:, None] & (wd < DI // 4)[None, :], other=0)
                        code = tl.reshape(bytes_of_words(words), (BLOCK_N, BLOCK_DI))
                    kscale = tl.load(sp.to(tl.pointer_type(tl.float32)), mask=live, other=0.0)
                else:  # any layout: a byte per lane
                    code = tl.load(pbase[:, None] + t[:, None] * DI + offs_d[None, :],
                                   mask=live[:, None] & d_mask[None, :], other=0)
                    sbits = (tl.load(sp, mask=live, other=0).to(tl.int32)
                             | (tl.load(sp + 1, mask=live, other=0).to(tl.int32) << 8)
                             | (tl.load(sp + 2, mask=live, other=0).to(tl.int32) << 16)
                             | (tl.load(sp + 3, mask=live, other=0).to(tl.int32) << 24))
                    kscale = sbits.to(tl.float32, bitcast=True)
                # a power-of-two key scale, applied after relu and head sum: the dequantised key's dot, exactly
                if FP8_DOT:
                    keys = code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
                else:
                    keys = e4m3_to(code, q_t.dtype, E4M3_HW)
            elif KEYS_PAGED:
                keys = tl.load(
                    page_base[:, None] + (offs_n % KEY_PAGE)[:, None] * sk_n + offs_d[None, :] * sk_d,
                    mask=live[:, None] & d_mask[None, :], other=0.0,
                ).to(q_t.dtype)
            else:
                keys = tl.load(
                    key_row0 + offs_n[:, None].to(tl.int64) * sk_n + offs_d[None, :] * sk_d,
                    mask=live[:, None] & d_mask[None, :], other=0.0,
                ).to(q_t.dtype)
            if FP8_DOT and not UPCAST_DOT:  # exact products; the sm_90 tensor cores add them with fewer bits than fp32
                dots = tl.dot(keys, q_t)
            else:  # through fp32 with UPCAST_DOT: Triton 3.6's interpreter multiplies bf16 operands as raw bits
                dots = ieee_dot(keys, q_t, UPCAST_DOT)
            scores = tl.sum(tl.maximum(dots, 0.0) * w[None, :], 1)
            if KEYS_FP8:
                scores = scores * kscale
            tl.store(out_row + offs_n * so_n, tl.where(live, scores, float("-inf")), mask=offs_n < hi)
    if TOPK_FUSED:  # stage 1 of the split top-k over this chunk; the scratch past visible is never read
        seg_vis = tl.maximum(live_hi - lo, 0)
        k_eff = tl.minimum(seg_vis, TOPK)
        cand_row = b * sc_b + s * sc_s + pid_c * TOPK * sc_k
        if seg_vis > 0:  # else: a chunk wholly past visible keeps fillers only
            tl.debug_barrier()  # the chunk's scores, stored by the threads that computed them, re-read by others
            offs_c = tl.arange(0, CHUNK)
            live = offs_c < seg_vis
            key = _ordered_key(tl.load(out_row + (lo + offs_c) * so_n, mask=live, other=0.0))
            prefix, known, k_rem, done = _radix_select(key, live, k_eff, BITS)
            sel = _picked(key, live, prefix, known, k_rem, done)
            slot = tl.cumsum(sel, 0) - sel  # the chunk's picks in index order: no ordering
            tl.store(cand_idx_ptr + cand_row + slot * sc_k, lo + offs_c, mask=sel != 0)
            # the score back from its key (no score row kept through the select; -0.0 comes back +0.0)
            tl.store(cand_score_ptr + cand_row + slot * sc_k, _key_score(key), mask=sel != 0)
        j = tl.arange(0, KPAD)
        filler = (j >= k_eff) & (j < TOPK)
        tl.store(cand_idx_ptr + cand_row + j * sc_k, tl.full([KPAD], -1, tl.int32), mask=filler)
        tl.store(cand_score_ptr + cand_row + j * sc_k, tl.full([KPAD], float("-inf"), tl.float32), mask=filler)
    else:  # the blocks the scoring loop did not write
        dead_lo = lo + tl.cdiv(tl.maximum(live_hi - lo, 0), BLOCK_N) * BLOCK_N
        for start in range(dead_lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            tl.store(out_row + offs_n * so_n, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=offs_n < hi)


@triton.jit
def _not32(u):
    # ``~u`` for uint32, spelled as an xor (the interpreter's ``~`` overflows on unsigned)
    return u ^ tl.full(u.shape, 0xFFFFFFFF, tl.uint32)


@triton.jit
def _ordered_key(x):
    """fp32 -> uint32 whose unsigned order is the float order (-0.0 == +0.0)."""
    x = tl.where(x == 0.0, 0.0, x)
    u = x.to(tl.uint32, bitcast=True)
    sign = tl.full(u.shape, 0x80000000, tl.uint32)
    return tl.where((u & sign) != 0, _not32(u), u | sign)



@triton.jit
def _key_score(key):
    """The fp32 score of an ``_ordered_key`` (its inverse; ``-0.0`` had become ``+0.0``'s key)."""
    sign = tl.full(key.shape, 0x80000000, tl.uint32)
    return tl.where((key & sign) != 0, key ^ sign, _not32(key)).to(tl.float32, bitcast=True)

@triton.jit
def _radix_select(key, live, k_eff, BITS: tl.constexpr):
    """Radix select over a register row of ``_ordered_key`` s, the ``live`` ones counting:
    ``(prefix, known, k_rem, done)`` -- the threshold's known high bits ``key & known == prefix``,
    ``k_rem`` entries of the threshold bin still among the ``k_eff`` picks, ``done`` when that is
    the whole bin (the select stopped early). No pointers, see the module docstring."""
    NB: tl.constexpr = 1 << BITS
    bins = tl.arange(0, NB)
    prefix = tl.full([], 0, tl.uint32)
    known = tl.full([], 0, tl.uint32)
    k_rem = k_eff
    cand = live
    done = k_eff == 0
    for p in tl.static_range((32 + BITS - 1) // BITS):
        if not done:
            shift: tl.constexpr = 32 - BITS * (p + 1) if 32 - BITS * (p + 1) > 0 else 0
            digit = ((key >> shift) & (NB - 1)).to(tl.int32)
            hist = tl.histogram(digit, NB, mask=cand)
            at_least = tl.cumsum(hist, 0, reverse=True)  # candidates with digit >= d
            d_star = tl.sum((at_least >= k_rem).to(tl.int32), 0) - 1
            k_rem -= tl.sum(tl.where(bins > d_star, hist, 0), 0)
            done = k_rem == tl.sum(tl.where(bins == d_star, hist, 0), 0)  # the whole bin is picked
            prefix = prefix | (d_star.to(tl.uint32) << shift)
            known = known | tl.full([], (NB - 1) << shift, tl.uint32)
            cand = cand & (digit == d_star)
    return prefix, known, k_rem, done


@triton.jit
def _picked(key, live, prefix, known, k_rem, done):
    """The compaction's choice after ``_radix_select`` (int32 0/1 per entry): every live entry
    above the threshold bin, plus the first ``k_rem`` of the bin by position (all of them when
    the select stopped early) -- the stable sort's choice."""
    high = key & known
    if done:
        sel = (live & (high >= prefix)).to(tl.int32)
    else:  # exact ties at the k-th score: the lowest indices among them
        eq = (live & (high == prefix)).to(tl.int32)
        sel = ((live & (high > prefix)) | ((eq != 0) & (tl.cumsum(eq, 0) - eq < k_rem))).to(tl.int32)
    return sel


@triton.jit
def _order_picks(row, ss_n, out_row, so_k, k_eff, TOPK, KPAD: tl.constexpr, index_row, MAPPED: tl.constexpr):
    """Sort the ``k_eff`` compacted indices in ``out_row`` by score descending, then index
    ascending (one bitonic ``tl.sort`` of uint64 ``key << 32 | ~index``), and fill slots
    ``k_eff .. TOPK`` with -1. ``MAPPED``: the indices are positions in ``row`` and the slots get
    ``index_row[position]`` (the split top-k's merge: candidate position -> entry index)."""
    j = tl.arange(0, KPAD)
    picked = j < k_eff
    idx = tl.load(out_row + j * so_k, mask=picked, other=0)
    key = _ordered_key(tl.load(row + idx.to(tl.int64) * ss_n, mask=picked, other=0.0))
    packed = (key.to(tl.uint64) << 32) | _not32(idx.to(tl.uint32)).to(tl.uint64)
    packed = tl.where(picked, packed, tl.zeros_like(packed))
    packed = tl.sort(packed, descending=True)
    idx = _not32(packed.to(tl.uint32)).to(tl.int32)
    if MAPPED:
        idx = tl.load(index_row + idx.to(tl.int64) * ss_n, mask=picked, other=-1)
    tl.debug_barrier()  # every thread has read the unsorted picks before any is overwritten
    tl.store(out_row + j * so_k, tl.where(picked, idx, -1), mask=j < TOPK)


@triton.jit
def topk_kernel(
    scores_ptr, vis_ptr, out_ptr,
    S, N, TOPK,
    ss_b, ss_s, ss_n,
    sv_b, sv_s,
    so_b, so_s, so_k,
    BLOCK: tl.constexpr, KPAD: tl.constexpr,
):
    # prologue inline: torch's mutation analysis counts a helper's pointer arguments as written
    pid_t = tl.program_id(0)
    b = (pid_t // S).to(tl.int64)
    s = (pid_t % S).to(tl.int64)
    vis = tl.load(vis_ptr + b * sv_b + s * sv_s)
    vis = tl.minimum(tl.maximum(vis, 0), N)
    k_eff = tl.minimum(vis, TOPK)
    row = scores_ptr + b * ss_b + s * ss_s
    out_row = out_ptr + b * so_b + s * so_s

    # 1. radix select: threshold key T (prefix) and r = entries equal to T still needed
    prefix = tl.full([], 0, tl.uint32)
    known = tl.full([], 0, tl.uint32)  # bits of prefix fixed so far
    k_rem = k_eff
    bins = tl.arange(0, 256)
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros([256], tl.int32)
        for start in range(0, vis, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < vis
            key = _ordered_key(tl.load(row + offs * ss_n, mask=m, other=0.0))
            m = m & ((key & known) == prefix)
            digit = ((key >> shift) & 255).to(tl.int32)
            hist += tl.histogram(digit, 256, mask=m)
        at_least = tl.cumsum(hist, 0, reverse=True)  # candidates with digit >= d
        d_star = tl.sum((at_least >= k_rem).to(tl.int32), 0) - 1
        k_rem -= tl.sum(tl.where(bins > d_star, hist, 0), 0)
        prefix = prefix | (d_star.to(tl.uint32) << shift)
        known = known | tl.full([], 255 << shift, tl.uint32)

    # 2. compaction: key > T, plus the first k_rem (lowest index) entries with key == T
    n_sel = tl.zeros([], tl.int32)
    n_eq = tl.zeros([], tl.int32)
    for start in range(0, vis, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < vis
        key = _ordered_key(tl.load(row + offs * ss_n, mask=m, other=0.0))
        eq = (m & (key == prefix)).to(tl.int32)
        eq_before = n_eq + tl.cumsum(eq, 0) - eq
        sel = ((m & (key > prefix)) | ((eq != 0) & (eq_before < k_rem))).to(tl.int32)
        slot = n_sel + tl.cumsum(sel, 0) - sel
        tl.store(out_row + slot * so_k, offs, mask=sel != 0)
        n_eq += tl.sum(eq, 0)
        n_sel += tl.sum(sel, 0)
    tl.debug_barrier()  # the compacted indices are re-read by other threads

    # 3. order the k_eff picks: score descending, then index ascending
    _order_picks(row, ss_n, out_row, so_k, k_eff, TOPK, KPAD, row, False)


@triton.jit
def topk_row_kernel(
    scores_ptr, vis_ptr, out_ptr, cand_ptr,
    S, N, TOPK,
    ss_b, ss_s, ss_n,
    sv_b, sv_s,
    so_b, so_s, so_k,
    ROW: tl.constexpr, KPAD: tl.constexpr, BITS: tl.constexpr, STAGE: tl.constexpr, SEG: tl.constexpr,
):
    """``topk_kernel`` for rows of at most ``ROW`` scores, the row read once into registers; the
    radix select takes ``BITS``-bit digits and stops once the threshold's bin holds exactly the
    picks still needed, so the compaction needs no tie rank.

    ``STAGE`` 0: the whole row (``cand_ptr`` unused). The split top-k (``P = cdiv(N, SEG)``):
    - ``STAGE`` 1, program ``(row, p)`` (``ROW == SEG``): the top-``TOPK`` of segment ``p``'s
      visible entries in index order, entry indices into ``out_ptr`` and scores into ``cand_ptr``
      (both ``[B, S, P * TOPK]``, strides ``so_*``) at ``p * TOPK``, then -1 / ``-inf`` fillers.
    - ``STAGE`` 2, a program per row: over the candidate scores (``scores_ptr``; ``cand_ptr`` the
      indices, strides ``ss_*``), live where the index is not -1, ``k_eff`` of the true row. The
      candidates are in entry order, so ties by position are ties by entry index.
    """
    # prologue inline: torch's mutation analysis counts a helper's pointer arguments as written
    pid_t = tl.program_id(0)
    b = (pid_t // S).to(tl.int64)
    s = (pid_t % S).to(tl.int64)
    vis = tl.load(vis_ptr + b * sv_b + s * sv_s)
    vis = tl.minimum(tl.maximum(vis, 0), N)
    row = scores_ptr + b * ss_b + s * ss_s
    out_row = out_ptr + b * so_b + s * so_s
    offs = tl.arange(0, ROW)
    if STAGE == 1:  # segment p of the row: entries [p * SEG, p * SEG + SEG)
        seg = tl.program_id(1)
        vis = tl.minimum(tl.maximum(vis - seg * SEG, 0), SEG)
        row += seg * SEG * ss_n
        out_row += seg * TOPK * so_k
        score_out = cand_ptr + b * so_b + s * so_s + seg * TOPK * so_k
    k_eff = tl.minimum(vis, TOPK)
    if STAGE == 2:  # the candidates: the -1 / -inf fillers of stage 1 are never live
        index_row = cand_ptr + b * ss_b + s * ss_s
        live = tl.load(index_row + offs * ss_n, mask=offs < tl.cdiv(N, SEG) * TOPK, other=-1) >= 0
    else:
        index_row = row  # unused
        live = offs < vis
    x = tl.load(row + offs * ss_n, mask=live, other=0.0)
    key = _ordered_key(x)

    # 1. radix select over the candidates (entries whose known high bits equal prefix)
    prefix, known, k_rem, done = _radix_select(key, live, k_eff, BITS)
    # 2. compaction: above the threshold bin, plus the first k_rem candidates by index
    sel = _picked(key, live, prefix, known, k_rem, done)
    slot = tl.cumsum(sel, 0) - sel
    if STAGE == 1:  # the segment's picks in index order, then the fillers: no ordering
        tl.store(out_row + slot * so_k, offs + seg * SEG, mask=sel != 0)
        tl.store(score_out + slot * so_k, x, mask=sel != 0)
        j = tl.arange(0, KPAD)
        filler = (j >= k_eff) & (j < TOPK)
        tl.store(out_row + j * so_k, tl.full([KPAD], -1, tl.int32), mask=filler)
        tl.store(score_out + j * so_k, tl.full([KPAD], float("-inf"), tl.float32), mask=filler)
    else:
        tl.store(out_row + slot * so_k, offs, mask=sel != 0)
        tl.debug_barrier()  # the compacted indices are re-read by other threads

        # 3. order the k_eff picks: score descending, then index ascending
        _order_picks(row, ss_n, out_row, so_k, k_eff, TOPK, KPAD, index_row, STAGE == 2)


# --------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------
# the split top-k's segments, and the longest rows kept whole (docs/kernels.md, "Split top-k")
TOPK_SEGMENTS = (2048, 4096, 8192, 16384)
TOPK_SPLIT_MIN_SCORES = 4096


def topk_segment(rows: int, N: int, topk: int, sms: int, row_limit: int) -> int:
    """The split top-k's segment for ``rows`` rows of ``N`` scores (0: one program per row): of the
    segments with both stages in one wave (``rows * cdiv(N, seg) <= sms``), ``topk < seg < N`` and a
    merge row within the row kernel (``cdiv(N, seg) * topk <= row_limit``), the one whose longer
    stage row is shortest (the shorter segment on a tie). Rows of at most
    ``TOPK_SPLIT_MIN_SCORES`` are never split."""
    best, best_len = 0, None
    if N <= TOPK_SPLIT_MIN_SCORES:
        return 0
    for seg in TOPK_SEGMENTS:
        parts = -(-N // seg)
        if seg >= N or topk >= seg or rows * parts > sms or parts * topk > row_limit:
            continue
        longer = max(seg, parts * topk)
        if best_len is None or longer < best_len:
            best, best_len = seg, longer
    return best


# where the fused top-k pays, and its chunks: measured (docs/kernels.md, "Fused top-k")
TOPK_FUSED_CHUNK_SHORT, TOPK_FUSED_CHUNK_LONG = 1024, 2048
TOPK_FUSED_LONG_ROW = 16384
TOPK_FUSED_MIN_ROWS, TOPK_FUSED_MIN_SCORES = 64, 1 << 20


def topk_fused_chunk(rows: int, N: int, topk: int, row_limit: int) -> int:
    """The fused top-k's chunk for ``rows`` rows of ``N`` scores (0: not fused): at least 64 rows
    and 2^20 scores in all, chunk 2048 for rows of 16K scores or more, else 1024; each chunk at
    least ``2 * topk`` (it keeps at most half of what it scores) and a row's candidates within the
    row kernel (``row_limit``). Rows of at most ``TOPK_SPLIT_MIN_SCORES`` are never fused."""
    if N <= TOPK_SPLIT_MIN_SCORES or rows < TOPK_FUSED_MIN_ROWS or rows * N < TOPK_FUSED_MIN_SCORES:
        return 0
    chunk = TOPK_FUSED_CHUNK_LONG if N >= TOPK_FUSED_LONG_ROW else TOPK_FUSED_CHUNK_SHORT
    return chunk if 2 * topk <= chunk < N and -(-N // chunk) * topk <= row_limit else 0


def fused_warps(chunk: int) -> int:
    """Warps of the fused scores program over ``chunk`` entries: 4 whatever the chunk (8 gave other
    indices than the unfused path on the H200; docs/kernels.md, "Fused top-k")."""
    return 4


SCORES_CHUNK_ONE_WAVE_MAX = 8192  # the longest chunk a program takes when one wave of 2 a SM covers the grid
SCORES_CHUNK_MANY_WAVES = 1024  # bf16 keys past that: many short waves, so the last one is a small part


def scores_chunk(entries: int, sms: int, block_n: int = 64, keys_fp8: bool = False, fp8_dot: bool = False) -> int:
    """``CHUNK`` of the scores pass for ``entries = B * S * N`` scores (measured rules,
    docs/kernels.md). bf16 keys: the power of two giving about 2 programs per SM in one wave while
    that is at most ``SCORES_CHUNK_ONE_WAVE_MAX`` (three programs fit an SM, so 3-4 per SM would
    leave a second, mostly idle wave), else ``SCORES_CHUNK_MANY_WAVES``. FP8 keys, decoded dot:
    about 2 programs per SM, at most 2048. FP8 keys on the e4m3 dot (``fp8_dot``: fewer
    registers): about 4 programs per SM, at most 8192."""
    if keys_fp8 and fp8_dot:
        return min(max(block_n, next_pow2(-(-entries // (4 * sms)))), SCORES_CHUNK_ONE_WAVE_MAX)
    per_program = -(-entries // (2 * sms))
    if keys_fp8:
        return min(max(block_n, next_pow2(per_program)), 2048)
    if per_program <= SCORES_CHUNK_ONE_WAVE_MAX:
        return max(block_n, next_pow2(per_program))
    return SCORES_CHUNK_MANY_WAVES


@cached_config
def indexer_config(B: int, S: int, HI: int, DI: int, N: int, topk: int, sms: int = 132,
                   backend: str = "cuda", keys_fp8: bool = False, fp8_dot: bool = False) -> dict:
    """Static launch configuration (a pure function of sizes, never of tensor values; the values
    are the fastest of the H200 sweeps, docs/kernels.md).

    Scores: all indexer heads per program, ``BLOCK_N`` entries per MMA, ``CHUNK`` entries per
    program (:func:`scores_chunk`). Top-k, one of:
    - one program per row: ``topk_row_kernel`` for rows of at most ``TOPK_ROW`` scores
      (``TOPK_BITS``-bit digits, ``row_warps`` warps), else ``topk_kernel`` (``TOPK_BLOCK`` scores
      a step, ``loop_warps`` warps);
    - the split top-k (``TOPK_SPLIT`` = the segment; 0 = off): :func:`topk_segment`, CUDA only;
    - the fused top-k (``TOPK_FUSED`` = the chunk, replacing ``CHUNK``; 0 = off):
      :func:`topk_fused_chunk`, CUDA only and never for FP8 keys, ``fused_warps`` warps (an
      override is for sweeps only).
    ``fp8_dot``: FP8 keys scored by the e4m3 tensor-core dot (:func:`fp8_dot_serves`; a ``config``
    may force ``FP8_DOT``). ROCm (``backend="hip"``) takes ``topk_kernel`` for every row: the row
    kernel spills SGPRs at 32K scores on gfx942/gfx950 (nothing is timed on AMD hardware).
    """
    block_n = 64
    chunk = scores_chunk(B * S * N, sms, block_n, keys_fp8, fp8_dot)
    topk_row = 0 if backend == "hip" else 32768
    seg = topk_segment(B * S, N, topk, sms, topk_row) if backend == "cuda" else 0
    # FP8 keys never fuse: slower, as their scores pass is not bytes-bound
    fused = topk_fused_chunk(B * S, N, topk, topk_row) if backend == "cuda" and not keys_fp8 else 0
    return dict(BLOCK_HI=max(16, next_pow2(HI)), BLOCK_DI=max(16, next_pow2(DI)), BLOCK_N=block_n,
                CHUNK=chunk, num_warps=4, num_stages=3,
                TOPK_ROW=topk_row, TOPK_BITS=5, TOPK_SPLIT=seg, TOPK_FUSED=fused, fused_warps=0,
                row_warps=16, TOPK_BLOCK=4096, loop_warps=8, KPAD=max(16, next_pow2(topk)),
                E4M3_HW=e4m3_hw(backend))


def scores_launch(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                  out: torch.Tensor | None = None, *, config: dict | None = None,
                  candidates: tuple | None = None,
                  block_table: torch.Tensor | None = None) -> tuple[torch.Tensor, Launch | None]:
    """``[B, S, N] fp32`` scores and the ``indexer_scores_kernel`` launch that fills them
    (``None``: empty). ``config`` overrides keys of ``indexer_config``. ``candidates``
    ``(cand_idx, cand_scores, topk)``: the fused top-k's launch instead (chunks of
    ``config["TOPK_FUSED"]`` entries, each program's stage-1 picks into the two ``[B, S,
    cdiv(N, chunk) * topk]`` buffers, same strides); ``out`` is then scratch, valid only
    where visible. ``block_table [B, P]``: ``keys`` are pages ``[num_pages, page, ...]``."""
    B, S, HI, DI = q.shape
    fp8, fp8_dot = _fp8_keys(q, keys, config)
    N = entries(keys, block_table)
    if out is None:
        out = torch.empty((B, S, N), dtype=torch.float32, device=q.device)
    if B * S * N == 0:
        return out, None
    cfg = {**indexer_config(B, S, HI, DI, N, 1, sm_count(q.device), backend(), fp8, fp8_dot), **(config or {})}
    keys_fp8 = 0  # 1: FP8 keys read a byte per lane; 2: as 32-bit words (every key 4-byte aligned)
    paged = block_table is not None
    if fp8:  # the page stride: dim 1 of [B, pages, page, bytes], dim 0 (sk_b) of paged keys
        key_args, page = (keys, keys.stride(0), 0 if paged else keys.stride(1), 1), keys.shape[-2]
        keys_fp8 = 2 if DI % 4 == 0 and word_aligned(keys) else 1
    else:
        keys = keys.to(q.dtype) if keys.dtype != q.dtype else keys
        key_args, page = (keys, *keys.stride()), keys.shape[1] if paged else 1
    table_args = block_table_args(block_table, keys, visible)
    if candidates is None:  # cand_* unused (TOPK_FUSED 0): the scores again, never accessed
        chunk, cand, topk, cand_strides = cfg["CHUNK"], (out, out), 0, (0, 0, 0)
        fused = dict(TOPK_FUSED=0, KPAD=16, BITS=5, num_warps=cfg["num_warps"])
    else:
        chunk, (cand_idx, cand_scores, topk) = cfg["TOPK_FUSED"], candidates
        assert chunk >= 16 and chunk == next_pow2(chunk), f"TOPK_FUSED must be a power of two >= 16, got {chunk}"
        assert cand_idx.shape == cand_scores.shape == (B, S, -(-N // chunk) * topk), cand_idx.shape
        assert cand_idx.stride() == cand_scores.stride(), "one layout: both addressed with the same strides"
        cand, cand_strides = (cand_idx, cand_scores), cand_idx.stride()
        fused = dict(TOPK_FUSED=1, KPAD=max(16, next_pow2(topk)), BITS=cfg["TOPK_BITS"],
                     num_warps=cfg.get("fused_warps") or fused_warps(chunk))
    args = (q, weights, key_args[0], visible, out, *cand, table_args[0],
            S, HI, N, topk, table_args[1],
            *q.stride(), *weights.stride(), *key_args[1:], *visible.stride(), *out.stride(), *cand_strides,
            *table_args[2:])
    return out, Launch((B * S, -(-N // chunk)), args,
                       dict(DI=DI, BLOCK_DI=cfg["BLOCK_DI"], BLOCK_HI=cfg["BLOCK_HI"], BLOCK_N=cfg["BLOCK_N"],
                            CHUNK=chunk, UPCAST_DOT=INTERPRET, KEYS_FP8=keys_fp8,
                            E4M3_HW=cfg["E4M3_HW"] if fp8 else 0, KEY_PAGE=page, FP8_DOT=int(fp8_dot),
                            KEYS_PAGED=paged, num_stages=cfg["num_stages"], **fused))


def _fp8_keys(q: torch.Tensor, keys: torch.Tensor, config: dict | None) -> tuple[bool, bool]:
    """``indexer_config``'s ``(keys_fp8, fp8_dot)`` for these queries and keys (``config["FP8_DOT"]``,
    if given, forces the dot)."""
    fp8 = keys.dtype == torch.uint8  # FP8 keys [B, pages, page, DI + 4] or pages [num_pages, page, DI + 4]
    forced = (config or {}).get("FP8_DOT")
    return fp8, fp8 and bool(fp8_dot_serves(q) if forced is None else forced)


def fp8_dot_serves(q: torch.Tensor) -> bool:
    """Whether FP8 keys are scored by an e4m3 tensor-core dot (``FP8_DOT``): bf16 queries of more
    than 16 dims (an FP8 MMA's K is 32) on an NVIDIA GPU of sm_89 or later. Elsewhere both sides
    are decoded exactly: the same products, summed in fp32."""
    return (q.dtype == torch.bfloat16 and next_pow2(q.shape[-1]) >= 32 and q.is_cuda and backend() == "cuda"
            and not INTERPRET and capability(device_index(q.device)) >= (8, 9))


def _merge_launch(cand_idx: torch.Tensor, cand_scores: torch.Tensor, visible: torch.Tensor, out: torch.Tensor,
                  N: int, topk: int, seg: int, cfg: dict) -> Launch:
    """Stage 2 of the split (or fused) top-k: one ``topk_row_kernel`` program per row over the
    ``cdiv(N, seg) * topk`` candidates of stage 1 into ``out``."""
    B, S, width = cand_idx.shape
    return Launch((B * S,), (cand_scores, visible, out, cand_idx, S, N, topk, *cand_scores.stride(),
                             *visible.stride(), *out.stride()),
                  dict(KPAD=cfg["KPAD"], BITS=cfg["TOPK_BITS"], num_warps=cfg["row_warps"],
                       ROW=max(16, next_pow2(width)), STAGE=2, SEG=seg))


def fused_launches(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, topk: int,
                   out: torch.Tensor, scores: torch.Tensor | None, cfg: dict,
                   block_table: torch.Tensor | None = None) -> tuple:
    """The fused top-k (``cfg["TOPK_FUSED"]``, the chunk): ``(indexer_scores_kernel launch with
    stage 1 fused in, (stage-2 topk_row_kernel launch,), None)`` -- a group of
    ``IndexerLaunches``; ``scores`` the ``[B, S, N]`` scratch (None: allocated)."""
    B, S = visible.shape
    N = entries(keys, block_table)
    chunk = cfg["TOPK_FUSED"]
    width = -(-N // chunk) * topk
    cand_idx = torch.empty((B, S, width), dtype=torch.int32, device=q.device)
    cand_scores = torch.empty((B, S, width), dtype=torch.float32, device=q.device)
    _, scoring = scores_launch(q, weights, keys, visible, out=scores, config=cfg,
                               candidates=(cand_idx, cand_scores, topk), block_table=block_table)
    return scoring, (_merge_launch(cand_idx, cand_scores, visible, out, N, topk, chunk, cfg),), None


def topk_launches(scores: torch.Tensor, visible: torch.Tensor, topk: int, out: torch.Tensor,
                  cfg: dict) -> tuple[tuple[Launch, ...], Launch | None]:
    """The top-k pass over ``[B, S, N]`` scores into ``out``: ``(topk_row_kernel launches,
    topk_kernel launch or None)`` (``cfg``: ``indexer_config``): the split top-k's two stages
    (rows longer than a non-zero ``TOPK_SPLIT``), else one row launch (rows of at most
    ``TOPK_ROW`` scores), else the looped launch."""
    B, S, N = scores.shape
    vis_out = (*visible.stride(), *out.stride())
    row_meta = dict(KPAD=cfg["KPAD"], BITS=cfg["TOPK_BITS"], num_warps=cfg["row_warps"])
    seg = cfg.get("TOPK_SPLIT", 0)
    if seg and N > seg:
        assert seg == next_pow2(seg) and seg >= 16, f"TOPK_SPLIT must be a power of two >= 16, got {seg}"
        P = -(-N // seg)
        # one shape, one layout: the kernel addresses both candidate buffers with the index buffer's strides
        cand_idx = torch.empty((B, S, P * topk), dtype=torch.int32, device=scores.device)
        cand_scores = torch.empty((B, S, P * topk), dtype=torch.float32, device=scores.device)
        stage1 = Launch((B * S, P), (scores, visible, cand_idx, cand_scores, S, N, topk, *scores.stride(),
                                     *visible.stride(), *cand_idx.stride()),
                        dict(row_meta, ROW=seg, STAGE=1, SEG=seg))
        return (stage1, _merge_launch(cand_idx, cand_scores, visible, out, N, topk, seg, cfg)), None
    if N <= cfg["TOPK_ROW"]:
        # STAGE 0 reads no candidates: cand_ptr is the scores, never accessed
        args = (scores, visible, out, scores, S, N, topk, *scores.stride(), *vis_out)
        return (Launch((B * S,), args, dict(row_meta, ROW=max(16, next_pow2(N)), STAGE=0, SEG=0)),), None
    args = (scores, visible, out, S, N, topk, *scores.stride(), *vis_out)
    return (), Launch((B * S,), args, dict(BLOCK=cfg["TOPK_BLOCK"], KPAD=cfg["KPAD"], num_warps=cfg["loop_warps"]))


# The fp32 scores scratch of one launch group, at most: a long prefill chunk at large batch scores
# its query tokens in groups (``token_group``), as a pool-sized ``[B, S, N]`` buffer would take
# memory from the KV pool. 4 GiB keeps every decode step in one group.
SCORES_BUDGET_BYTES = 4 << 30


def token_group(B: int, S: int, N: int, budget: int | None = None) -> int:
    """Query tokens per launch group: all ``S`` while their ``[B, S, N]`` fp32 scores fit
    ``budget`` bytes (None: ``SCORES_BUDGET_BYTES``; every decode step), else as many as fit,
    at least one."""
    budget = SCORES_BUDGET_BYTES if budget is None else budget
    return max(1, min(S, budget // max(1, 4 * B * N)))


class IndexerLaunches(NamedTuple):
    out: torch.Tensor  # [B, S, topk] int32
    # per group of query tokens (token_group), in order: (indexer_scores_kernel launch,
    # topk_row_kernel launches, topk_kernel launch or None): topk_launches' or fused_launches'.
    # Empty when there is nothing to launch (no tokens, or an empty pool: out is then all -1).
    groups: tuple


def indexer_launches(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                     topk: int, out: torch.Tensor | None = None, *, scores: torch.Tensor | None = None,
                     config: dict | None = None, budget: int | None = None,
                     block_table: torch.Tensor | None = None) -> IndexerLaunches:
    """The output and the launches that fill it, for the arguments of :func:`indexer_topk`
    (an empty pool fills ``out`` with -1 here, and launches nothing). The query tokens go in
    groups whose scores fit ``budget`` bytes (``token_group``; None: ``SCORES_BUDGET_BYTES``,
    read at call time); a given ``scores`` scratch ``[B, S, N]`` means one group. ``block_table
    [B, P]``: ``keys`` are pages ``[num_pages, page, ...]`` read through it."""
    B, S = visible.shape
    N = entries(keys, block_table)
    if out is None:
        out = torch.empty((B, S, topk), dtype=torch.int32, device=q.device)
    if B * S * topk == 0:
        return IndexerLaunches(out, ())
    if N == 0:
        out.fill_(-1)
        return IndexerLaunches(out, ())
    G = S if scores is not None else token_group(B, S, N, budget)
    if G == S:  # every decode step: one [B, S, N] scratch, no views
        return IndexerLaunches(out, (_group_launches(q, weights, keys, visible, N, topk, out, scores, config,
                                                     block_table),))
    scratch = torch.empty((B, G, N), dtype=torch.float32, device=q.device)
    groups = []
    for s0 in range(0, S, G):  # each group scores into rows [0, s1 - s0) of the scratch
        s1 = min(S, s0 + G)
        groups.append(_group_launches(q[:, s0:s1], weights[:, s0:s1], keys, visible[:, s0:s1], N, topk,
                                      out[:, s0:s1], scratch[:, : s1 - s0], config, block_table))
    return IndexerLaunches(out, tuple(groups))


def _group_launches(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, N: int,
                    topk: int, out: torch.Tensor, scores: torch.Tensor | None, config: dict | None,
                    block_table: torch.Tensor | None) -> tuple:
    """The launches of one group of query tokens (``IndexerLaunches.groups``) over ``N`` entries a row:
    the fused top-k's, or the scores launch then ``topk_launches``' pair."""
    B, S = visible.shape
    cfg = {**indexer_config(B, S, q.shape[2], q.shape[3], N, topk, sm_count(q.device),
                            backend(), *_fp8_keys(q, keys, config)), **(config or {})}
    if cfg.get("TOPK_FUSED", 0):
        return fused_launches(q, weights, keys, visible, topk, out, scores, cfg, block_table)
    scores, scoring = scores_launch(q, weights, keys, visible, out=scores, config=cfg, block_table=block_table)
    return (scoring, *topk_launches(scores, visible, topk, out, cfg))


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                   out: torch.Tensor | None = None, *, config: dict | None = None,
                   block_table: torch.Tensor | None = None) -> torch.Tensor:
    """Raw launcher: ``[B, S, N] fp32`` scores, ``-inf`` for entries ``i >= visible[b, s]``.
    ``config`` overrides keys of ``indexer_config`` (tuning sweeps, tests)."""
    out, spec = scores_launch(q, weights, keys, visible, out, config=config, block_table=block_table)
    launch(indexer_scores_kernel, spec)
    return out


def topk_from_scores(scores: torch.Tensor, visible: torch.Tensor, topk: int, out: torch.Tensor,
                     cfg: dict) -> torch.Tensor:
    """Raw launcher of the top-k pass alone, over precomputed ``[B, S, N]`` scores (``cfg``:
    ``indexer_config``)."""
    rows, loop = topk_launches(scores, visible, topk, out, cfg)
    for row in rows:
        launch(topk_row_kernel, row)
    launch(topk_kernel, loop)
    return out


def indexer_topk(*args, **kwargs) -> torch.Tensor:
    """Raw launcher with the reference signature (``block_table`` by keyword) plus ``out=``, ``scores=`` (the ``[B, S, N]
    fp32`` scratch row buffer), ``config=`` (overrides of ``indexer_config``) and ``budget=``
    (the scratch's bytes): those of :func:`indexer_launches`. Returns ``[B, S, topk] int32``,
    -1 sentinels; ``visible`` is clamped to ``[0, N]`` (the raw-op contract, shared with the
    reference)."""
    launches = indexer_launches(*args, **kwargs)
    for scoring, rows, loop in launches.groups:
        launch(indexer_scores_kernel, scoring)
        for row in rows:
            launch(topk_row_kernel, row)
        launch(topk_kernel, loop)
    return launches.out
