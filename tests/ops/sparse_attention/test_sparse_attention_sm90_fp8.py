"""On an sm_90 GPU, bf16 decode attention at V4's widths over FP8 caches (FlashMLA's page layout,
``dsv4_ops/reference/fp8_cache.py``) runs the Gluon FP8 reader (``dsv4::sparse_attention_sm90``,
``lowering/gluon/sparse_attention_fp8.py``): its output equals the float64 oracle on the
dequantised caches within bf16's tolerance for FP8 mode 2 (FP8 window and pool pages) and mode 1
(a bf16 window, an FP8 pool), every entry kind and empty segments; it is what runs eagerly, in
compiled graphs and in CUDA-graph replays, and with the route off the Triton FP8
kernel back. A model at V4's attention widths with ``kv_cache_dtype="fp8"`` decodes with it within
bf16 noise of the Triton route."""
import pytest
import torch

import dsv4_ops
from dsv4_ops.ops import attention_sm90 as sm90
from dsv4_ops.reference import fp8_cache as fp8
from routes import triton_attention
from test_sparse_attention_sm90 import SM90, check_compiled_and_graphed, check_model_decode, oracle

I32 = torch.int32
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not SM90, reason="the Gluon attention serves sm_90 GPUs only")]
H, D, ROPE = 64, 512, 64


def fp8_pages(values, page):
    """``[B, N, D]`` values -> an FP8 page cache ``uint8 [B, N / page, page, 584]``."""
    data, scales = fp8.quantize_kv(values, ROPE)
    return fp8.from_entries(torch.cat([data, scales], -1), page, fp8.KVLayout(D, ROPE, page).data_bytes).contiguous()


def fp8_inputs(B, W=128, K=512, Nc=2048, prefix=0, float_window=False, seed=0):
    """Random decode inputs over FP8 caches: window pages of 128 entries (or, ``float_window``, a
    bf16 ring of 256 rows: FP8 mode 1), a pool of 64-entry pages (none when ``Nc`` is 0), -1
    indices, a dense prefix of up to ``prefix`` entries (row 0 none)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = dict(device="cuda")
    q = torch.randn(B, 1, H, D, generator=g, **dev).bfloat16()
    if float_window:
        kv = torch.randn(B, 256, D, generator=g, **dev).bfloat16()
    else:
        kv = fp8_pages(torch.randn(B, 128, D, generator=g, **dev), 128)
    n_kv = 256 if float_window else 128
    # no pool: an empty FP8 page cache (the public op takes an FP8 window with an FP8 pool only)
    cmp = fp8_pages(torch.randn(B, Nc, D, generator=g, **dev), 64) if Nc else \
        torch.empty(B, 0, 64, kv.shape[-1] if kv.dtype == torch.uint8 else 584, dtype=torch.uint8, **dev)
    kv_idx = torch.randint(-1, n_kv, (B, 1, W), generator=g, dtype=I32, **dev)
    cmp_idx = torch.randint(-1, Nc, (B, 1, K), generator=g, dtype=I32, **dev) if Nc else \
        torch.full((B, 1, K), -1, dtype=I32, **dev)
    cmp_len = torch.randint(0, prefix + 1, (B, 1), generator=g, dtype=I32, **dev)
    cmp_len[0] = 0
    sink = torch.randn(H, generator=g, **dev)
    return [q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, D ** -0.5]


def dequantised(args):
    """The same inputs over float caches holding the FP8 caches' values (exact: fp32)."""
    q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale = args
    kv = fp8.read_kv(kv, D) if kv.dtype == torch.uint8 else kv.float()
    cmp = fp8.read_kv(cmp, D) if cmp.dtype == torch.uint8 else cmp.float()
    return [q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale]


CASES = {
    "csa": dict(B=4),  # window + top-512 picks (the CSA decode of the Flash slice)
    "hca": dict(B=3, K=0, prefix=2048),  # window + the whole pool as a dense prefix
    "mixed": dict(B=3, prefix=1500),  # all three entry kinds
    "mode1_float_window": dict(B=3, prefix=700, float_window=True),  # bf16 window ring, FP8 pool
    "sliding": dict(B=2, K=0, Nc=0),  # window pages only (no pool)
    "one_token_many_splits": dict(B=1, prefix=2048),  # split-KV at batch 1
    "short_window": dict(B=2, W=5, K=3, Nc=64),  # blocks mostly masked, segments inside one block
    "batch_64": dict(B=64, Nc=1024),  # the batch the route starts at
}


