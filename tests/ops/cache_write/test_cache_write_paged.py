"""cache_write into a paged pool through a shuffled block table writes what the per-row pool gets
(rows = the block table's pages in order), bit for bit, with the reference and the Triton kernels:
float / bf16 pages and FP8 pages, back to back or at FlashMLA's padded page stride; slots of -1 and
past the row's pages are skipped, and no page outside the table (nor a pad byte) is touched."""
import pytest
import torch
from torch.library import opcheck

from dsv4_ops.reference import fp8_cache as fp8
from dsv4_ops.reference import ops as ref
from launchers import DEVICE, i32, kernel_module
from paged_cases import assert_only_named_pages_changed, fp8_rows, page_bytes, shuffled_block_table, to_pages

tcache = kernel_module("cache_write")
B, P, PAGE, D, ROPE = 2, 3, 4, 80, 16  # FP8 KV entries of 64 nope + 16 rope dims: 104 bytes, 416 a page


def _triton_write(cache, values, slots, block_table=None):
    if cache.dtype != torch.uint8:
        return tcache.cache_write(cache, values, slots, block_table)
    lay = fp8.KVLayout.of(cache, values.shape[-1])
    tcache.launch(tcache.fp8_cache_write_kernel, tcache.fp8_cache_write_launch(
        cache, values, slots, lay.rope, lay.data_bytes, lay.scale_bytes, block_table))


WRITERS = {"reference": ref.cache_write, "triton": _triton_write}


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8", "fp8_padded"])
@pytest.mark.parametrize("backend", list(WRITERS))
def test_paged_cache_write_equals_the_per_row_pool(backend, fmt):
    write = WRITERS[backend]
    table, num_pages = shuffled_block_table(B, P, device=DEVICE)
    if fmt.startswith("fp8"):
        rows = fp8_rows(torch.randn(B, P * PAGE, D, device=DEVICE), ROPE, PAGE)
        values = torch.randn(B, 4, D, device=DEVICE)
    else:
        dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
        rows = torch.randn(B, P * PAGE, D, device=DEVICE).to(dtype)
        values = torch.randn(B, 4, D, device=DEVICE).to(dtype)
    pages = to_pages(rows, table, num_pages, padded=fmt == "fp8_padded")
    before = page_bytes(pages)
    # across pages, a skip, a slot past the row's P * PAGE entries (skipped too)
    slots = i32([[0, 5, P * PAGE - 1, -1], [7, 4, P * PAGE, 2]])
    write(rows, values, slots)
    write(pages, values, slots, table)
    assert torch.equal(ref.paged_rows(pages, table), rows)
    assert_only_named_pages_changed(before, pages, table)


@pytest.mark.parametrize("fmt", ["fp32", "fp8_padded"])
def test_paged_cache_write_opcheck(fmt, fake_check):
    table, num_pages = shuffled_block_table(B, P)
    if fmt == "fp32":
        pages = torch.randn(num_pages, PAGE, D)
    else:
        pages = to_pages(fp8_rows(torch.randn(B, P * PAGE, D), ROPE, PAGE), table, num_pages, padded=True)
    args = (pages, torch.randn(B, 2, D), torch.tensor([[1, 9], [-1, 4]], dtype=torch.int32), table)
    if fmt == "fp32":  # the FP8 variant's opcheck adds time, not coverage of the schema
        opcheck(torch.ops.dsv4.cache_write.default, args)
    fake_check(torch.ops.dsv4.cache_write.default, *args)
