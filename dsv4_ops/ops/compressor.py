"""``dsv4::compress``: pooled, normed, roped entry of every block a step completes (mutating)."""
from typing import Optional

import torch
from torch import Tensor
from torch.library import wrap_triton

from ..lowering.triton import compress as cp
from ..lowering.triton.compress import compress_kernel
from ..reference import fp8_cache as fp8
from ..reference import ops as ref
from . import validate as v
from ._backend import check, use_triton
from .direct import dsv4


@torch.library.triton_op("dsv4::compress", mutates_args=("pool",))
def _compress(
    ring_kv: Tensor, ring_gate: Tensor, new_kv: Tensor, new_gate: Tensor, start: Tensor, emit: Tensor,
    norm_weight: Tensor, cos: Tensor, sin: Tensor, pool: Tensor, ratio: int, overlap: bool, eps: float,
    block_table: Optional[Tensor] = None,
) -> None:
    # Also the fake: shape checks, then a static device branch (see _backend.py). CUDA/ROCm:
    # one fused kernel (softmax pooling + RMSNorm + RoPE + pool write) per emitted block.
    # An FP8 pool (rank-4 uint8, or rank-3 uint8 pages with a block table; static) is written
    # quantised: KV layout or indexer keys.
    paged = block_table is not None
    pool8 = fp8.is_fp8_cache(pool, paged)
    check((pool.dim() == 3 or pool8) and ring_kv.dim() == 3 and new_kv.dim() == 3
          and emit.dim() == 2, lambda: "compress: ring/new must be 3-d, pool 3-d (or FP8) and emit [B, E]")
    check(not paged or block_table.dim() == 2, lambda: "compress: block_table must be [B, P]")
    c = 2 if overlap else 1
    d = new_kv.shape[-1] // c if pool8 else pool.shape[-1]
    check(ring_kv.shape[-1] == c * d, lambda: f"compress: ring_kv last dim must be {c}*d")
    check(new_kv.shape[-1] == c * d, lambda: f"compress: new_kv last dim must be {c}*d")
    check(ring_gate.shape == ring_kv.shape and new_gate.shape == new_kv.shape,
          lambda: "compress: gates must have the shapes of their kv")
    B = block_table.shape[0] if paged else pool.shape[0]
    check(ring_kv.shape[0] == B and new_kv.shape[0] == B and start.dim() == 1 and start.shape[0] == B
          and emit.shape[0] == B, lambda: "compress: B of ring/new/start/emit and pool (block_table) differ")
    check(2 * cos.shape[-1] <= d, lambda: "compress: rope dims 2*cos.shape[-1] exceed d")
    check(ratio > 0, lambda: "compress: ratio must be > 0")  # a block of no slots has no softmax
    args = (ring_kv, ring_gate, new_kv, new_gate, start, emit, norm_weight, cos, sin, pool, ratio, overlap, eps,
            block_table)
    if use_triton(pool):
        spec = cp.compress_launch(*args)
        if spec is not None:
            wrap_triton(compress_kernel)[spec.grid](*spec.args, **spec.meta)
    else:
        ref.compress(*args)


