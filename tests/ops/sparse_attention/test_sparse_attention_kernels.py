"""The sparse attention kernel (``lowering/triton/sparse_attention.py``) against the reference: every
entry kind (window rows, picks, a dense prefix) and their absence, blocks crossing the window /
picks / prefix boundaries, two head blocks with masked heads, V4's 512-dim heads, fp32 and bf16, 1
and several splits (split-KV + combine); a query without entries gets exactly 0, a single entry the
sink-weighted row; cmp_len past the pool clamps, more splits than blocks write empty partials,
strided q and pool are read through their strides, indices outside the rows read like -1 (the
raw-op contract); the launch config is a static function of sizes that fills one wave of SMs and
fits sm_90's shared memory for every dtype (FP8 caches by what the H200 asked); and the FP8 readers
(an FP8 pool with a float window, FP8 window + pool, an FP8 window without a pool; the word-wide
and the byte readers) equal the reference on the dequantised caches.

Under ``TRITON_INTERPRET=1`` on CPU (small grids), the compiled kernels on a GPU. Every output
buffer is poisoned before the launch.
"""
import pytest
import torch
import triton

from dsv4_ops.reference import ops as ref
from fp8_cases import fp8_kv_cache
from launchers import DEVICE, kernel_module

attn = kernel_module("sparse_attention")


def _attention_inputs(B, S, H, D, N, W, Nc, K, dtype, cmp_len=None):
    q = torch.randn(B, S, H, D, device=DEVICE).to(dtype)
    kv = torch.randn(B, N, D, device=DEVICE).to(dtype)
    cmp = torch.randn(B, Nc, D, device=DEVICE).to(dtype)
    kv_idx = torch.randint(-1, max(N, 1), (B, S, W), device=DEVICE, dtype=torch.int32)
    if N == 0:
        kv_idx.fill_(-1)
    cmp_idx = torch.randint(-1, max(Nc, 1), (B, S, K), device=DEVICE, dtype=torch.int32)
    if Nc == 0:
        cmp_idx.fill_(-1)
    if cmp_len is None:
        cmp_len = torch.randint(0, Nc + 1, (B, S), device=DEVICE, dtype=torch.int32)
    sink = torch.randn(H, device=DEVICE)
    return q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, D**-0.5


def _run_attention(poison, args, **kw):
    q = args[0]
    out = poison(torch.empty(q.shape, dtype=q.dtype, device=q.device))
    got = attn.sparse_attention(*args, out=out, **kw)
    assert got is out
    return got


def _small(block_h=16, block_n=16, splits=1, D=64):
    """An explicit config: small blocks so the few entries span several blocks/segments."""
    return dict(BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=attn.next_pow2(D), num_warps=4,
                num_stages=1, NUM_SPLITS=splits)


ATTENTION_CASES = {
    # name: (B, S, H, D, N, W, Nc, K, config-or-None)
    "csa": (2, 2, 4, 64, 12, 8, 40, 16, None),
    "straddle_blocks": (2, 2, 4, 64, 12, 5, 23, 7, _small()),  # blocks cross window/cmp/dense
    "two_head_blocks": (1, 2, 20, 64, 12, 8, 9, 6, _small()),  # H=20: 2 blocks, masked heads
    "hca_dense_only": (2, 2, 4, 64, 12, 8, 40, 0, None),  # K = 0
    "window_only": (2, 2, 4, 64, 12, 8, 0, 0, None),  # Nc = 0, K = 0
    "no_window": (2, 1, 4, 64, 12, 0, 20, 5, None),  # W = 0
    "d512": (1, 2, 4, 512, 6, 4, 5, 3, None),  # V4 head dim, tiny entry count
}


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_sparse_attention_kernel_matches_reference(case, dtype, splits, poison, tol):
    B, S, H, D, N, W, Nc, K, cfg = ATTENTION_CASES[case]
    args = _attention_inputs(B, S, H, D, N, W, Nc, K, dtype)
    if cfg is not None:
        cfg = dict(cfg, NUM_SPLITS=splits)
    got = _run_attention(poison, args, num_splits=splits, config=cfg)
    want = ref.sparse_attention(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **tol(dtype))


@pytest.mark.parametrize("splits", [1, 4])
def test_sparse_attention_kernel_without_entries_is_zero(splits, poison):
    """All -1 indices and cmp_len = 0: the sink takes all the mass, the output is exactly 0."""
    args = list(_attention_inputs(2, 2, 4, 64, 12, 8, 10, 6, torch.float32))
    args[2] = torch.full_like(args[2], -1)
    args[4] = torch.full_like(args[4], -1)
    args[5] = torch.zeros_like(args[5])
    got = _run_attention(poison, args, num_splits=splits)
    assert torch.equal(got, torch.zeros_like(got))
    assert torch.equal(ref.sparse_attention(*args), torch.zeros_like(got))


