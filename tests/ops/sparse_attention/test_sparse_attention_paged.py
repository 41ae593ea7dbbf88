"""sparse_attention over a paged compressed pool through a shuffled block table gives what it gives
over the per-row pool (rows = the block table's pages in order), bit for bit, with the reference and
the Triton kernel (one and two splits): picked entries (CSA) and the dense prefix (HCA), fp32 / bf16
pages and FP8 pages (with an FP8 window), back to back or at FlashMLA's padded page stride."""
import pytest
import torch
from torch.library import opcheck

from dsv4_ops.reference import ops as ref
from launchers import DEVICE, i32, kernel_module
from paged_cases import fp8_rows, shuffled_block_table, to_pages

attn = kernel_module("sparse_attention")
B, P, PAGE, S, H, D, ROPE, RING = 2, 3, 4, 2, 4, 80, 16, 6  # FP8 KV entries: 104 bytes, 416 a page
ATTENTIONS = {
    "reference": ref.sparse_attention,
    "triton": lambda *args, block_table=None: attn.sparse_attention(*args, num_splits=1, block_table=block_table),
    "triton_2_splits": lambda *args, block_table=None: attn.sparse_attention(*args, num_splits=2,
                                                                             block_table=block_table),
}


@pytest.mark.parametrize("kind", ["csa", "hca"])
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8", "fp8_padded"])
@pytest.mark.parametrize("backend", list(ATTENTIONS))
def test_paged_sparse_attention_equals_the_per_row_pool(backend, fmt, kind):
    table, num_pages = shuffled_block_table(B, P, device=DEVICE)
    window, pool = torch.randn(B, RING, D, device=DEVICE), torch.randn(B, P * PAGE, D, device=DEVICE)
    q = torch.randn(B, S, H, D, device=DEVICE)
    if fmt.startswith("fp8"):
        kv, rows = fp8_rows(window, ROPE, RING), fp8_rows(pool, ROPE, PAGE)
    else:
        dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
        kv, rows, q = window.to(dtype), pool.to(dtype), q.to(dtype)
    pages = to_pages(rows, table, num_pages, padded=fmt == "fp8_padded")
    kv_idx = i32([[[0, 1, -1], [2, 3, 4]], [[5, -1, 0], [1, 2, 3]]])
    if kind == "csa":  # picks in several pages, a -1, one past the row's entries (skipped)
        cmp_idx, cmp_len = i32([[[11, 0, 5], [4, -1, 7]], [[9, 3, P * PAGE], [8, 1, 2]]]), i32([[0, 0], [0, 0]])
    else:  # the dense prefix across pages, none, the whole row
        cmp_idx, cmp_len = i32([[[]] * S] * B).view(B, S, 0), i32([[7, 0], [P * PAGE, 5]])
    sink = torch.randn(H, device=DEVICE)
    want = ATTENTIONS[backend](q, kv, kv_idx, rows, cmp_idx, cmp_len, sink, D ** -0.5)
    got = ATTENTIONS[backend](q, kv, kv_idx, pages, cmp_idx, cmp_len, sink, D ** -0.5, block_table=table)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", ["fp32", "fp8_padded"])
def test_paged_sparse_attention_opcheck(fmt, fake_check):
    table, num_pages = shuffled_block_table(B, P)
    window, pool = torch.randn(B, RING, D), torch.randn(B, P * PAGE, D)
    kv, rows = (fp8_rows(window, ROPE, RING), fp8_rows(pool, ROPE, PAGE)) if fmt != "fp32" else (window, pool)
    args = (torch.randn(B, S, H, D), kv, torch.tensor([[[0, 1], [2, -1]], [[3, 4], [5, 0]]], dtype=torch.int32),
            to_pages(rows, table, num_pages, padded=fmt != "fp32"),
            torch.tensor([[[11, -1], [4, 7]], [[9, 3], [8, 1]]], dtype=torch.int32),
            torch.tensor([[0, 5], [12, 0]], dtype=torch.int32), torch.randn(H), D ** -0.5, table)
    if fmt == "fp32":  # the FP8 variant's opcheck adds time, not coverage of the schema
        opcheck(torch.ops.dsv4.sparse_attention.default, args)
    fake_check(torch.ops.dsv4.sparse_attention.default, *args)


@pytest.mark.parametrize("kind", ["csa", "hca", "picks_and_prefix"])
@pytest.mark.parametrize("fmt", ["fp32", "fp8"])
def test_the_sm90_routes_physical_entries_over_shared_pages_equal_the_paged_call(fmt, kind, tol):
    """What the Gluon route hands its kernels for a paged pool (``attention_sm90``): the pages as one row all
    queries share (``shared_rows``), and the picks followed by the dense prefix listed as physical entries
    (``paged_entries``; the kernels read the prefix through the list, to the clamped ``cmp_len``). Read that way,
    every listed entry a pick, the reference gives what it gives through the block table. Picks: several pages, -1,
    past the row's entries; prefixes: across pages, none, past the row (clamped), negative."""
    from dsv4_ops.ops.attention_sm90 import paged_entries, shared_rows
    table, num_pages = shuffled_block_table(B, P, device=DEVICE)
    window, pool = torch.randn(B, RING, D, device=DEVICE), torch.randn(B, P * PAGE, D, device=DEVICE)
    q = torch.randn(B, S, H, D, device=DEVICE)
    kv, rows = (fp8_rows(window, ROPE, RING), fp8_rows(pool, ROPE, PAGE)) if fmt == "fp8" else (window, pool)
    pages = to_pages(rows, table, num_pages)
    kv_idx = i32([[[0, 1, -1], [2, 3, 4]], [[5, -1, 0], [1, 2, 3]]])
    picks = i32([[[11, 0, 5], [4, -1, 7]], [[9, 3, P * PAGE], [8, 1, 2]]])
    cmp_idx = picks if kind != "hca" else picks[..., :0]
    cmp_len = i32([[0, 0], [0, 0]]) if kind == "csa" else i32([[7, 0], [P * PAGE + 5, -2]])
    sink = torch.randn(H, device=DEVICE)
    want = ref.sparse_attention(q, kv, kv_idx, pages, cmp_idx, cmp_len, sink, D ** -0.5, table)
    entries, clen = paged_entries(pages, cmp_idx, cmp_len, table)
    assert entries.dtype == torch.int32 and entries.shape == (B, S, cmp_idx.shape[-1] + P * PAGE)
    assert torch.equal(clen, cmp_len.clamp(0, P * PAGE))
    listed = entries[..., cmp_idx.shape[-1]:]  # the prefix: valid to cmp_len, -1 after
    assert torch.equal((listed >= 0).sum(-1), clen.long())
    got = ref.sparse_attention(q, kv, kv_idx, shared_rows(pages, B), entries, torch.zeros_like(cmp_len), sink,
                               D ** -0.5)
    torch.testing.assert_close(got, want, **tol(torch.float32))  # one softmax over more masked entries