def compress(
    ring_kv: Tensor, ring_gate: Tensor, new_kv: Tensor, new_gate: Tensor, start: Tensor, emit: Tensor,
    norm_weight: Tensor, cos: Tensor, sin: Tensor, pool: Tensor, ratio: int, overlap: bool, eps: float,
    block_table: Tensor | None = None,
) -> None:
    """Write the compressed entry of every block in ``emit`` into ``pool``; in place.

    Entry ``i`` pools block ``[m*i, m*i + m)`` (``m = ratio``): per channel
    ``sum_slots softmax_slots(gate) * kv`` in fp32, then RMSNorm(``norm_weight``, ``eps``),
    then interleaved RoPE on the last ``r = 2 * cos.shape[-1]`` channels at position ``m*i``;
    stored at ``pool[b, i]``. With ``overlap`` (CSA) the slots are the first ``d`` channels of
    block ``i-1``'s tokens (weight 0 for ``i = 0``) and the last ``d`` of block ``i``'s.

    Args:
        ring_kv, ring_gate: ``[B, R, c*d]`` compressor inputs of earlier tokens, position ``p``
            at slot ``p % R`` (``c = 2`` if ``overlap`` else 1, ``d = pool.shape[-1]``);
            gate rows include the position bias. ``R >= c*m``.
        new_kv, new_gate: ``[B, S, c*d]`` this step's rows; position ``p >= start`` is read
            from row ``p - start`` here, never from the ring. Same dtypes as the rings.
        start: ``[B] int32`` position of each row's first new token.
        emit: ``[B, E] int32`` blocks to emit (``plan``'s ``*_emit``), ``-1`` = none. A block
            must end inside the new rows (``m*(i+1) <= start + S``) and its earliest position
            must still be in the ring (``>= start - R``).
        norm_weight: ``[d]`` RMSNorm weight.  cos, sin: ``[P, r/2]`` rope tables, ``r <= d``,
            ``P > m*i`` for every emitted ``i``.
        pool: ``[B, N, d]`` float pool; only the emitted indices (``< N``) are written. Or an
            FP8 pool ``uint8 [B, pages, page, entry_bytes]`` (``N = pages * page``,
            ``dsv4_ops/reference/fp8_cache.py``): the KV layout, or, when ``entry_bytes == d + 4``,
            indexer keys (Hadamard-rotated, then quantised); entries are quantised on write.
        ratio: ``m >= 1``.  overlap: CSA layout.  eps: RMSNorm epsilon.
        block_table: ``[B, P] int32`` page ids in ``0 .. num_pages-1``; ``pool`` is then a paged
            pool ``[num_pages, page, d]`` (or FP8 pages ``uint8 [num_pages, page, entry_bytes]``,
            whose page stride may be padded), entry ``i < N = P * page`` of row ``b`` at slot
            ``i % page`` of page ``block_table[b, i // page]`` (``reference.ops.paged_rows``).

    Call it before writing this step's rows into the ring (``cache_write`` with
    ``plan.*_write``): the ring then still holds the open block's earlier tokens.

    The raw op ``torch.ops.dsv4.compress`` checks shapes only; on every backend it skips
    ``emit`` entries outside ``[0, N)`` like ``-1`` and leaves an entry whose rope row is past
    the table (``m*i >= P``) unrotated; a block that is incomplete or older than the ring
    pools whatever rows its positions map to. This wrapper rejects all of these instead.
    """
    v.once_per_signature(_check_arguments, ring_kv, ring_gate, new_kv, new_gate, start, emit, norm_weight, cos, sin,
                         pool, ratio, overlap, block_table)
    if v.checks_op_values(start, emit, *v.present(block_table)):
        _check_values(ring_kv, new_kv, start, emit, cos, pool, ratio, overlap, block_table)
    dsv4.compress(ring_kv, ring_gate, new_kv, new_gate, start, emit, norm_weight, cos, sin, pool, ratio,
                  overlap, eps, block_table)


