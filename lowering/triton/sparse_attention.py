"""Triton sparse attention: MQA with one shared K = V row per entry, over a per-query
entry set (window rows ∪ indexer-picked compressed entries ∪ a dense compressed prefix),
one fp32 softmax with the per-head sink. Contract: ``dsv4_ops.reference.sparse_attention``.

How it is parallelised (grid ``(B * S, cdiv(H, BLOCK_H), NUM_SPLITS)``):
- One program = one query token ``(b, s)`` x one block of ``BLOCK_H`` heads. Decode is bound by
  the bytes of the gathered rows, so each row is read once per token and used by every head of
  the block: ``q[BLOCK_H, D] @ rows[BLOCK_N, D]^T`` and ``acc += p @ rows`` on tensor cores,
  online softmax (running max ``m``, sum ``l``) in fp32 with ``exp2``.
- The entry list is virtual: ``[0, W)`` are ``kv_idx`` (window rows of ``kv``), ``[W, W+K)``
  ``cmp_idx`` (rows of ``cmp``), ``[W+K, W+K+cmp_len)`` the dense prefix of ``cmp``. Each lane
  picks its row pointer by segment; -1 entries are masked (no memory traffic). The loop stops at
  the query's own ``W + K + min(cmp_len, Nc)`` (read on the device).
- The sink is folded in once, at the end, with the same max:
  ``out = acc * 2^(m - M) / (l * 2^(m - M) + 2^(sink - M))``, ``M = max(m, sink)``; a query with
  no entries gets ``0 / 1 = 0``, as in the reference.
- Split-KV (``NUM_SPLITS > 1``, from static sizes only): when the tokens and head blocks leave
  SMs idle, the third grid dimension cuts the entries into contiguous chunks (multiples of
  ``BLOCK_N``) whose fp32 partials ``(m, l, acc)`` ``combine_kernel`` merges, adding the sink
  once: the same single softmax.
- FP8 caches (``dsv4_ops/reference/fp8_cache.py``; ``FP8`` 1: the compressed pool, 2: the window
  source too): rows are gathered as bytes from their pages and decoded in registers
  (``fp8_codec``). The byte loads are inline (no pointer passed to a helper), so torch's mutation
  analysis never takes the read-only caches for written ones.
- Paged compressed pools (``CMP_PAGED``, ``block_table [B, P]``; ``reference.ops.paged_rows``):
  ``cmp`` is pages ``[num_pages, page, ...]`` shared by the rows, at its own (possibly padded)
  page stride; a block's entries are translated to physical ones when their indices are read,
  one block ahead, so the page lookup adds no dependent load in front of the row gather.

Backends: ROCm takes smaller tiles and one stage (:func:`attention_config`); the interpreter
multiplies through fp32 (``ieee_dot``). Why it stays short of its bytes floor (a dot feeding a dot
puts all warps on M, so both warpgroups compute the same scores, and ``tl`` cannot warp-specialise
pointer gathers; ``lowering/gluon/`` can) and the alternatives tried: docs/kernels.md.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# by name, not as `fc.<name>`: Inductor copies a wrap_triton kernel's source with the jit
# functions it names, never a module attribute (NameError 'fc' in a compiled graph)
from .fp8_codec import bf16_from_bytes, e4m3_hw, e4m3_to, load_kv_entries, pow2, word_aligned
from .launch import Launch, backend, block_table_args, cached_config, entries, launch, next_pow2, sm_count

__all__ = ["sparse_attention", "attention_config", "attention_launches", "attention_smem_bytes",
           "sparse_attention_kernel", "combine_kernel", "combine_launch", "ieee_dot", "AttentionLaunches"]

LOG2E = 1.4426950408889634
INTERPRET = bool(triton.knobs.runtime.interpret)  # read once, at import


@triton.jit
def ieee_dot(a, b, UPCAST: tl.constexpr):
    # Triton 3.6's interpreter multiplies bf16 operands as raw uint16 bits: there (only)
    # the operands go through fp32, which is exact for bf16/fp16 values.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _entry_index(v, W, K, widx_row, swi_w, cidx_row, sci_k):
    """Row index of virtual entries ``v``: window (kv_idx), picked (cmp_idx), dense prefix."""
    in_w = v < W
    in_k = (v >= W) & (v < W + K)
    wi = tl.load(widx_row + v * swi_w, mask=in_w, other=-1)
    ci = tl.load(cidx_row + (v - W) * sci_k, mask=in_k, other=-1)
    return tl.where(in_w, wi, tl.where(in_k, ci, v - W - K))


@triton.jit
def _physical_entry(v, idx, page, lane, W, NUM_PAGES, PAGE: tl.constexpr):
    """Compressed entries ``idx`` of virtual entries ``v`` (``lane``: in the row's pages) -> their
    index in the pages seen as one row, ``page * PAGE + slot``, from the looked-up ``page``;
    -1 for compressed entries off the row's pages; window entries unchanged."""
    page = tl.minimum(tl.maximum(page, 0), NUM_PAGES - 1)
    return tl.where(lane, page * PAGE + idx % PAGE, tl.where(v >= W, -1, idx))


@triton.jit
def _entry_rows(v, idx, hi, W, N_KV, N_CMP, kv_row0, skv_n, skv_d, cmp_row0, sc_n, sc_d, offs_d,
                sc_page, CMP_PAGE: tl.constexpr, CMP_PAGED: tl.constexpr):
    """Row pointers [BLOCK_N, BLOCK_D] (kv for window entries, cmp otherwise) and validity."""
    in_w = v < W
    valid = (v < hi) & (idx >= 0) & (idx < tl.where(in_w, N_KV, N_CMP))
    idx64 = idx.to(tl.int64)
    if CMP_PAGED:  # physical entries: page idx // CMP_PAGE at stride sc_page, slot idx % CMP_PAGE
        cmp_rows = cmp_row0 + (idx64 // CMP_PAGE) * sc_page + (idx64 % CMP_PAGE) * sc_n
    rows = tl.where(
        in_w[:, None],
        kv_row0 + idx64[:, None] * skv_n + offs_d[None, :] * skv_d,
        (cmp_rows[:, None] if CMP_PAGED else cmp_row0 + idx64[:, None] * sc_n) + offs_d[None, :] * sc_d,
    )
    return rows, valid


@triton.jit
def _online_softmax_step(q, e, valid, m_i, l_i, acc, scale_log2e, UPCAST_DOT: tl.constexpr):
    logits = ieee_dot(q, tl.trans(e), UPCAST_DOT) * scale_log2e
    logits = tl.where(valid[None, :], logits, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(logits, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(logits - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + ieee_dot(p.to(e.dtype), e, UPCAST_DOT)
    return m_new, l_i, acc


@triton.jit
def sparse_attention_kernel(
    q_ptr, kv_ptr, kv_idx_ptr, cmp_ptr, cmp_idx_ptr, cmp_len_ptr, sink_ptr, out_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr, block_table_ptr,
    scale_log2e,
    S, H, N_KV, N_CMP, W, K,
    CMP_ROWS, NUM_PAGES,  # rows cmp holds (paged: NUM_PAGES * CMP_PAGE; else N_CMP), its pages
    sq_b, sq_s, sq_h, sq_d,
    skv_b, skv_n, skv_d,
    swi_b, swi_s, swi_w,
    sc_b, sc_n, sc_d, sc_page,
    sci_b, sci_s, sci_k,
    scl_b, scl_s,
    so_b, so_s, so_h, so_d,
    sbt_b, sbt_p,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, UPCAST_DOT: tl.constexpr, FP8: tl.constexpr, FP8_WORDS: tl.constexpr,
    E4M3_HW: tl.constexpr,
    # the FP8 layout, static so that the page arithmetic is shifts and the row loads' alignment known
    KV_PAGE: tl.constexpr, CMP_PAGE: tl.constexpr, NOPE: tl.constexpr, DATA_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    CMP_PAGED: tl.constexpr,  # cmp is pages through the block table (CMP_PAGE entries each; sc_b = 0)
):
    pid_t = tl.program_id(0)  # query token b * S + s
    pid_h = tl.program_id(1)  # head block
    pid_sp = tl.program_id(2)  # split of the entry list
    # Triton's JIT types a Python float argument fp32, Inductor's codegen fp64: pin fp32 so
    # the loop-carried softmax state keeps one type either way
    scale_log2e = tl.cast(scale_log2e, tl.float32)
    b = (pid_t // S).to(tl.int64)
    s = (pid_t % S).to(tl.int64)

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    q = tl.load(
        q_ptr + b * sq_b + s * sq_s + offs_h[:, None] * sq_h + offs_d[None, :] * sq_d,
        mask=h_mask[:, None] & d_mask[None, :], other=0.0,
    )

    clen = tl.load(cmp_len_ptr + b * scl_b + s * scl_s)
    clen = tl.minimum(tl.maximum(clen, 0), N_CMP)
    total = W + K + clen
    if NUM_SPLITS > 1:
        chunk = tl.cdiv(tl.cdiv(total, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = pid_sp * chunk
        hi = tl.minimum(lo + chunk, total)
    else:
        lo = 0
        hi = total

    kv_row0 = kv_ptr + b * skv_b
    cmp_row0 = cmp_ptr + b * sc_b
    widx_row = kv_idx_ptr + b * swi_b + s * swi_s
    cidx_row = cmp_idx_ptr + b * sci_b + s * sci_s
    bt_row = block_table_ptr + b * sbt_b

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    # The entry indices are read one block ahead, so the row gather's address depends on no load
    # of its own iteration: Triton's pipeliner then keeps num_stages - 1 blocks of rows in flight
    # (with the index load inside the iteration it keeps one).
    # The page lookup (CMP_PAGED) is inline, twice: torch's mutation analysis may count a helper's
    # pointer arguments as written, and the block table is a graph input.
    v_next = lo + tl.arange(0, BLOCK_N)
    idx_next = _entry_index(v_next, W, K, widx_row, swi_w, cidx_row, sci_k)
    if CMP_PAGED:
        lane = (v_next >= W) & (idx_next >= 0) & (idx_next < N_CMP)
        page = tl.load(bt_row + (idx_next // CMP_PAGE) * sbt_p, mask=lane, other=0)
        idx_next = _physical_entry(v_next, idx_next, page, lane, W, NUM_PAGES, CMP_PAGE)
    for start in range(lo, hi, BLOCK_N):
        v = v_next
        idx = idx_next
        v_next = v + BLOCK_N
        idx_next = _entry_index(v_next, W, K, widx_row, swi_w, cidx_row, sci_k)
        if CMP_PAGED:
            lane = (v_next >= W) & (idx_next >= 0) & (idx_next < N_CMP)
            page = tl.load(bt_row + (idx_next // CMP_PAGE) * sbt_p, mask=lane, other=0)
            idx_next = _physical_entry(v_next, idx_next, page, lane, W, NUM_PAGES, CMP_PAGE)
        if FP8 == 0:
            rows, valid = _entry_rows(v, idx, hi, W, N_KV, CMP_ROWS, kv_row0, skv_n, skv_d, cmp_row0, sc_n, sc_d,
                                      offs_d, sc_page, CMP_PAGE, CMP_PAGED)
            e = tl.load(rows, mask=valid[:, None] & d_mask[None, :], other=0.0).to(q.dtype)
        else:
            in_w = v < W
            valid = (v < hi) & (idx >= 0) & (idx < tl.where(in_w, N_KV, CMP_ROWS))
            idx64 = idx.to(tl.int64)
            # FP8 lanes: page base, slot in page, footer (window lanes too when FP8 == 2)
            if FP8 == 2:
                lane8 = valid
                t = tl.where(in_w, idx % KV_PAGE, idx % CMP_PAGE)
                pbase = tl.where(in_w, kv_row0 + (idx // KV_PAGE).to(tl.int64) * skv_n,
                                 cmp_row0 + (idx // CMP_PAGE).to(tl.int64) * sc_n)
                footer = tl.where(in_w, KV_PAGE * DATA_BYTES, CMP_PAGE * DATA_BYTES)
            else:
                lane8 = valid & (v >= W)
                t = idx % CMP_PAGE
                pbase = cmp_row0 + (idx // CMP_PAGE).to(tl.int64) * sc_n
                footer = CMP_PAGE * DATA_BYTES
            data = pbase + t * DATA_BYTES
            scl = pbase + footer + t * SCALE_BYTES
            if FP8_WORDS:  # whole-row codes, one scale per block, whole rope values
                e = load_kv_entries(data, scl, lane8, NOPE, D, BLOCK_N, BLOCK_D, q.dtype, E4M3_HW)
            else:  # any layout: four byte gathers per channel
                is_nope = offs_d < NOPE
                is_rope = (offs_d >= NOPE) & d_mask
                m_nope = lane8[:, None] & is_nope[None, :]
                m_rope = lane8[:, None] & is_rope[None, :]
                code = tl.load(data[:, None] + offs_d[None, :], mask=m_nope, other=0)
                sc = tl.load(scl[:, None] + (offs_d // 64)[None, :], mask=m_nope, other=127)
                rb = data[:, None] + (NOPE + 2 * (offs_d - NOPE))[None, :]
                rope_lo = tl.load(rb, mask=m_rope, other=0)
                rope_hi = tl.load(rb + 1, mask=m_rope, other=0)
                e = tl.where(is_nope[None, :], e4m3_to(code, tl.float32, E4M3_HW) * pow2(sc),
                             bf16_from_bytes(rope_lo, rope_hi)).to(q.dtype)
            if FP8 == 1:  # window lanes from the float source (concat mode)
                ew = tl.load(kv_row0 + idx64[:, None] * skv_n + offs_d[None, :] * skv_d,
                             mask=(valid & in_w)[:, None] & d_mask[None, :], other=0.0).to(q.dtype)
                e = tl.where(in_w[:, None], ew, e)
        m_i, l_i, acc = _online_softmax_step(q, e, valid, m_i, l_i, acc, scale_log2e, UPCAST_DOT)

    if NUM_SPLITS == 1:
        sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_f = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_f)
        denom = l_i * alpha + tl.exp2(sink - m_f)
        o = acc * (alpha / denom)[:, None]
        tl.store(
            out_ptr + b * so_b + s * so_s + offs_h[:, None] * so_h + offs_d[None, :] * so_d,
            o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :],
        )
    else:
        row = (pid_t * NUM_SPLITS + pid_sp).to(tl.int64) * H + offs_h
        tl.store(part_m_ptr + row, m_i, mask=h_mask)
        tl.store(part_l_ptr + row, l_i, mask=h_mask)
        tl.store(part_acc_ptr + row[:, None] * D + offs_d[None, :], acc, mask=h_mask[:, None] & d_mask[None, :])


@triton.jit
def combine_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, sink_ptr, out_ptr,
    S, H,
    so_b, so_s, so_h, so_d,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """Merge the split partials of one token, head block and column block into the single
    softmax (columns are split too, so a batch-1 decode still spreads over many SMs)."""
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_d = tl.program_id(2)
    b = (pid_t // S).to(tl.int64)
    s = (pid_t % S).to(tl.int64)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D

    sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634
    m_f = sink
    for sp in range(NUM_SPLITS):
        row = (pid_t * NUM_SPLITS + sp).to(tl.int64) * H + offs_h
        m_f = tl.maximum(m_f, tl.load(part_m_ptr + row, mask=h_mask, other=float("-inf")))
    denom = tl.exp2(sink - m_f)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for sp in range(NUM_SPLITS):
        row = (pid_t * NUM_SPLITS + sp).to(tl.int64) * H + offs_h
        w = tl.exp2(tl.load(part_m_ptr + row, mask=h_mask, other=float("-inf")) - m_f)
        denom += w * tl.load(part_l_ptr + row, mask=h_mask, other=0.0)
        a = tl.load(part_acc_ptr + row[:, None] * D + offs_d[None, :], mask=h_mask[:, None] & d_mask[None, :], other=0.0)
        acc += w[:, None] * a
    o = acc / denom[:, None]
    tl.store(
        out_ptr + b * so_b + s * so_s + offs_h[:, None] * so_h + offs_d[None, :] * so_d,
        o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :],
    )


# --------------------------------------------------------------------------------------
# launch configuration: a pure function of static sizes (never of tensor values)
# --------------------------------------------------------------------------------------
_MIN_ENTRIES_PER_SPLIT = 64  # 2 blocks of 32: every split loops over at least two row blocks
_MAX_SPLITS = 16  # the range the split sweeps covered
# shared memory one program may use: sm_90 (H100/H200) opt-in maximum; gfx942 LDS (gfx950 has more)
SMEM_LIMIT = {"cuda": 232448, "hip": 65536}


def attention_smem_bytes(cfg: dict, elem_bytes: int, fp8: int = 0) -> int:
    """Upper estimate of ``sparse_attention_kernel``'s shared memory: the q tile plus
    ``num_stages`` blocks of entry rows (exact for the bf16 wgmma configs on sm_90).

    ``fp8``: the kernel's ``FP8`` mode. An FP8 row block stages its codes, rope and scales (1.25
    bytes a row element), mode 1 the float window rows too, plus one decoded row block of the dot
    dtype. An upper bound on purpose: the JIT may ask for more than a cross-compile reports."""
    q = elem_bytes * cfg["BLOCK_H"] * cfg["BLOCK_D"]
    block = cfg["BLOCK_N"] * cfg["BLOCK_D"]
    if fp8:
        per_stage = block * 5 // 4 + (block * elem_bytes if fp8 == 1 else 0)
        return q + cfg["num_stages"] * per_stage + block * elem_bytes
    return elem_bytes * cfg["BLOCK_D"] * (cfg["BLOCK_H"] + cfg["num_stages"] * cfg["BLOCK_N"])


@cached_config
def attention_config(B: int, S: int, H: int, D: int, max_entries: int, sms: int = 132,
                     num_splits: int | None = None, backend: str = "cuda",
                     dtype: torch.dtype = torch.bfloat16, fp8: int = 0) -> dict:
    """Block sizes, warps, stages and split count: a pure function of static sizes.

    ``max_entries`` is the static length of a query's entry list the split rule plans for
    (the launcher uses ``W + K`` for CSA (``K > 0``) and ``W + Nc`` otherwise).
    ``backend`` is ``"cuda"`` or ``"hip"`` (wave64, no wgmma); ``dtype`` that of the rows
    (the queries' for an FP8 cache, ``fp8`` 1 or 2, whose rows are decoded to it).

    D = 512 (V4), 2-byte dtypes: sm_90 ``BLOCK_H=64, BLOCK_N=32``, 8 warps, 4 stages: wgmma, no
    spills, one program per SM (the fastest measured, docs/kernels.md). gfx942/gfx950
    ``BLOCK_H=32, BLOCK_N=16``, 4 warps, 1 stage: the largest tile without VGPR/SGPR spills.
    4-byte dtypes take half the heads per program (their IEEE dots run on FMA units with the
    operands in registers) and as many stages as fit ``SMEM_LIMIT`` (:func:`attention_smem_bytes`).
    FP8 caches (``fp8``: the kernel's ``FP8`` mode) on CUDA take 3 stages where they fit, and
    32-row blocks like the float cache's, so both round the bf16 probabilities alike.

    Split-KV: one program fills an SM, so the largest ``num_splits`` with
    ``B*S*head_blocks*num_splits <= sms`` (one wave), at most ``_MAX_SPLITS`` splits of at least
    ``_MIN_ENTRIES_PER_SPLIT`` entries.
    """
    block_d = next_pow2(D)
    hip = backend == "hip"
    elem_bytes = dtype.itemsize
    if block_d >= 256:
        block_h = min(max(16, next_pow2(H)), (32 if hip else 64) // (2 if elem_bytes >= 4 else 1))
        block_n = 16 if hip else 32
        num_warps = 8 if (not hip and block_h * block_d >= 32 * 512) else 4
        num_stages = 1 if hip else 4
        if fp8 and not hip:  # FP8 rows stage fewer bytes: 3 stages
            num_stages = 3
    else:
        block_h = min(max(16, next_pow2(H)), 64)
        block_n = 32 if hip else 64
        num_warps = 4
        num_stages = 1 if hip else 2
    cfg = dict(BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps, num_stages=num_stages,
               E4M3_HW=e4m3_hw(backend))
    while cfg["num_stages"] > 1 and attention_smem_bytes(cfg, elem_bytes, fp8) > SMEM_LIMIT[backend]:
        cfg["num_stages"] -= 1
    head_blocks = -(-H // block_h)
    programs = B * S * head_blocks
    if num_splits is None:
        one_wave = sms // max(programs, 1)
        num_splits = min(one_wave, max_entries // _MIN_ENTRIES_PER_SPLIT, _MAX_SPLITS)
    return dict(cfg, NUM_SPLITS=max(1, int(num_splits)))


class AttentionLaunches(NamedTuple):
    out: torch.Tensor  # [B, S, H, D] in q.dtype
    attention: Launch | None  # sparse_attention_kernel (None: empty output)
    combine: Launch | None  # combine_kernel (None: no split-KV)


def attention_launches(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_idx: torch.Tensor,
    cmp: torch.Tensor,
    cmp_idx: torch.Tensor,
    cmp_len: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    config: dict | None = None,
    max_entries: int | None = None,
    block_table: torch.Tensor | None = None,
) -> AttentionLaunches:
    """The output and the launches that fill it, for the arguments of :func:`sparse_attention`
    (``block_table [B, P]``: ``cmp`` is pages ``[num_pages, page, ...]`` read through it)."""
    B, S, H, D = q.shape
    W, K = kv_idx.shape[-1], cmp_idx.shape[-1]
    paged = block_table is not None
    # FP8 caches: [B, pages, page, entry_bytes], or cmp as pages [num_pages, page, entry_bytes]
    kv8, cmp8 = kv.dim() == 4, cmp.dim() == 4 or (paged and cmp.dtype == torch.uint8)
    N_KV, N_CMP = entries(kv), entries(cmp, block_table)
    if N_CMP == 0:  # no compressed entries: nothing to look up
        paged = False
    sink = sink.contiguous()
    if kv8 and not cmp8:
        if N_CMP:
            raise ValueError("sparse_attention: an FP8 window source needs an FP8 compressed pool")
        # a sliding-window layer has no pool (an empty float stand-in): the window's pages stand in
        # for it, never read (no entries), so the kernel keeps one FP8 mode for both sources
        cmp, cmp8 = kv, True
    if not cmp8 and kv.dtype != cmp.dtype:
        raise ValueError(f"sparse_attention: kv ({kv.dtype}) and cmp ({cmp.dtype}) must share a dtype")
    fp8 = 2 if kv8 else (1 if cmp8 else 0)
    page_kv = kv.shape[2] if kv8 else 1
    page_cmp = cmp.shape[1] if paged else (cmp.shape[2] if cmp8 else 1)
    nope = data_bytes = scale_bytes = fp8_words = 0
    if cmp8:
        rope = _rope_of(cmp, D)
        nope, data_bytes = D - rope, D + rope
        scale_bytes = cmp.shape[-1] - data_bytes
    # the word-wide FP8 reader (fp8_codec.load_kv_entries): rope within one 64-channel block,
    # every entry 4-byte aligned (storage offsets, page / batch strides and the data width)
    fp8_words = int(cmp8 and D - nope <= 64 and data_bytes % 4 == 0
                    and word_aligned(*((kv, cmp) if kv8 else (cmp,))))
    if out is None:
        out = torch.empty((B, S, H, D), dtype=q.dtype, device=q.device)
    if B * S * H * D == 0:
        return AttentionLaunches(out, None, None)
    if max_entries is None:
        max_entries = W + (K if K > 0 else N_CMP)
    wide = q.dtype if fp8 or q.element_size() >= kv.element_size() else kv.dtype
    cfg = dict(config) if config is not None else attention_config(
        B, S, H, D, max_entries, sm_count(q.device), num_splits, backend(), wide, fp8=fp8)
    if num_splits is not None:
        cfg["NUM_SPLITS"] = num_splits
    splits = cfg["NUM_SPLITS"]
    # zero-size tensors never get dereferenced (masked) but need a real pointer
    if (N_KV == 0 or W == 0) and not kv8:
        kv, N_KV = cmp if N_CMP > 0 and not cmp8 else q.new_empty((B, 1, D), dtype=kv.dtype), 0
    if N_CMP == 0:
        cmp = kv if kv.numel() > 0 else q.new_empty((B, 1, D), dtype=kv.dtype)
    if W == 0:
        kv_idx = cmp_len[..., None]
    if K == 0:
        cmp_idx = cmp_len[..., None]
    if paged:  # dim 0 of the pages is the page (sc_page); FP8 pages address entries from the page base
        cmp_strides = (0, cmp.stride(0), 1, cmp.stride(0)) if cmp8 else (0, cmp.stride(1), cmp.stride(2), cmp.stride(0))
    else:
        cmp_strides = (*_row_strides(cmp), 0)
    ptr, *table_rest = block_table_args(block_table, cmp, cmp_len)
    table = (ptr, cmp.shape[0] * page_cmp if paged else N_CMP, *table_rest)
    if splits > 1:
        part_m = torch.empty((B * S, splits, H), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((B * S, splits, H, D), dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused
    attention = Launch(
        (B * S, -(-H // cfg["BLOCK_H"]), splits),
        (q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, out, part_m, part_l, part_acc, table[0],
         float(scale) * LOG2E,
         S, H, N_KV, N_CMP, W, K, *table[1:3],
         *q.stride(), *_row_strides(kv), *kv_idx.stride(), *cmp_strides, *cmp_idx.stride(),
         *cmp_len.stride(), *out.stride(), *table[3:]),
        dict(KV_PAGE=page_kv, CMP_PAGE=page_cmp, NOPE=nope, DATA_BYTES=data_bytes, SCALE_BYTES=scale_bytes,
             CMP_PAGED=paged,
             D=D, BLOCK_D=cfg["BLOCK_D"], BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"],
             NUM_SPLITS=splits, UPCAST_DOT=INTERPRET, FP8=fp8, FP8_WORDS=fp8_words if fp8 else 0,
             E4M3_HW=cfg.get("E4M3_HW", e4m3_hw(backend())) if fp8 else 0,
             num_warps=cfg["num_warps"],
             num_stages=cfg["num_stages"]),
    )
    combine = None
    if splits > 1:
        combine = combine_launch(part_m, part_l, part_acc, sink, out, cfg["BLOCK_D"])
    return AttentionLaunches(out, attention, combine)


def combine_launch(part_m, part_l, part_acc, sink, out, block_d: int) -> Launch:
    """The ``combine_kernel`` launch that merges the split partials ``[B * S, splits, H(, D)]`` into ``out [B, S, H,
    D]``: a program per token, 16 heads and ``min(128, block_d)`` columns (the Gluon kernels' splits too: other tiles
    measured no different)."""
    B, S, H, D = out.shape
    block_h_c = min(16, max(1, next_pow2(H)))
    block_d_c = min(128, block_d)
    return Launch(
        (B * S, -(-H // block_h_c), -(-D // block_d_c)),
        (part_m, part_l, part_acc, sink, out, S, H, *out.stride()),
        dict(D=D, BLOCK_D=block_d_c, BLOCK_H=block_h_c, NUM_SPLITS=part_m.shape[1], num_warps=4),
    )


def _row_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, row, channel) strides; an FP8 cache's "row" stride is its page stride (bytes)."""
    return (t.stride(0), t.stride(1), 1) if t.dim() == 4 else t.stride()


def _rope_of(cache: torch.Tensor, D: int) -> int:
    """Rope dims of an FP8 KV cache of ``D``-wide entries (``fp8_cache.KVLayout.of``'s rule)."""
    for nope in range(0, D + 1, 64):
        rope = D - nope
        if nope + 2 * rope + -(-(nope // 64) // 8) * 8 == cache.shape[-1]:
            return rope
    raise ValueError(f"sparse_attention: no FP8 KV layout of {D}-wide entries has {cache.shape[-1]} bytes per entry")


def sparse_attention(*args, **kwargs) -> torch.Tensor:
    """Raw launcher with the reference signature plus ``out=``, ``num_splits=``, ``config=``
    and ``max_entries=`` (those of :func:`attention_launches`, for tests and sweeps); returns
    ``out`` ``[B, S, H, D]`` in ``q.dtype``. ``kv`` and ``cmp`` must share a dtype (rows are cast
    to ``q.dtype`` for the dots; fp32 inputs use IEEE fp32 dots). Indices outside ``[0, rows)``
    are skipped like ``-1``, ``cmp_len`` is clamped to ``[0, Nc]`` (the raw-op contract)."""
    launches = attention_launches(*args, **kwargs)
    launch(sparse_attention_kernel, launches.attention)
    launch(combine_kernel, launches.combine)
    return launches.out
