"""Triton ring / pool write: ``cache[b, slots[b, s]] = values[b, s]`` for ``slots >= 0``.
Contract: ``dsv4_ops.reference.cache_write``.

``cache_write_kernel``, grid ``(B * S, cdiv(C, BLOCK_C))``: one program per new row ``(b, s)``
and block of ``BLOCK_C`` channels (a whole V4 row, up to 1024 channels): it reads the slot, and
copies the row when the slot is in ``[0, N)`` (``-1`` = skip: no memory traffic). Slots of one
row are distinct (``plan`` guarantees it), so programs never race and nothing is atomic.

``fp8_cache_write_kernel``, grid ``(B * S,)``, writes into an FP8 KV cache
(``dsv4_ops/reference/fp8_cache.py``): one program per new row quantises it on the fly (per
64-value block: amax, ue8m0 scale, e4m3 codes; the rope dims as bf16; ``fp8_codec.store_kv_entry``,
the layout's one writer) and stores the entry's data row and its footer scale row.

Paged pools (a ``block_table [B, P]``; ``dsv4_ops.reference.ops.paged_rows``): the program looks
the slot's page up in its row of the block table (a constexpr switch, so the per-row kernels are
unchanged) and writes at the page's own stride, which may be padded (FlashMLA's 576-byte multiple).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# by name, not as `fc.<name>`: Inductor copies a wrap_triton kernel's source with the jit
# functions it names, never a module attribute (NameError 'fc' in a compiled graph)
from .fp8_codec import store_kv_entry
from .launch import Launch, block_table_args, launch, next_pow2

__all__ = ["cache_write", "cache_write_kernel", "cache_write_config", "cache_write_launch",
           "fp8_cache_write_kernel", "fp8_cache_write_launch"]


@triton.jit
def cache_write_kernel(
    cache_ptr, values_ptr, slots_ptr, block_table_ptr,
    S, N, C, NUM_PAGES,
    sc_b, sc_n, sc_c,
    sv_b, sv_s, sv_c,
    ss_b, ss_s,
    sbt_b, sbt_p,
    BLOCK_C: tl.constexpr,
    PAGE: tl.constexpr,  # entries a page of a paged pool [num_pages, PAGE, C] (sc_b: its page stride); 0: per row
):
    pid_t = tl.program_id(0)  # new row b * S + s
    pid_c = tl.program_id(1)  # channel block
    b = (pid_t // S).to(tl.int64)
    s = (pid_t % S).to(tl.int64)
    slot = tl.load(slots_ptr + b * ss_b + s * ss_s).to(tl.int64)
    if (slot >= 0) & (slot < N):
        offs = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = offs < C
        row = tl.load(values_ptr + b * sv_b + s * sv_s + offs * sv_c, mask=mask)
        if PAGE:
            page = tl.load(block_table_ptr + b * sbt_b + (slot // PAGE) * sbt_p).to(tl.int64)
            dst = cache_ptr + tl.minimum(tl.maximum(page, 0), NUM_PAGES - 1) * sc_b + (slot % PAGE) * sc_n
        else:
            dst = cache_ptr + b * sc_b + slot * sc_n
        tl.store(dst + offs * sc_c, row.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def fp8_cache_write_kernel(
    cache_ptr, values_ptr, slots_ptr, block_table_ptr,
    S, N, PAGE, NOPE, ROPE, DATA_BYTES, SCALE_BYTES, NUM_PAGES,
    sc_b, sc_p,
    sv_b, sv_s, sv_c,
    ss_b, ss_s,
    sbt_b, sbt_p,
    BLOCK_D: tl.constexpr, BLOCK_SB: tl.constexpr,
    PAGED: tl.constexpr,  # pages [num_pages, PAGE, entry_bytes] through the block table (sc_b = 0)
):
    pid_t = tl.program_id(0)  # new row b * S + s
    b = (pid_t // S).to(tl.int64)
    s = (pid_t % S).to(tl.int64)
    slot = tl.load(slots_ptr + b * ss_b + s * ss_s).to(tl.int64)
    if (slot >= 0) & (slot < N):
        row = values_ptr + b * sv_b + s * sv_s
        page = slot // PAGE
        if PAGED:
            page = tl.load(block_table_ptr + b * sbt_b + page * sbt_p).to(tl.int64)
            page = tl.minimum(tl.maximum(page, 0), NUM_PAGES - 1)
        page_base = cache_ptr + b * sc_b + page * sc_p
        t = slot % PAGE
        data = page_base + t * DATA_BYTES
        scales = page_base + PAGE * DATA_BYTES + t * SCALE_BYTES
        ch = tl.arange(0, BLOCK_D)
        y = tl.load(row + ch * sv_c, mask=ch < NOPE + ROPE, other=0.0).to(tl.float32)
        store_kv_entry(y, data, scales, NOPE + ROPE, NOPE, SCALE_BYTES, BLOCK_D, BLOCK_SB)


def fp8_cache_write_launch(cache: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, rope: int,
                           data_bytes: int, scale_bytes: int, block_table: torch.Tensor | None = None) -> Launch | None:
    """The ``fp8_cache_write_kernel`` launch into an FP8 KV cache ``[B, pages, page, entry_bytes]``,
    or pages ``[num_pages, page, entry_bytes]`` through ``block_table [B, P]`` (``None``: nothing
    to write)."""
    B, S = slots.shape
    D = values.shape[-1]
    if B * S == 0:
        return None
    nope = D - rope
    if block_table is None:
        P, page, sc_b, sc_p = cache.shape[1], cache.shape[2], cache.stride(0), cache.stride(1)
    else:  # dim 0 of the pages is the page
        P, page, sc_b, sc_p = block_table.shape[1], cache.shape[1], 0, cache.stride(0)
    table, num_pages, sbt_b, sbt_p = block_table_args(block_table, cache, slots)
    return Launch((B * S,), (cache, values, slots, table, S, P * page, page, nope, rope, data_bytes, scale_bytes,
                             num_pages, sc_b, sc_p, *values.stride(), *slots.stride(), sbt_b, sbt_p),
                  dict(BLOCK_D=max(64, next_pow2(D)), BLOCK_SB=max(2, next_pow2(scale_bytes)),
                       PAGED=block_table is not None, num_warps=4))


def cache_write_config(C: int) -> dict:
    """Static: a whole row of up to 1024 channels per program (V4 rows are 128..1024 wide)."""
    block_c = min(1024, next_pow2(max(C, 1)))
    return dict(BLOCK_C=block_c, num_warps=4 if block_c >= 512 else 2)


def cache_write_launch(cache: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                       block_table: torch.Tensor | None = None) -> Launch | None:
    """The ``cache_write_kernel`` launch, into ``cache [B, N, C]`` or pages ``[num_pages, page, C]``
    through ``block_table [B, P]`` (``None``: nothing to write)."""
    B, S = slots.shape
    C = cache.shape[2]
    page = 0 if block_table is None else cache.shape[1]  # 0: the per-row layout
    N = cache.shape[1] if block_table is None else block_table.shape[1] * page
    table, num_pages, *sbt = block_table_args(block_table, cache, slots)
    if B * S * C == 0 or N == 0:
        return None
    cfg = cache_write_config(C)
    return Launch((B * S, -(-C // cfg["BLOCK_C"])),
                  (cache, values, slots, table, S, N, C, num_pages, *cache.stride(), *values.stride(),
                   *slots.stride(), *sbt),
                  dict(BLOCK_C=cfg["BLOCK_C"], PAGE=page, num_warps=cfg["num_warps"]))


def cache_write(cache: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                block_table: torch.Tensor | None = None) -> None:
    """Raw launcher with the reference signature; writes ``cache`` in place, returns ``None``.
    Slots outside ``[0, N)`` are skipped like ``-1``."""
    launch(cache_write_kernel, cache_write_launch(cache, values, slots, block_table))
