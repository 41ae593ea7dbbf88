"""indexer_topk over paged keys through a shuffled block table picks what it picks over the per-row
pool (rows = the block table's pages in order), the same entry indices, bit for bit, with the
reference and the Triton kernels (scores + top-k): fp32 / bf16 keys and FP8 keys, back to back or at
FlashMLA's padded page stride."""
import pytest
import torch
from torch.library import opcheck

from dsv4_ops.reference import fp8_cache as fp8
from dsv4_ops.reference import ops as ref
from launchers import DEVICE, i32, kernel_module
from paged_cases import fp8_key_rows, shuffled_block_table, to_pages

indexer = kernel_module("indexer")
TOPKS = {"reference": ref.indexer_topk,
         "triton": lambda *args, block_table=None: indexer.indexer_topk(*args, block_table=block_table)}
B, P, PAGE, S, HI, DI, TOPK = 2, 4, 4, 3, 4, 32, 5  # FP8 keys: 36 bytes, 144 a page


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8", "fp8_padded"])
@pytest.mark.parametrize("backend", list(TOPKS))
def test_paged_indexer_topk_equals_the_per_row_pool(backend, fmt):
    table, num_pages = shuffled_block_table(B, P, device=DEVICE)
    values = torch.randn(B, P * PAGE, DI, device=DEVICE)
    q = torch.randn(B, S, HI, DI, device=DEVICE)
    if fmt.startswith("fp8"):
        rows, q = fp8_key_rows(values, PAGE), fp8.rotate(q)
    else:
        dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
        rows, q = values.to(dtype), q.to(dtype)
    pages = to_pages(rows, table, num_pages, padded=fmt == "fp8_padded")
    w = torch.rand(B, S, HI, device=DEVICE)
    visible = i32([[0, 6, P * PAGE], [3, 9, 13]])  # none, across pages, the whole row
    want = TOPKS[backend](q, w, rows, visible, TOPK)
    got = TOPKS[backend](q, w, pages, visible, TOPK, block_table=table)
    assert torch.equal(got, want)
    assert (want[:, 1:] >= 4).any()  # picks from pages past the first


@pytest.mark.parametrize("fmt", ["fp32", "fp8_padded"])
def test_paged_indexer_topk_opcheck(fmt, fake_check):
    table, num_pages = shuffled_block_table(B, P)
    values, q = torch.randn(B, P * PAGE, DI), torch.randn(B, S, HI, DI)
    rows = fp8_key_rows(values, PAGE) if fmt != "fp32" else values
    args = (q, torch.rand(B, S, HI), to_pages(rows, table, num_pages, padded=fmt != "fp32"),
            torch.tensor([[1, 6, 16], [0, 9, 13]], dtype=torch.int32), TOPK, table)
    if fmt == "fp32":  # the FP8 variant's opcheck adds time, not coverage of the schema
        opcheck(torch.ops.dsv4.indexer_topk.default, args)
    fake_check(torch.ops.dsv4.indexer_topk.default, *args)
