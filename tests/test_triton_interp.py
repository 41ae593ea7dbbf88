"""Raw Triton launchers vs the reference ops.

On a machine without CUDA the kernels run under ``TRITON_INTERPRET=1`` (numpy, one program
at a time), so grids stay small; on a CUDA machine the same tests launch the compiled kernels
on the GPU. Every output buffer is poisoned before the launch.
"""
import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported
DEVICE = torch.device("cuda" if CUDA else "cpu")

import triton  # noqa: E402

from dsv4_ops.reference import ops as ref  # noqa: E402


def _kernel_module(name):
    """``dsv4_ops.lowering.triton.<name>``."""
    return importlib.import_module(f"dsv4_ops.lowering.triton.{name}")


attn = _kernel_module("sparse_attention")
indexer = _kernel_module("indexer")


# --------------------------------------------------------------------------------------
# sparse attention
# --------------------------------------------------------------------------------------
def _attention_inputs(B, S, H, D, N, W, Nc, K, dtype, cmp_len=None):
    dev = DEVICE
    q = torch.randn(B, S, H, D, device=dev).to(dtype)
    kv = torch.randn(B, N, D, device=dev).to(dtype)
    cmp = torch.randn(B, Nc, D, device=dev).to(dtype)
    kv_idx = torch.randint(-1, max(N, 1), (B, S, W), device=dev, dtype=torch.int32)
    if N == 0:
        kv_idx.fill_(-1)
    cmp_idx = torch.randint(-1, max(Nc, 1), (B, S, K), device=dev, dtype=torch.int32)
    if Nc == 0:
        cmp_idx.fill_(-1)
    if cmp_len is None:
        cmp_len = torch.randint(0, Nc + 1, (B, S), device=dev, dtype=torch.int32)
    sink = torch.randn(H, device=dev)
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
def test_sparse_attention_matches_reference(case, dtype, splits, poison, tol):
    B, S, H, D, N, W, Nc, K, cfg = ATTENTION_CASES[case]
    args = _attention_inputs(B, S, H, D, N, W, Nc, K, dtype)
    if cfg is not None:
        cfg = dict(cfg, NUM_SPLITS=splits)
    got = _run_attention(poison, args, num_splits=splits, config=cfg)
    want = ref.sparse_attention(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **tol(dtype))


@pytest.mark.parametrize("splits", [1, 4])
def test_sparse_attention_without_entries_is_zero(splits, poison):
    """All -1 indices and cmp_len = 0: the sink takes all the mass, the output is exactly 0."""
    args = list(_attention_inputs(2, 2, 4, 64, 12, 8, 10, 6, torch.float32))
    args[2] = torch.full_like(args[2], -1)
    args[4] = torch.full_like(args[4], -1)
    args[5] = torch.zeros_like(args[5])
    got = _run_attention(poison, args, num_splits=splits)
    assert torch.equal(got, torch.zeros_like(got))
    assert torch.equal(ref.sparse_attention(*args), torch.zeros_like(got))


@pytest.mark.parametrize("splits", [1, 4])
def test_sparse_attention_single_entry(splits, poison, tol):
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


def test_sparse_attention_lengths_outside_pool(poison, tol):
    """cmp_len beyond the pool is clamped to Nc, negative means none (reference semantics)."""
    args = list(_attention_inputs(2, 2, 4, 64, 12, 8, 10, 6, torch.float32))
    args[5] = torch.tensor([[13, -3], [10, 0]], dtype=torch.int32, device=DEVICE)
    got = _run_attention(poison, args, num_splits=2)
    torch.testing.assert_close(got, ref.sparse_attention(*args), **tol(torch.float32))


def test_sparse_attention_more_splits_than_blocks(poison, tol):
    """Splits past the query's entries write empty partials; the combine ignores them."""
    args = _attention_inputs(2, 1, 4, 64, 12, 3, 6, 2, torch.float32)
    got = _run_attention(poison, args, num_splits=8)
    torch.testing.assert_close(got, ref.sparse_attention(*args), **tol(torch.float32))


