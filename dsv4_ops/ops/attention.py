"""``dsv4::sparse_attention``: MQA over window ∪ compressed entries with a per-head sink."""
from typing import Optional

import torch
from torch import Tensor
from torch.library import wrap_triton

from ..lowering.triton import sparse_attention as sa
from ..lowering.triton.sparse_attention import combine_kernel, sparse_attention_kernel
from ..reference import fp8_cache as fp8
from ..reference import ops as ref
from . import validate as v
from . import attention_sm90 as sm90
from ._backend import check, use_triton
from .direct import dsv4


@torch.library.triton_op("dsv4::sparse_attention", mutates_args=())
def _sparse_attention(
    q: Tensor, kv: Tensor, kv_idx: Tensor, cmp: Tensor, cmp_idx: Tensor, cmp_len: Tensor, sink: Tensor, scale: float,
    block_table: Optional[Tensor] = None,
) -> Tensor:
    # Also the fake: shape checks, then a static device branch (see _backend.py).
    # kv / cmp may be FP8 paged caches (rank-4 uint8, or cmp rank-3 uint8 pages with a block
    # table; static): dequantised where they are read
    paged = block_table is not None
    kv8, cmp8 = fp8.is_fp8_cache(kv), fp8.is_fp8_cache(cmp, paged)
    check(q.dim() == 4 and (kv.dim() == 3 or kv8) and (cmp.dim() == 3 or cmp8),
          lambda: "sparse_attention: q [B, S, H, D], kv [B, N, D], cmp [B, Nc, D] (or FP8 caches)")
    check(kv_idx.dim() == 3 and cmp_idx.dim() == 3 and cmp_len.dim() == 2 and sink.dim() == 1,
          lambda: "sparse_attention: kv_idx [B, S, W], cmp_idx [B, S, K], cmp_len [B, S], sink [H]")
    check(kv.shape[0] == q.shape[0] and (paged or cmp.shape[0] == q.shape[0]),
          lambda: "sparse_attention: B of kv / cmp and q differ")
    check(not paged or (block_table.dim() == 2 and block_table.shape[0] == q.shape[0]),
          lambda: "sparse_attention: block_table must be [B, P], B of q")
    check(kv_idx.shape[:2] == q.shape[:2] and cmp_idx.shape[:2] == q.shape[:2]
          and cmp_len.shape == q.shape[:2], lambda: "sparse_attention: [B, S] of the indices and q differ")
    check(kv8 or kv.shape[-1] == q.shape[-1], lambda: "sparse_attention: D of kv and q differ")
    check(cmp8 or cmp.shape[-1] == q.shape[-1], lambda: "sparse_attention: D of cmp and q differ")
    check(sink.shape[0] == q.shape[2], lambda: "sparse_attention: sink must have H entries")
    check(kv8 or cmp8 or kv.dtype == cmp.dtype,
          lambda: f"sparse_attention: kv ({kv.dtype}) and cmp ({cmp.dtype}) must share a dtype")
    if use_triton(q) and sm90.applies(q, kv, kv_idx, cmp, cmp_idx, cmp_len, block_table):
        picks = -1
        if paged:
            picks = cmp_idx.shape[-1]
            cmp_idx, cmp_len = sm90.paged_entries(cmp, cmp_idx, cmp_len, block_table)
        return dsv4.sparse_attention_sm90(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale, picks)
    if use_triton(q):
        launches = sa.attention_launches(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale, block_table=block_table)
        main, combine = launches.attention, launches.combine
        if main is not None:
            wrap_triton(sparse_attention_kernel)[main.grid](*main.args, **main.meta)
        if combine is not None:
            wrap_triton(combine_kernel)[combine.grid](*combine.args, **combine.meta)
        return launches.out
    return ref.sparse_attention(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale, block_table).contiguous()


