"""On an sm_90 GPU, decode attention over a paged compressed pool (a shuffled block table, bf16 pages or FP8 pages
back to back) takes the Gluon route too: the pages are read as one row every query shares and the picks and the
dense prefix as physical entries (``attention_sm90.paged_entries``), so the kernel sees each row's entries at the
same places of its list as over the per-row pool, and gives the per-row call's bits; the oracle agrees within
bf16's tolerance. Eager, compiled and CUDA-graphed alike. FP8 pages at FlashMLA's padded page stride keep the
Triton kernel (the Gluon reader addresses pages back to back)."""
import pytest
import torch

import dsv4_ops
from dsv4_ops.ops import attention_sm90 as sm90
from paged_cases import shuffled_block_table, to_pages
from test_sparse_attention_sm90 import SM90, check_compiled_and_graphed, flash_inputs, oracle
from test_sparse_attention_sm90_fp8 import dequantised, fp8_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not SM90, reason="the Gluon attention serves sm_90 GPUs only")]
PAGE = 64  # pool entries a page: a 256-token page of a CSA layer (ratio 4)
CASES = {
    "csa": dict(B=4),  # window + top-512 picks
    "hca": dict(B=3, K=0, prefix=2048),  # window + a dense prefix across the row's pages
    "mixed": dict(B=3, prefix=1500),  # picks and a prefix
    "one_token_many_splits": dict(B=1, prefix=2048),
    "batch_64": dict(B=64, Nc=1024, prefix=1024),
}


def paged(args, padded=False):
    """``args`` (per-row pool) -> the same call over the pool's pages at shuffled page ids: ``(args, table)``."""
    q, kv, kv_idx, rows, cmp_idx, cmp_len, sink, scale = args
    B = q.shape[0]
    P = rows.shape[1] if rows.dtype == torch.uint8 else rows.shape[1] // PAGE
    table, num_pages = shuffled_block_table(B, P, device="cuda")
    pages = to_pages(rows, table, num_pages, padded=padded)
    return [q, kv, kv_idx, pages, cmp_idx, cmp_len, sink, scale], table


@pytest.fixture
def fp8_from_batch_1(monkeypatch):
    monkeypatch.setattr(sm90, "FP8_MIN_BATCH", 1)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_paged_pool_takes_the_gluon_route_and_gives_the_per_row_bits(fmt, case, tol, fp8_from_batch_1):
    args = (flash_inputs if fmt == "bf16" else fp8_inputs)(**CASES[case])
    want = dsv4_ops.sparse_attention(*args)  # the per-row pool, Gluon too
    pages_args, table = paged(args)
    before = sm90.stats["launches"]
    out = dsv4_ops.sparse_attention(*pages_args, block_table=table)
    assert sm90.stats["launches"] == before + 1, "the paged call did not run the Gluon kernel"
    assert torch.equal(out, want)
    ref_args = args if fmt == "bf16" else dequantised(args)
    torch.testing.assert_close(out.double(), oracle(*ref_args), **tol(torch.bfloat16))


def test_fp8_pages_at_flashmla_padded_stride_keep_the_triton_kernel(tol, fp8_from_batch_1):
    args = fp8_inputs(B=3, prefix=700)
    pages_args, table = paged(args, padded=True)
    before = sm90.stats["launches"]
    out = dsv4_ops.sparse_attention(*pages_args, block_table=table)
    assert sm90.stats["launches"] == before
    torch.testing.assert_close(out.double(), oracle(*dequantised(args)), **tol(torch.bfloat16))


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_compiled_and_cuda_graphed_paged_calls_run_the_gluon_kernel(fmt, fp8_from_batch_1):
    """The entries' translation is traced into the compiled graph, the kernel an extern call in it: the graph and
    its CUDA-graph replay on fresh inputs (pages and block table included) give the eager call's bits."""
    make = flash_inputs if fmt == "bf16" else fp8_inputs

    def make_args(seed):  # fresh values and fresh page ids (a new shuffle) on each draw, the same shapes
        pages_args, table = paged(make(B=8, prefix=512, seed=seed))
        return pages_args + [table]

    check_compiled_and_graphed(make_args)