def test_sparse_attention_non_contiguous_inputs(poison, tol):
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
    test_triton_cross_compile); the bf16/fp16 configs stay the tuned ones."""
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
def test_sparse_attention_out_of_range_indices_are_skipped(splits, poison, tol):
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


# --------------------------------------------------------------------------------------
# lightning indexer
# --------------------------------------------------------------------------------------
def _indexer_inputs(B, S, HI, DI, N, dtype, integer=False, visible=None, weights=None):
    dev = DEVICE
    if integer:  # small integers: every score is exact in fp32 whatever the summation order
        draw = lambda *shape: torch.randint(-2, 3, shape, device=dev).to(dtype)  # noqa: E731
    else:
        draw = lambda *shape: torch.randn(*shape, device=dev).to(dtype)  # noqa: E731
    q, keys = draw(B, S, HI, DI), draw(B, N, DI)
    w = draw(B, S, HI) if weights is None else weights
    if visible is None:
        visible = torch.randint(0, N + 1, (B, S), device=dev, dtype=torch.int32)
    return q, w, keys, visible


# the top-k paths: row in registers (default 5-bit digits, whose last pass re-reads known
# bits; 8-bit; 3-bit), the looped kernel for rows past TOPK_ROW (several blocks) and the split
# top-k forced on with 16-entry segments (rows of more than 16 scores; test_triton_interp_topk_split.py)
TOPK_PATHS = {"row": {}, "row_bits8": dict(TOPK_BITS=8), "row_bits3": dict(TOPK_BITS=3),
              "looped": dict(TOPK_ROW=0, TOPK_BLOCK=16), "split": dict(TOPK_SPLIT=16)}


@pytest.fixture(params=list(TOPK_PATHS))
def topk_path(request):
    return TOPK_PATHS[request.param]


def _run_topk(poison, q, w, keys, visible, topk, config=None):
    out = poison(torch.empty(*visible.shape, topk, dtype=torch.int32, device=DEVICE))
    scores = poison(torch.empty(*visible.shape, keys.shape[1], dtype=torch.float32, device=DEVICE))
    got = indexer.indexer_topk(q, w, keys, visible, topk, out=out, scores=scores, config=config)
    assert got is out
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_scores_matches_reference(dtype, poison, tol):
    q, w, keys, visible = _indexer_inputs(2, 2, 8, 32, 70, dtype)
    visible[0, 0] = 70
    out = poison(torch.empty(2, 2, 70, dtype=torch.float32, device=DEVICE))
    got = indexer.indexer_scores(q, w, keys, visible, out=out)
    want = ref.indexer_scores(q, w, keys, visible)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got, want, **tol(torch.float32 if dtype == torch.float32 else dtype))


@pytest.mark.parametrize("chunk", [16, 64])
def test_indexer_scores_chunks_cover_the_row(chunk, poison, tol):
    """A program's chunk spans several blocks: rows cut mid-block, mid-chunk, at a chunk
    edge and at 0 are scored up to ``visible`` and ``-inf`` after, every slot written."""
    q, w, keys, visible = _indexer_inputs(1, 4, 8, 32, 150, torch.float32)
    visible[0] = torch.tensor([150, 37, 64, 0], dtype=torch.int32)
    out = poison(torch.empty(1, 4, 150, dtype=torch.float32, device=DEVICE))
    got = indexer.indexer_scores(q, w, keys, visible, out=out, config=dict(BLOCK_N=16, CHUNK=chunk))
    want = ref.indexer_scores(q, w, keys, visible)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got, want, **tol(torch.float32))


def test_indexer_config_fills_the_gpu_from_static_sizes():
    """Scores chunks shrink for few tokens or short rows (about 2 programs per SM, one wave)."""
    big = indexer.indexer_config(B=64, S=1, HI=64, DI=128, N=8192, topk=512, sms=132)
    one = indexer.indexer_config(B=1, S=1, HI=64, DI=128, N=8192, topk=512, sms=132)
    assert big["CHUNK"] == 2048 and 64 * (8192 // big["CHUNK"]) >= 2 * 132 * 0.9
    assert one["CHUNK"] == one["BLOCK_N"] == 64
    # top-k: rows up to 32K scores (128K context) in registers on CUDA; ROCm keeps the looped kernel
    assert big["TOPK_ROW"] == 32768 and big["TOPK_BITS"] == 5
    assert indexer.indexer_config(B=1, S=1, HI=64, DI=128, N=8192, topk=512, backend="hip")["TOPK_ROW"] == 0


@pytest.mark.parametrize("B, N, keys_fp8, chunk", [
    (64, 8192, False, 2048),     # 32K context: 256 programs
    (128, 8192, False, 4096),    # 256 programs, not 512 (3 fit an SM: a second, mostly idle wave)
    (64, 32768, False, 8192),    # 128K context: 256 programs
    (128, 32768, False, 1024),   # one wave would need chunks past 8192: many short waves instead
    (4096, 32768, False, 1024),  # a prefill's worth
    (128, 8192, True, 2048),     # FP8 keys decoded (fp32 queries, ROCm): chunks of at most 2048, as before
    (1, 8192, True, 64),
    (64, 8192, "dot", 1024),     # FP8 keys, e4m3 tensor-core dot: ~4 programs a SM (5 fit), up to 8192
    (128, 8192, "dot", 2048),
    (64, 32768, "dot", 4096),
    (128, 32768, "dot", 8192),
    (4096, 32768, "dot", 8192),
    (1, 8192, "dot", 64),
])
def test_scores_chunk_keeps_the_grid_in_one_wave_or_many(B, N, keys_fp8, chunk):
    """The H200 sweeps (BENCHMARKS.md sessions 15, 16): bf16 keys in grids of 256 programs (one wave
    of 2 a SM) or thousands, never ~512 (3.9 a SM where 3 fit); FP8 keys on the e4m3 dot in one
    wave of ~4 a SM (5 fit) or, past 8192-entry chunks, many."""
    cfg = indexer.indexer_config(B=B, S=1, HI=64, DI=128, N=N, topk=512, sms=132, keys_fp8=bool(keys_fp8),
                                 fp8_dot=keys_fp8 == "dot")
    assert cfg["CHUNK"] == chunk
    programs = B * -(-N // chunk)
    if keys_fp8 == "dot":
        assert programs <= 4 * 132 or chunk == 8192
    elif not keys_fp8:
        assert programs <= 2 * 132 or programs >= 8 * 132


INDEXER_CASES = {
    # name: (B, S, HI, DI, N, topk, visible or None (random))
    "random_visible": (2, 2, 4, 32, 40, 16, None),
    "visible_below_topk": (2, 2, 4, 32, 40, 16, [[3, 0], [15, 1]]),
    "visible_past_pool": (1, 2, 4, 32, 12, 8, [[12, 50]]),
    "topk_wider_than_pool": (1, 2, 4, 32, 10, 16, [[10, 7]]),
    "topk_one": (2, 1, 4, 32, 33, 1, None),
    "several_row_chunks": (1, 1, 16, 64, 2500, 64, [[2431]]),  # > 2 chunks of 1024
    "v4_heads": (1, 1, 64, 128, 200, 32, [[177]]),  # 64 indexer heads x 128 dims
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(INDEXER_CASES))
def test_indexer_topk_matches_reference_exactly(case, dtype, poison, topk_path):
    """Integer-valued inputs: exact scores with many ties, so indices must match exactly
    (order by descending score, ties to the lower index, -1 after min(topk, visible))."""
    B, S, HI, DI, N, topk, vis = INDEXER_CASES[case]
    visible = None if vis is None else torch.tensor(vis, dtype=torch.int32, device=DEVICE)
    q, w, keys, visible = _indexer_inputs(B, S, HI, DI, N, dtype, integer=True, visible=visible)
    got = _run_topk(poison, q, w, keys, visible, topk, topk_path)
    want = ref.indexer_topk(q, w, keys, visible, topk)
    assert got.dtype == torch.int32 and got.shape == want.shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("tokens_per_group", [1, 2])
def test_indexer_topk_scores_a_long_chunk_in_token_groups(tokens_per_group, poison):
    """When ``[B, S, N]`` fp32 scores exceed the scratch budget (a long prefill chunk at large
    batch and context), the query tokens go in groups reusing one ``[B, G, N]`` scratch; the
    picks are exactly those of one group."""
    B, S, HI, DI, N, topk = 2, 5, 4, 16, 40, 6
    q, w, keys, visible = _indexer_inputs(B, S, HI, DI, N, torch.float32, integer=True)
    budget = tokens_per_group * 4 * B * N
    assert indexer.token_group(B, S, N, budget) == tokens_per_group
    assert indexer.token_group(B, S, N) == S  # the default budget: one group (every step so far)
    launches = indexer.indexer_launches(q, w, keys, visible, topk, budget=budget)
    assert len(launches.groups) == -(-S // tokens_per_group)
    scratch = {l[0].args[4].data_ptr() for l in launches.groups}  # the scores kernel's output
    assert len(scratch) == 1 and launches.groups[0][0].args[4].shape == (B, tokens_per_group, N)
    out = poison(torch.empty(B, S, topk, dtype=torch.int32, device=DEVICE))
    got = indexer.indexer_topk(q, w, keys, visible, topk, out=out, budget=budget)
    assert got is out
    assert torch.equal(got, ref.indexer_topk(q, w, keys, visible, topk))


def test_indexer_topk_ties_at_negative_zero(poison, topk_path):
    """All-negative weights make every all-ReLU-zero entry score -0.0: one big tie group that
    must be broken by index exactly like the stable sort (which treats -0.0 == +0.0)."""
    B, S, HI = 2, 2, 4
    w = -torch.randint(1, 3, (B, S, HI), device=DEVICE).float()
    q, w, keys, visible = _indexer_inputs(B, S, HI, 16, 48, torch.float32, integer=True, weights=w)
    visible = torch.full_like(visible, 48)
    got = _run_topk(poison, q, w, keys, visible, 24, topk_path)
    assert torch.equal(got, ref.indexer_topk(q, w, keys, visible, 24))


def test_indexer_topk_all_invisible_and_empty_pool(poison, topk_path):
    q, w, keys, visible = _indexer_inputs(2, 2, 4, 32, 20, torch.float32, visible=None)
    visible = torch.zeros_like(visible)
    assert torch.equal(_run_topk(poison, q, w, keys, visible, 8, topk_path), torch.full((2, 2, 8), -1, dtype=torch.int32, device=DEVICE))
    empty = keys[:, :0]
    got = _run_topk(poison, q, w, empty, visible + 3, 8, topk_path)
    assert torch.equal(got, ref.indexer_topk(q, w, empty, visible + 3, 8))


def test_indexer_topk_visible_out_of_range_is_clamped(poison, topk_path):
    """The raw-op contract on the Triton path: ``visible`` reads as clamped to [0, N]."""
    q, w, keys, _ = _indexer_inputs(2, 2, 4, 32, 20, torch.float32, integer=True)
    visible = torch.tensor([[-4, 21], [2**31 - 1, 5]], dtype=torch.int32, device=DEVICE)
    got = _run_topk(poison, q, w, keys, visible, 8, topk_path)
    assert torch.equal(got, ref.indexer_topk(q, w, keys, visible, 8))
    assert torch.equal(got, ref.indexer_topk(q, w, keys, visible.clamp(0, 20), 8))


def test_indexer_topk_random_scores(poison, topk_path):
    """Random fp32 inputs: the picks are exactly the stable top-k of the kernel's own scores,
    and their reference scores match the reference picks' scores (summation order may differ)."""
    q, w, keys, visible = _indexer_inputs(2, 2, 8, 32, 300, torch.float32)
    visible[0, 0] = 300
    topk = 64
    scores = indexer.indexer_scores(q, w, keys, visible)
    got = _run_topk(poison, q, w, keys, visible, topk, topk_path)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :topk]
    rank = torch.arange(topk, device=DEVICE)
    expect = torch.where(rank < visible[..., None], order, -1).to(torch.int32)
    assert torch.equal(got, expect)
    want = ref.indexer_topk(q, w, keys, visible, topk)
    ref_scores = ref.indexer_scores(q, w, keys, visible)
    pick = lambda idx: torch.gather(ref_scores, -1, idx.clamp(min=0).long()).masked_fill(idx < 0, 0)  # noqa: E731
    torch.testing.assert_close(pick(got), pick(want), atol=1e-4, rtol=1e-4)