def sparse_attention(
    q: Tensor, kv: Tensor, kv_idx: Tensor, cmp: Tensor, cmp_idx: Tensor, cmp_len: Tensor, sink: Tensor, scale: float,
    block_table: Tensor | None = None,
) -> Tensor:
    """Attention of each query over its window rows and compressed entries, one softmax with a sink.

    One shared vector per entry serves as key and value (MQA). Entries of query ``(b, s)``:
    ``kv[b, kv_idx[b, s, :]]``, ``cmp[b, cmp_idx[b, s, :]]`` (skipping ``-1``) and the dense
    prefix ``cmp[b, :cmp_len[b, s]]``. With ``l_j = scale * q[b, s, h] . e_j``:
    ``o = sum_j exp(l_j) e_j / (sum_j exp(l_j) + exp(sink[h]))``, math in fp32. A query with no
    entries gets zeros.

    The raw op ``torch.ops.dsv4.sparse_attention`` checks shapes only; on every backend it
    skips indices outside ``[0, N)`` / ``[0, Nc)`` like ``-1`` and clamps ``cmp_len`` to
    ``[0, Nc]``. This wrapper rejects such values instead.

    Args:
        q: ``[B, S, H, D]`` float queries.
        kv: ``[B, N, D]`` window source (the ring, or ``cat(ring, new kv)`` in concat mode),
            same dtype as ``q``; or an FP8 KV cache ``uint8 [B, pages, page, entry_bytes]``
            (``N = pages * page``, ``dsv4_ops/reference/fp8_cache.py``; then ``cmp`` is FP8 too, or
            empty: ``[B, 0, D]`` in ``q``'s dtype for a layer without a pool).
        kv_idx: ``[B, S, W] int32`` rows of ``kv``, ``-1`` or ``0 .. N-1``.
        cmp: ``[B, Nc, D]`` compressed pool, same dtype as ``q``; ``Nc`` may be 0. Or an FP8
            KV cache (``Nc = pages * page``).
        cmp_idx: ``[B, S, K] int32`` picked entries (CSA), ``-1`` or ``0 .. Nc-1``; ``K`` may be 0.
        cmp_len: ``[B, S] int32`` dense-prefix length in ``0 .. Nc`` (HCA; 0 otherwise).
        sink: ``[H] float32`` per-head sink logit (a zero value vector).
        scale: softmax scale.
        block_table: ``[B, P] int32`` page ids in ``0 .. num_pages-1``; ``cmp`` is then a paged
            pool ``[num_pages, page, D]`` (or FP8 pages ``uint8 [num_pages, page, entry_bytes]``,
            whose page stride may be padded), entry ``i < Nc = P * page`` of row ``b`` at slot
            ``i % page`` of page ``block_table[b, i // page]`` (``reference.ops.paged_rows``);
            ``cmp_idx`` / ``cmp_len`` still count entries ``i``. The window source stays per row.

    Returns ``[B, S, H, D]`` in ``q.dtype``, contiguous.
    """
    v.once_per_signature(_check_arguments, q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, block_table)
    if v.checks_op_values(kv_idx, cmp_idx, cmp_len, *v.present(block_table)):
        op, nc = "sparse_attention", v.entries(cmp, block_table)
        v.run_value_checks(*v.block_table_checks(op, block_table, cmp),
                           v.index_range_check(op, "kv_idx", kv_idx, v.entries(kv), "kv rows"),
                           v.index_range_check(op, "cmp_idx", cmp_idx, nc, "cmp entries"),
                           v.in_range_check(op, "cmp_len", cmp_len, 0, nc, f"cmp entries Nc={nc}"))
    return dsv4.sparse_attention(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale, block_table)


def _check_arguments(q: Tensor, kv: Tensor, kv_idx: Tensor, cmp: Tensor, cmp_idx: Tensor, cmp_len: Tensor,
                     sink: Tensor, block_table: Tensor | None) -> None:
    """The metadata checks of :func:`sparse_attention` (ranks, dtypes, matching dims, devices)."""
    op = "sparse_attention"
    paged = block_table is not None
    v.rank(op, "q", q, "[B, S, H, D]")
    if kv.dtype != torch.uint8:
        v.rank(op, "kv", kv, "[B, N, D]")
    v.rank(op, "kv_idx", kv_idx, "[B, S, W]")
    if cmp.dtype != torch.uint8:
        v.rank(op, "cmp", cmp, "[num_pages, page, D]" if paged else "[B, Nc, D]")
    v.rank(op, "cmp_idx", cmp_idx, "[B, S, K]")
    v.rank(op, "cmp_len", cmp_len, "[B, S]")
    v.rank(op, "sink", sink, "[H]")
    v.floating(op, "q", q)
    B, S, H, D = q.shape
    for name, t in (("kv", kv), ("cmp", cmp)):
        if t.dtype == torch.uint8:
            v.fp8_kv_cache(op, name, t, D, paged and name == "cmp")
        else:
            v.same_dtype(op, name, t, "q", q)
    if kv.dtype == torch.uint8 and cmp.dtype != torch.uint8 and v.entries(cmp, block_table) != 0:
        # a sliding-window layer has no pool: an empty float cmp (what the model passes) is served
        v.fail(op, f"an FP8 window source kv needs an FP8 compressed pool cmp (both come from one FP8 cache) "
                   f"or an empty one, got a {cmp.dtype} pool of {cmp.shape[1]} entries")
    v.dtype(op, "kv_idx", kv_idx, torch.int32)
    v.dtype(op, "cmp_idx", cmp_idx, torch.int32)
    v.dtype(op, "cmp_len", cmp_len, torch.int32)
    v.dtype(op, "sink", sink, torch.float32)
    for name, t in (("kv", kv), ("cmp", cmp)):
        if not (paged and name == "cmp"):
            v.dim(op, name, t, 0, B, "B of q")
        if t.dtype != torch.uint8:
            v.dim(op, name, t, 2, D, "D of q")
    if paged:
        v.block_table(op, block_table, cmp)
        v.dim(op, "block_table", block_table, 0, B, "B of q")
    for name, t in (("kv_idx", kv_idx), ("cmp_idx", cmp_idx), ("cmp_len", cmp_len)):
        v.dim(op, name, t, 0, B, "B of q")
        v.dim(op, name, t, 1, S, "S of q")
    v.dim(op, "sink", sink, 0, H, "H of q")
    v.same_device(op, q=q, kv=kv, kv_idx=kv_idx, cmp=cmp, cmp_idx=cmp_idx, cmp_len=cmp_len, sink=sink,
                  block_table=block_table)