@pytest.fixture
def any_batch(monkeypatch):
    """The route from batch 1 on for both FP8 modes (a bf16 window ring's default starts at
    ``FP8_FLOAT_WINDOW_MIN_BATCH``): the kernel's edge cases are small batches."""
    monkeypatch.setattr(sm90, "FP8_MIN_BATCH", 1)
    monkeypatch.setattr(sm90, "FP8_FLOAT_WINDOW_MIN_BATCH", 1)


def test_fp8_pages_take_the_gluon_reader_from_batch_1_and_a_float_window_from_64(tol):
    """The default rule: FP8 window pages from ``FP8_MIN_BATCH`` (1) on; a bf16 window ring over an
    FP8 pool below ``FP8_FLOAT_WINDOW_MIN_BATCH`` keeps the Triton kernel (the H200 measured it
    faster there), from it on the Gluon reader; all equal the oracle."""
    assert sm90.FP8_MIN_BATCH == 1
    cases = [(1, False, True), (sm90.FP8_FLOAT_WINDOW_MIN_BATCH - 1, True, False),
             (sm90.FP8_FLOAT_WINDOW_MIN_BATCH, True, True)]
    for B, float_window, routed in cases:
        args = fp8_inputs(B=B, Nc=256, K=64, seed=B, float_window=float_window)
        before = sm90.stats["launches"]
        out = dsv4_ops.sparse_attention(*args)
        assert (sm90.stats["launches"] == before + 1) is routed, (B, float_window)
        torch.testing.assert_close(out.double(), oracle(*dequantised(args)), **tol(torch.bfloat16))


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_caches_take_the_gluon_route_and_match_the_reference(case, tol, any_batch):
    args = fp8_inputs(**CASES[case])
    before = sm90.stats["launches"]
    out = dsv4_ops.sparse_attention(*args)
    assert sm90.stats["launches"] == before + 1, "the Gluon FP8 kernel did not run"
    assert out.shape == args[0].shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), oracle(*dequantised(args)), **tol(torch.bfloat16))
    with triton_attention():
        triton_out = dsv4_ops.sparse_attention(*args)
    assert sm90.stats["launches"] == before + 1, "the Triton route ran the Gluon kernel"
    # the same decoded bf16 rows and 32-row blocks: the two differ by fp32 summation order
    assert (out.float() - triton_out.float()).abs().max() <= tol("gluon_vs_triton_bf16")["atol"]


@pytest.mark.smem_poison
def test_the_fp8_reader_reads_no_shared_memory_it_has_not_written(tol):
    """As the bf16 kernels' test: every SM's shared memory NaN before each launch (stale values
    would otherwise be the previous launch's own), the output still the oracle's."""
    from dsv4_ops.lowering.gluon.sparse_attention_fp8 import sparse_attention_gluon_fp8
    from smem_poison import poison_shared_memory
    args = fp8_inputs(B=132, prefix=700)
    want = oracle(*dequantised(args))
    for _ in range(4):
        poison_shared_memory()
        out = sparse_attention_gluon_fp8(*args)
        assert out.isfinite().all(), "the kernel read shared memory it had not written"
        torch.testing.assert_close(out.double(), want, **tol(torch.bfloat16))


def test_misaligned_fp8_pages_keep_the_triton_kernel(tol, any_batch):
    """The Gluon reader copies 16-byte pieces of each entry: a cache whose pages start off a
    16-byte boundary is routed to the Triton kernel (which reads any layout), never refused."""
    args = fp8_inputs(B=2)
    cmp = args[3]
    flat = torch.zeros(cmp.numel() + 8, dtype=torch.uint8, device="cuda")
    shifted = flat[8:].view(cmp.shape)
    shifted.copy_(cmp)
    args[3] = shifted
    before = sm90.stats["launches"]
    out = dsv4_ops.sparse_attention(*args)
    assert sm90.stats["launches"] == before
    torch.testing.assert_close(out.double(), oracle(*dequantised(args)), **tol(torch.bfloat16))


def test_compiled_and_cuda_graphed_fp8_calls_run_the_gluon_kernel(any_batch):
    check_compiled_and_graphed(lambda seed: fp8_inputs(B=8, prefix=512, seed=seed))


def test_model_with_an_fp8_cache_decodes_with_the_gluon_kernel(any_batch, tol):
    """bf16, 3 layers (sliding, CSA, HCA), ``kv_cache_dtype="fp8"``: prefill of 2100 tokens then
    8 decode steps, the Gluon route's logits within bf16 noise of the Triton route's, eagerly
    and compiled + CUDA-graphed (no recompiles)."""
    check_model_decode("fp8", tol)