@pytest.mark.parametrize("splits", [1, 4])
def test_sparse_attention_kernel_single_entry(splits, poison, tol):
    """One valid window row: o = e * exp(l) / (exp(l) + exp(sink)) per head."""
    q, kv, kv_idx, cmp, cmp_idx, _, sink, scale = _attention_inputs(1, 1, 4, 64, 12, 8, 0, 0, torch.float32)
    kv_idx = torch.full_like(kv_idx, -1)
    kv_idx[0, 0, 5] = 7
    cmp_len = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    args = (q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale)
    got = _run_attention(poison, args, num_splits=splits)
    e = kv[0, 7]
    logit = scale * (q[0, 0] @ e)
    expect = (torch.sigmoid(logit - sink)[:, None] * e)[None, None]
    torch.testing.assert_close(got, expect, **tol(torch.float32))
    torch.testing.assert_close(got, ref.sparse_attention(*args), **tol(torch.float32))


def test_sparse_attention_kernel_lengths_outside_pool(poison, tol):
    """cmp_len beyond the pool is clamped to Nc, negative means none (reference semantics)."""
    args = list(_attention_inputs(2, 2, 4, 64, 12, 8, 10, 6, torch.float32))
    args[5] = torch.tensor([[13, -3], [10, 0]], dtype=torch.int32, device=DEVICE)
    got = _run_attention(poison, args, num_splits=2)
    torch.testing.assert_close(got, ref.sparse_attention(*args), **tol(torch.float32))


def test_sparse_attention_kernel_more_splits_than_blocks(poison, tol):
    """Splits past the query's entries write empty partials; the combine ignores them."""
    args = _attention_inputs(2, 1, 4, 64, 12, 3, 6, 2, torch.float32)
    got = _run_attention(poison, args, num_splits=8)
    torch.testing.assert_close(got, ref.sparse_attention(*args), **tol(torch.float32))


def test_sparse_attention_kernel_non_contiguous_inputs(poison, tol):
    """Strided q (heads-major storage) and a strided cmp pool are read through their strides."""
    q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale = _attention_inputs(2, 2, 4, 64, 12, 8, 20, 6, torch.float32)
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, [B, S, H, D] view of [B, H, S, D]
    cmp_wide = torch.randn(2, 20, 128, device=DEVICE)
    cmp_wide[..., :64] = cmp
    args = (q_t, kv, kv_idx, cmp_wide[..., :64], cmp_idx, cmp_len, sink, scale)
    got = _run_attention(poison, args, num_splits=2)
    torch.testing.assert_close(got, ref.sparse_attention(*args), **tol(torch.float32))