def _check_arguments(
    ring_kv: Tensor, ring_gate: Tensor, new_kv: Tensor, new_gate: Tensor, start: Tensor, emit: Tensor,
    norm_weight: Tensor, cos: Tensor, sin: Tensor, pool: Tensor, ratio: int, overlap: bool,
    block_table: Tensor | None,
) -> None:
    """The metadata checks of :func:`compress` (ranks, dtypes, widths, the FP8 layout, ring size, devices)."""
    op = "compress"
    pool8 = pool.dtype == torch.uint8
    paged = block_table is not None
    for name, t, layout in (("ring_kv", ring_kv, "[B, R, c*d]"), ("ring_gate", ring_gate, "[B, R, c*d]"),
                            ("new_kv", new_kv, "[B, S, c*d]"), ("new_gate", new_gate, "[B, S, c*d]"),
                            ("pool", pool, "[num_pages, page, d]" if paged else "[B, N, d]")):
        if name == "pool" and pool8:
            continue
        v.rank(op, name, t, layout)
        v.floating(op, name, t)
    v.rank(op, "start", start, "[B]")
    v.rank(op, "emit", emit, "[B, E]")
    v.rank(op, "norm_weight", norm_weight, "[d]")
    v.rank(op, "cos", cos, "[P, r/2]")
    v.rank(op, "sin", sin, "[P, r/2]")
    v.dtype(op, "start", start, torch.int32)
    v.dtype(op, "emit", emit, torch.int32)
    v.same_dtype(op, "new_kv", new_kv, "ring_kv", ring_kv)
    v.same_dtype(op, "new_gate", new_gate, "ring_gate", ring_gate)
    for name, t in (("norm_weight", norm_weight), ("cos", cos), ("sin", sin)):
        v.floating(op, name, t)
    v.at_least(op, "ratio", ratio, 1)
    c = 2 if overlap else 1
    B = block_table.shape[0] if paged else pool.shape[0]
    if pool8:
        d = new_kv.shape[-1] // c
        if pool.dim() == (3 if paged else 4) and pool.shape[-1] == d + 4:
            if d & (d - 1):
                v.fail(op, f"FP8 indexer keys need a power-of-two width (Hadamard rotation), got d = {d}")
        else:
            v.fp8_kv_cache(op, "pool", pool, d, paged)
            if fp8.KVLayout.of(pool, d).rope != 2 * cos.shape[-1]:
                v.fail(op, f"pool's FP8 layout keeps {fp8.KVLayout.of(pool, d).rope} rope dims in bf16, "
                           f"but cos rotates 2 * cos.shape[-1] = {2 * cos.shape[-1]}")
    else:
        d = pool.shape[2]
    cd = f"(2 if overlap else 1) * d = {c} * {d}"
    of_b = "B of block_table" if paged else "B of pool"
    if paged:
        v.block_table(op, block_table, pool)
    for name, t in (("ring_kv", ring_kv), ("ring_gate", ring_gate), ("new_kv", new_kv), ("new_gate", new_gate)):
        v.dim(op, name, t, 0, B, of_b)
        v.dim(op, name, t, 2, c * d, cd)
    v.dim(op, "ring_gate", ring_gate, 1, ring_kv.shape[1], "R of ring_kv")
    v.dim(op, "new_gate", new_gate, 1, new_kv.shape[1], "S of new_kv")
    v.dim(op, "start", start, 0, B, of_b)
    v.dim(op, "emit", emit, 0, B, of_b)
    v.dim(op, "norm_weight", norm_weight, 0, d, "d of pool")
    v.dim(op, "sin", sin, 0, cos.shape[0], "P of cos")
    v.dim(op, "sin", sin, 1, cos.shape[1], "r/2 of cos")
    if 2 * cos.shape[1] > d:
        v.fail(op, f"rope dims 2 * cos.shape[-1] = {2 * cos.shape[1]} exceed d = {d} (pool.shape[-1])")
    if emit.shape[1] > 0:
        v.at_least(op, "cos.shape[0]", cos.shape[0], 1, "(rope table rows)")
    R, S = ring_kv.shape[1], new_kv.shape[1]
    v.at_least(op, "ring_kv.shape[1]", R, c * ratio, f"(ring slots R >= {c} * ratio = {c * ratio})")
    v.same_device(op, ring_kv=ring_kv, ring_gate=ring_gate, new_kv=new_kv, new_gate=new_gate, start=start,
                  emit=emit, norm_weight=norm_weight, cos=cos, sin=sin, pool=pool, block_table=block_table)


def _check_values(ring_kv: Tensor, new_kv: Tensor, start: Tensor, emit: Tensor, cos: Tensor, pool: Tensor,
                  ratio: int, overlap: bool, block_table: Tensor | None) -> None:
    """The value checks of :func:`compress`: every emitted block is in the pool, complete, still in
    the ring and inside the rope table; one host read (``validate.run_value_checks``)."""
    op = "compress"
    N, R, S = v.entries(pool, block_table), ring_kv.shape[1], new_kv.shape[1]
    blk, st = emit.long(), start.long()[:, None]
    on = blk >= 0
    oldest = (blk - (1 if overlap else 0)).clamp(min=0) * ratio
    v.run_value_checks(
        *v.block_table_checks(op, block_table, pool),
        v.index_range_check(op, "emit", emit, N, "pool entries"),
        v.in_range_check(op, "start", start, 0, 2**31 - 1, "int32"),
        v.none_of_check(op, on & ((blk + 1) * ratio > st + S), lambda at: (
            f"emit[{at[0]}, {at[1]}] = block {int(blk[at])} ends at position {(int(blk[at]) + 1) * ratio - 1}, "
            f"past the new rows (start[{at[0]}] = {int(st[at[0], 0])}, S = {S}): the block is not complete")),
        v.none_of_check(op, on & (oldest < st - R), lambda at: (
            f"emit[{at[0]}, {at[1]}] = block {int(blk[at])} needs position {int(oldest[at])}, older than the "
            f"ring of R={R} slots holds (start[{at[0]}] = {int(st[at[0], 0])})")),
        v.none_of_check(op, on & (blk * ratio >= cos.shape[0]), lambda at: (
            f"emit[{at[0]}, {at[1]}] = block {int(blk[at])} is rotated at position {int(blk[at]) * ratio}, "
            f"beyond the rope table rows P={cos.shape[0]} (cos.shape[0])")))
