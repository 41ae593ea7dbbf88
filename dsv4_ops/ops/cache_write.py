"""``dsv4::cache_write``: scatter new rows into a ring or pool by slot (mutating)."""
from typing import Optional

import torch
from torch import Tensor
from torch.library import wrap_triton

from ..lowering.triton import cache_write as cw
from ..lowering.triton.cache_write import cache_write_kernel, fp8_cache_write_kernel
from ..reference import fp8_cache as fp8
from ..reference import ops as ref
from . import validate as v
from ._backend import check, use_triton
from .direct import dsv4


@torch.library.triton_op("dsv4::cache_write", mutates_args=("cache",))
def _cache_write(cache: Tensor, values: Tensor, slots: Tensor, block_table: Optional[Tensor] = None) -> None:
    # Also the fake: shape checks, then a static device branch (see _backend.py). An FP8 cache
    # (rank-4 uint8, or rank-3 uint8 pages with a block table; static) takes the quantising
    # kernel / reference.
    paged = block_table is not None
    is_fp8 = fp8.is_fp8_cache(cache, paged)
    check((cache.dim() == 3 or is_fp8) and values.dim() == 3 and slots.dim() == 2,
          lambda: "cache_write: cache [B, N, C] (or FP8 [B, pages, page, bytes]), values [B, S, C], slots [B, S]")
    B = block_table.shape[0] if paged else cache.shape[0]
    check(not paged or block_table.dim() == 2, lambda: "cache_write: block_table must be [B, P]")
    check(values.shape[0] == B and slots.shape[0] == B,
          lambda: "cache_write: B of values/slots must match cache (block_table when paged)")
    check(values.shape[1] == slots.shape[1], lambda: "cache_write: S of values and slots differ")
    if is_fp8:
        lay = fp8.KVLayout.of(cache, values.shape[2])
    else:
        check(values.shape[2] == cache.shape[2], lambda: "cache_write: C of values and cache differ")
    if not use_triton(cache):
        ref.cache_write(cache, values, slots, block_table)
    elif is_fp8:
        spec = cw.fp8_cache_write_launch(cache, values, slots, lay.rope, lay.data_bytes, lay.scale_bytes, block_table)
        if spec is not None:
            wrap_triton(fp8_cache_write_kernel)[spec.grid](*spec.args, **spec.meta)
    else:
        spec = cw.cache_write_launch(cache, values, slots, block_table)
        if spec is not None:
            wrap_triton(cache_write_kernel)[spec.grid](*spec.args, **spec.meta)


def cache_write(cache: Tensor, values: Tensor, slots: Tensor, block_table: Tensor | None = None) -> None:
    """``cache[b, slots[b, s]] = values[b, s]`` for every ``slots[b, s] >= 0``; in place.

    Args:
        cache: ``[B, N, C]`` ring or pool (any float dtype; may be a view, e.g. one layer of a
            stacked buffer). Rows not addressed keep their content.
        values: ``[B, S, C]`` new rows, same dtype as ``cache``.
        slots: ``[B, S] int32`` target row per new row: ``0 .. N-1``, or ``-1`` = skip.
            The non-negative slots of one row must be distinct (``plan``'s ``*_write`` are).

    Serves the window ring (``plan.win_write``), the compressor-input rings
    (``plan.csa_write`` / ``plan.hca_write``) and any pool. Returns ``None``.

    ``cache`` may also be an FP8 KV cache (``uint8 [B, pages, page, entry_bytes]``,
    ``dsv4_ops/reference/fp8_cache.py``; ``N = pages * page``): each row is quantised on write.

    ``block_table``: ``[B, P] int32`` page ids in ``0 .. num_pages-1``; ``cache`` is then a paged
    pool ``[num_pages, page, C]`` (or FP8 pages ``uint8 [num_pages, page, entry_bytes]``, whose
    page stride may be padded, e.g. to FlashMLA's multiple of 576 bytes), and row ``b``'s entry
    ``i < N = P * page`` is slot ``i % page`` of page ``block_table[b, i // page]``
    (``dsv4_ops.reference.ops.paged_rows``).

    The raw op ``torch.ops.dsv4.cache_write`` checks shapes only; on every backend it skips
    slots outside ``[0, N)`` like ``-1``. This wrapper rejects such slots (and repeated ones,
    whose write order no backend defines) instead.
    """
    v.once_per_signature(_check_arguments, cache, values, slots, block_table)
    if v.checks_op_values(slots, *v.present(block_table)):
        op = "cache_write"
        v.run_value_checks(v.index_range_check(op, "slots", slots, v.entries(cache, block_table), "cache rows"),
                           v.distinct_per_row_check(op, "slots", slots),
                           *v.block_table_checks(op, block_table, cache))
    dsv4.cache_write(cache, values, slots, block_table)


def _check_arguments(cache: Tensor, values: Tensor, slots: Tensor, block_table: Tensor | None) -> None:
    """The metadata checks of :func:`cache_write` (ranks, dtypes, matching dims, devices)."""
    op = "cache_write"
    v.rank(op, "values", values, "[B, S, C]")
    paged = block_table is not None
    if cache.dtype == torch.uint8:
        v.fp8_kv_cache(op, "cache", cache, values.shape[2], paged)
        v.floating(op, "values", values)
    else:
        v.rank(op, "cache", cache, "[num_pages, page, C]" if paged else "[B, N, C]")
        v.same_dtype(op, "values", values, "cache", cache)
        v.dim(op, "values", values, 2, cache.shape[2], "C of cache")
    v.rank(op, "slots", slots, "[B, S]")
    v.dtype(op, "slots", slots, torch.int32)
    B, of_b = (block_table.shape[0], "B of block_table") if paged else (cache.shape[0], "B of cache")
    v.dim(op, "values", values, 0, B, of_b)
    v.dim(op, "slots", slots, 0, B, of_b)
    v.dim(op, "slots", slots, 1, values.shape[1], "S of values")
    if paged:
        v.block_table(op, block_table, cache)
    v.same_device(op, cache=cache, values=values, slots=slots, block_table=block_table)
