"""Paged-pool test inputs: a per-row pool re-addressed through a shuffled block table.

A paged op must give what the same op gives on the per-row layout whose row ``b`` is the pages of
block-table row ``b`` in order (``dsv4_ops.reference.ops.paged_rows``), bit for bit. ``to_pages``
builds such pages from a per-row pool: each row's pages land at shuffled, non-contiguous page ids,
the pages no row names keep a poison nothing writes, and an FP8 pool may take FlashMLA's padded
page stride (every page's bytes rounded up to a multiple of 576), whose pad bytes are poisoned too.
"""
import torch

from dsv4_ops.reference import fp8_cache as fp8
from dsv4_ops.reference import ops as ref
from fp8_cases import POISON

FLASHMLA_PAGE_ALIGN = 576  # FlashMLA pads an FP8 page's bytes to a multiple of this
FORMATS = ("float", "fp8", "fp8_padded")  # float pages, FP8 pages back to back, FP8 pages at a padded stride


def shuffled_block_table(B, P, spare=3, device="cpu"):
    """``int32 [B, P]`` distinct page ids in no order, out of ``B * P + spare`` pages (the spares:
    pages no row names). Returns ``(block_table, num_pages)``."""
    num_pages = B * P + spare
    ids = torch.randperm(num_pages)[: B * P].view(B, P)
    return ids.to(torch.int32).to(device), num_pages


def to_pages(rows, block_table, num_pages, padded=False):
    """The per-row pool ``rows`` (float ``[B, P * page, width]`` or FP8 ``[B, P, page, entry_bytes]``)
    as pages ``[num_pages, page, width]`` read through ``block_table [B, P]``; pages no row names hold
    NaN / the FP8 poison. ``padded`` (FP8): the page stride rounded up to a multiple of 576 bytes."""
    B, P = block_table.shape
    if rows.dtype == torch.uint8:
        page, width = rows.shape[2], rows.shape[3]
        pages = fp8_pages(num_pages, page, width, padded, rows.device, fill=POISON)
        per_page = rows.reshape(B * P, page, width)
    else:
        page = rows.shape[1] // P
        pages = torch.full((num_pages, page, rows.shape[2]), float("nan"), dtype=rows.dtype, device=rows.device)
        per_page = rows.reshape(B * P, page, rows.shape[2])
    pages[block_table.flatten().long()] = per_page
    return pages


def fp8_pages(num_pages, page, entry_bytes, padded=True, device="cpu", fill=0):
    """``uint8 [num_pages, page, entry_bytes]`` pages filled with ``fill``; ``padded``: as FlashMLA
    allocates them, each page's bytes at a stride rounded up to a multiple of 576 (a view)."""
    used = page * entry_bytes
    stride = -(-used // FLASHMLA_PAGE_ALIGN) * FLASHMLA_PAGE_ALIGN if padded else used
    buf = torch.full((num_pages, stride), fill, dtype=torch.uint8, device=device)
    return buf[:, :used].view(num_pages, page, entry_bytes)


def page_bytes(pages):
    """A copy of the bytes of every page of ``pages``, its stride's pad included: ``uint8 [num_pages, stride]``."""
    whole = pages.as_strided((pages.shape[0], pages.stride(0)), (pages.stride(0), 1))
    return whole.contiguous().view(torch.uint8).clone()


def assert_only_named_pages_changed(before, pages, block_table):
    """Against ``before = page_bytes(pages)``: pages no block-table row names, and the pad bytes of
    every page, kept their bytes."""
    after = page_bytes(pages)
    named = torch.zeros(pages.shape[0], dtype=torch.bool, device=pages.device)
    named[block_table.flatten().long()] = True
    assert torch.equal(after[~named], before[~named]), "a page no row names was written"
    used = pages[0].numel() * pages.element_size()
    assert torch.equal(after[:, used:], before[:, used:]), "a pad byte of the page stride was written"


def fp8_rows(values, rope, page):
    """``[B, n, D]`` values as a per-row FP8 KV pool of ``page``-entry pages (``n`` a multiple of it)."""
    B, n, D = values.shape
    cache = torch.full(fp8.KVLayout(D, rope, page).shape(B, n), POISON, dtype=torch.uint8, device=values.device)
    ref.cache_write(cache, values, torch.arange(n, dtype=torch.int32, device=values.device).expand(B, n).contiguous())
    return cache


def fp8_key_rows(values, page):
    """``[B, n, DI]`` values as a per-row FP8 indexer-key pool of ``page``-entry pages."""
    B, n, DI = values.shape
    keys = torch.full(fp8.IndexerLayout(DI, page).shape(B, n), POISON, dtype=torch.uint8, device=values.device)
    ref._write_entries_fp8(keys, values, torch.arange(n, dtype=torch.int32, device=values.device).expand(B, n))
    return keys