def test_attention_config_is_static_and_splits_small_batches():
    """Configs are a function of static sizes; split-KV fills one wave of SMs, no more."""
    flash = dict(H=64, D=512, sms=132)
    csa = 128 + 512
    decode = {B: attn.attention_config(B=B, S=1, max_entries=csa, **flash) for B in (1, 64, 128)}
    assert decode[64]["BLOCK_H"] == 64 and decode[64]["BLOCK_N"] == 32 and decode[64]["num_warps"] == 8
    assert [decode[B]["NUM_SPLITS"] for B in (1, 64, 128)] == [csa // 64, 2, 1]
    assert attn.attention_config(B=1, S=1, max_entries=100, **flash)["NUM_SPLITS"] == 1  # too few entries
    assert attn.attention_config(B=1, S=1, max_entries=128 + 8192, **flash)["NUM_SPLITS"] == 16  # capped
    hip = attn.attention_config(B=1, S=1, H=64, D=512, max_entries=csa, sms=304, backend="hip")
    assert hip["BLOCK_H"] == 32 and hip["num_stages"] == 1


def test_attention_config_fits_shared_memory_for_every_dtype():
    """V4 widths (D=512, H=64/128), decode and 64-token prefill, B=1..64: every dtype's config
    fits sm_90's shared memory by the estimate (checked against the compiler's count in
    test_sparse_attention_cross_compile.py); the bf16/fp16 configs stay the tuned ones."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for S in (1, 64):
            for B in (1, 2, 8, 64):
                for H in (64, 128):
                    cfg = attn.attention_config(B, S, H, 512, 128 + 512, dtype=dtype)
                    assert attn.attention_smem_bytes(cfg, dtype.itemsize) <= attn.SMEM_LIMIT["cuda"], (dtype, cfg)
                    if dtype != torch.float32:
                        assert (cfg["BLOCK_H"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"]) == (64, 32, 8, 4)


def test_fp8_attention_config_fits_shared_memory_by_what_the_h200_asked():
    """FP8 caches at V4 widths. An FP8 pool with float window rows (mode 1, prefill): the H200's
    JIT asked 240 KB for the session-8 kernel at bf16 x 4 stages and 272 KB at fp32 x 2
    (OutOfResources at launch, over 227 KB); the estimate bounds both, and the config it picks
    fits (bf16: 2 stages, fp32: 1). FP8 window and pool (mode 2, decode): 3 stages of the float
    cache's 32-row blocks (the same blocking, so the same bf16 rounding), which ran there."""
    measured = {torch.bfloat16: (4, 245760), torch.float32: (2, 278528)}
    for dtype, (stages, asked) in measured.items():
        for S in (1, 64):
            cfg = attn.attention_config(1, S, 64, 512, 128 + 512, dtype=dtype, fp8=1)
            assert attn.attention_smem_bytes(dict(cfg, num_stages=stages), dtype.itemsize, fp8=1) >= asked
            assert attn.attention_smem_bytes(cfg, dtype.itemsize, fp8=1) <= attn.SMEM_LIMIT["cuda"]
            assert cfg["num_stages"] == (2 if dtype == torch.bfloat16 else 1), cfg
            cfg = attn.attention_config(64, S, 64, 512, 128 + 512, dtype=dtype, fp8=2)
            assert attn.attention_smem_bytes(cfg, dtype.itemsize, fp8=2) <= attn.SMEM_LIMIT["cuda"]
            assert (cfg["BLOCK_N"], cfg["num_stages"]) == (32, 3), cfg
    # the decode modes: ROCm the integer decode, CUDA the PTX bit moves (the interpreter: the e4m3 type)
    assert attn.attention_config(64, 1, 64, 512, 640, fp8=2, backend="hip")["E4M3_HW"] == 0
    assert attn.attention_config(64, 1, 64, 512, 640, fp8=2, backend="cuda")["E4M3_HW"] == (
        1 if triton.knobs.runtime.interpret else 4)


@pytest.mark.parametrize("splits", [1, 3])
def test_sparse_attention_kernel_skips_out_of_range_indices(splits, poison, tol):
    """The raw-op contract on the Triton path: indices outside [0, rows) read like -1, as in
    the reference with the same values."""
    args = list(_attention_inputs(2, 2, 4, 64, 12, 8, 10, 6, torch.float32))
    clean = list(args)
    args[2], clean[2] = args[2].clone(), args[2].clone()
    args[4], clean[4] = args[4].clone(), args[4].clone()
    args[2][0, 0, :3] = torch.tensor([12, 2**31 - 1, -9], dtype=torch.int32)
    clean[2][0, 0, :3] = -1
    args[4][1, 1, :2] = torch.tensor([10, -2], dtype=torch.int32)
    clean[4][1, 1, :2] = -1
    got = _run_attention(poison, args, num_splits=splits)
    torch.testing.assert_close(got, ref.sparse_attention(*args), **tol(torch.float32))
    torch.testing.assert_close(ref.sparse_attention(*args), ref.sparse_attention(*clean), rtol=0, atol=0)


# ---- FP8 caches ----------------------------------------------------------------------------------
@pytest.mark.parametrize("window_fp8", [False, True])
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("rope, words", [(16, 1), (80, 0)], ids=["word_reader", "byte_reader"])
def test_fp8_sparse_attention_matches_the_reference(window_fp8, splits, rope, words, tol):
    # rope within one 64-channel block: the word-wide reader (load_kv_entries); wider rope: the
    # per-channel byte gathers
    torch.manual_seed(3)
    B, S, H, D = 2, 3, 4, 144
    window = torch.randn(B, 10, D, device=DEVICE)
    kv = fp8_kv_cache(window, rope, 10) if window_fp8 else window  # concat mode keeps a float window source
    cmp = fp8_kv_cache(torch.randn(B, 13, D, device=DEVICE), rope, 8)
    q, sink = torch.randn(B, S, H, D, device=DEVICE), torch.randn(H, device=DEVICE)
    kv_idx = torch.randint(-1, 10, (B, S, 5), dtype=torch.int32, device=DEVICE)
    cmp_idx = torch.randint(-1, 13, (B, S, 6), dtype=torch.int32, device=DEVICE)
    cmp_len = torch.randint(0, 14, (B, S), dtype=torch.int32, device=DEVICE)
    args = (q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, D**-0.5)
    want = ref.sparse_attention(*args)
    assert attn.attention_launches(*args, num_splits=splits).attention.meta["FP8_WORDS"] == words
    out = torch.full_like(want, float("nan"))
    got = attn.sparse_attention(*args, out=out, num_splits=splits)
    torch.testing.assert_close(got, want, **tol(torch.float32))


def test_fp8_window_without_a_pool_matches_the_reference(tol):
    # a sliding-window layer of an FP8-cache model: FP8 window ring, no compressed entries (an
    # empty float pool), decode and split-KV (found on the H200: the launcher refused it)
    torch.manual_seed(4)
    B, S, H, D, rope = 2, 1, 4, 144, 16
    kv = fp8_kv_cache(torch.randn(B, 10, D, device=DEVICE), rope, 10)
    q, sink = torch.randn(B, S, H, D, device=DEVICE), torch.randn(H, device=DEVICE)
    kv_idx = torch.randint(-1, 10, (B, S, 8), dtype=torch.int32, device=DEVICE)
    cmp = torch.zeros(B, 0, D, device=DEVICE)
    none = torch.full((B, S, 0), -1, dtype=torch.int32, device=DEVICE)
    args = (q, kv, kv_idx, cmp, none, torch.zeros(B, S, dtype=torch.int32, device=DEVICE), sink, D**-0.5)
    want = ref.sparse_attention(*args)
    for splits in (1, 2):
        got = attn.sparse_attention(*args, out=torch.full_like(want, float("nan")), num_splits=splits)
        torch.testing.assert_close(got, want, **tol(torch.float32))
