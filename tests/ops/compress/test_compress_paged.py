"""compress into a paged pool through a shuffled block table emits what the per-row pool gets (rows =
the block table's pages in order), bit for bit, with the reference and the Triton kernel: CSA (with
overlap) and HCA rates, float / bf16 pages, FP8 KV and FP8 indexer-key pages, back to back or at
FlashMLA's padded page stride; no page outside the table (nor a pad byte) is touched."""
import pytest
import torch
from torch.library import opcheck

from dsv4_ops.reference import ops as ref
from launchers import DEVICE, i32, kernel_module, rope_tables
from paged_cases import (assert_only_named_pages_changed, fp8_key_rows, fp8_rows, page_bytes, shuffled_block_table,
                         to_pages)

tcompress = kernel_module("compress")
COMPRESSORS = {"reference": ref.compress, "triton": tcompress.compress}
B, P, PAGE, EPS = 2, 3, 4, 1e-6
# name: (m, overlap, pool format, d, half); FP8 KV entries: 64 nope + 16 rope dims
CASES = {
    "csa_fp32": (4, True, "fp32", 16, 4),
    "hca_bf16": (8, False, "bf16", 16, 4),
    "csa_fp8_kv": (4, True, "fp8", 80, 8),
    "csa_fp8_kv_padded": (4, True, "fp8_padded", 80, 8),
    "csa_fp8_keys_padded": (4, True, "fp8_keys_padded", 32, 4),
}


def _rows(fmt, d, half):
    values = torch.randn(B, P * PAGE, d, device=DEVICE)
    if fmt.startswith("fp8_keys"):
        return fp8_key_rows(values, PAGE)
    if fmt.startswith("fp8"):
        return fp8_rows(values, 2 * half, PAGE)
    return values.to(torch.float32 if fmt == "fp32" else torch.bfloat16)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", list(COMPRESSORS))
def test_paged_compress_equals_the_per_row_pool(backend, case):
    m, overlap, fmt, d, half = CASES[case]
    compress = COMPRESSORS[backend]
    c = 2 if overlap else 1
    table, num_pages = shuffled_block_table(B, P, device=DEVICE)
    rows = _rows(fmt, d, half)
    pages = to_pages(rows, table, num_pages, padded=fmt.endswith("padded"))
    before = page_bytes(pages)
    # both rows emit across a page boundary: entries 3, 4 and 4, 5
    lengths, n_new, S = i32([3 * m + 1, 5 * m - 1]), i32([2 * m + 1, m + 2]), 2 * m + 1
    emit = ref.plan(lengths, n_new, S, 1, 1, S, True, m, c * m, m, c * m)[4 if overlap else 7][0]
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    ring = [torch.randn(B, c * m, c * d, device=DEVICE).to(dtype) for _ in range(2)]
    new = [torch.randn(B, S, c * d, device=DEVICE).to(dtype) for _ in range(2)]
    cos, sin = rope_tables(4 * P * PAGE * m, half)
    args = (*ring, *new, lengths, emit, torch.rand(d, device=DEVICE) + 0.5, cos, sin)
    compress(*args, rows, m, overlap, EPS)
    compress(*args, pages, m, overlap, EPS, table)
    assert emit.tolist() == [[3, 4, -1], [4, 5, -1]]
    assert torch.equal(ref.paged_rows(pages, table), rows)
    assert_only_named_pages_changed(before, pages, table)


@pytest.mark.parametrize("case", ["csa_fp32", "csa_fp8_keys_padded"])
def test_paged_compress_opcheck(case, fake_check):
    m, overlap, fmt, d, half = CASES[case]
    table, num_pages = shuffled_block_table(B, P)
    pages = to_pages(_rows(fmt, d, half).cpu(), table, num_pages, padded=fmt.endswith("padded"))
    lengths, n_new = torch.tensor([3, 7], dtype=torch.int32), torch.tensor([2, 1], dtype=torch.int32)
    emit = ref.plan(lengths, n_new, 2, 1, 1, 2, True, m, 2 * m, m, 2 * m)[4][0]
    cos, sin = rope_tables(64, half, "cpu")
    args = (torch.randn(B, 2 * m, 2 * d), torch.randn(B, 2 * m, 2 * d), torch.randn(B, 2, 2 * d),
            torch.randn(B, 2, 2 * d), lengths, emit, torch.rand(d) + 0.5, cos, sin, pages, m, overlap, EPS, table)
    if fmt == "fp32":  # the FP8 variant's opcheck adds time, not coverage of the schema
        opcheck(torch.ops.dsv4.compress.default, args)
    fake_check(torch.ops.dsv4.compress.default, *args)
