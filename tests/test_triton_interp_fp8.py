"""The FP8-cache Triton kernels vs the reference (``dsv4_ops/reference/fp8_cache.py``), bit for
bit where they write bytes: the integer codec against torch's e4m3 / bf16 casts, the quantising
``cache_write`` and ``compress`` (KV layout and Hadamard-rotated indexer keys), and the readers
(``sparse_attention`` with an FP8 pool, with FP8 window + pool, split-KV; ``indexer_topk`` over
FP8 keys), also on the per-kernel benchmark's FP8 inputs. Under ``TRITON_INTERPRET=1`` on CPU
(tiny grids), compiled kernels on a GPU.
Every destination starts poisoned."""
import math
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported
DEVICE = torch.device("cuda" if CUDA else "cpu")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from dsv4_ops.reference import fp8_cache as fp8  # noqa: E402
from dsv4_ops.reference import ops as ref  # noqa: E402
from test_triton_interp import _kernel_module  # noqa: E402

codec = _kernel_module("fp8_codec")
cw = _kernel_module("cache_write")
cp = _kernel_module("compress")
sa = _kernel_module("sparse_attention")
ix = _kernel_module("indexer")


@triton.jit
def _codec_kernel(x_ptr, code_ptr, bf_ptr, exp_ptr, dec_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    code = codec.e4m3_encode(x)
    tl.store(code_ptr + offs, code.to(tl.uint8), mask=m)
    tl.store(bf_ptr + offs, codec.bf16_bits(x), mask=m)
    tl.store(exp_ptr + offs, codec.scale_exponent(tl.abs(x)), mask=m)
    tl.store(dec_ptr + offs, codec.e4m3_decode(code), mask=m)


def test_codec_matches_torch_casts_bit_for_bit():
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    every = every[every.isfinite()].sort().values
    mid = (every[1:] + every[:-1]) / 2  # exact ties: round half to even
    x = torch.cat([every, mid, torch.nextafter(mid, torch.full_like(mid, 1e9)),
                   torch.nextafter(mid, torch.full_like(mid, -1e9)), (torch.rand(4000) * 2 - 1) * 448,
                   torch.randn(2000) * 1e-3, torch.tensor([0.0, -0.0, 1e-40, -1e-40])]).clamp(-448, 448).to(DEVICE)
    n = x.numel()
    code = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    bf, exp = (torch.empty(n, dtype=torch.int32, device=DEVICE) for _ in range(2))
    dec = torch.empty(n, device=DEVICE)
    _codec_kernel[(triton.cdiv(n, 4096),)](x, code, bf, exp, dec, n, BLOCK=4096)
    assert torch.equal(code, x.to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(bf, x.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF)
    assert torch.equal(exp, fp8.scale_exponent(x.abs()))
    assert torch.equal(dec, x.to(torch.float8_e4m3fn).float())


@triton.jit
def _decode_kernel(code_ptr, out_ptr, N, DT: tl.constexpr, HW: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    code = tl.load(code_ptr + offs, mask=offs < N, other=0)
    tl.store(out_ptr + offs, codec.e4m3_to(code, DT, HW), mask=offs < N)


# the decodes each target can run: the interpreter multiplies bf16 as raw bits, so the bit-move
# decodes (3 a bf16 multiply, 4 PTX) run on a GPU only; ROCm's integer one (0) runs everywhere
DECODES = [0, 1, 2, 3, 4] if CUDA else [0, 1]


@pytest.mark.parametrize("hw", DECODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_every_e4m3_code_decodes_exactly(hw, dtype):
    # all 256 codes but the two NaNs (never written), subnormals and -0 included
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].to(DEVICE)
    out = torch.full(codes.shape, float("nan"), dtype=dtype, device=DEVICE)
    tl_dtype = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32, torch.float16: tl.float16}[dtype]
    _decode_kernel[(1,)](codes, out, codes.numel(), DT=tl_dtype, HW=hw, BLOCK=256)
    want = codes.view(torch.float8_e4m3fn).to(dtype)
    assert torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       want.view(torch.int16 if dtype != torch.float32 else torch.int32))


@triton.jit
def _entries_kernel(data_ptr, scale_ptr, out_ptr, n, NOPE, D, ENTRY: tl.constexpr, SB: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DT: tl.constexpr, HW: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    live = offs_n < n
    e = codec.load_kv_entries(data_ptr + offs_n * ENTRY, scale_ptr + offs_n * SB, live, NOPE, D, BLOCK_N, BLOCK_D,
                              DT, HW)
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(out_ptr + offs_n[:, None] * BLOCK_D + offs_d[None, :], e)


@pytest.mark.parametrize("hw", DECODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_entries_read_as_the_reference_dequantises_them(hw, dtype):
    # the attention's FP8 row reader: values scaled from 1e-4 to 1e3 (scales far apart, subnormal
    # codes), every decode, the reference's values rounded to the dot dtype, bit for bit
    torch.manual_seed(7)
    n, D, rope = 9, 256, 64
    lay = fp8.KVLayout(D, rope, n)
    x = torch.randn(n, D, device=DEVICE) * torch.logspace(-4, 3, D, device=DEVICE)[torch.randperm(D, device=DEVICE)]
    data, scales = fp8.quantize_kv(x, rope)
    want = torch.zeros(16, D, dtype=dtype, device=DEVICE)
    want[:n] = fp8.dequantize_kv(data, scales, lay).to(dtype)
    out = torch.full((16, D), float("nan"), dtype=dtype, device=DEVICE)
    tl_dtype = tl.bfloat16 if dtype == torch.bfloat16 else tl.float32
    _entries_kernel[(1,)](data.contiguous(), scales.contiguous(), out, n, D - rope, D, ENTRY=lay.data_bytes,
                          SB=lay.scale_bytes, BLOCK_N=16, BLOCK_D=D, DT=tl_dtype, HW=hw)
    view = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(out.view(view), want.view(view))


def _poisoned(shape):
    return torch.full(shape, 0xA5, dtype=torch.uint8, device=DEVICE)


def test_fp8_cache_write_kernel_is_the_reference_bit_for_bit():
    B, D, rope = 2, 144, 16
    lay = fp8.KVLayout(D, rope, 4)
    want = _poisoned(lay.shape(B, 10))
    got = want.clone()
    values = torch.randn(B, 5, D, device=DEVICE) * torch.logspace(-3, 2, D, device=DEVICE)
    slots = torch.tensor([[0, 3, -1, 7, 9], [11, 2, 5, -1, 4]], dtype=torch.int32, device=DEVICE)
    ref.cache_write(want, values, slots)
    cw.launch(cw.fp8_cache_write_kernel, cw.fp8_cache_write_launch(got, values, slots, rope, lay.data_bytes,
                                                                   lay.scale_bytes))
    assert torch.equal(got, want)


@pytest.mark.parametrize("d,half,m,overlap,keys", [(144, 8, 4, True, False), (128, 32, 8, False, False),
                                                    (32, 8, 4, True, True)])
def test_fp8_compress_kernel_is_the_reference_bit_for_bit(d, half, m, overlap, keys):
    torch.manual_seed(d + m)
    B, S, c = 2, 9, 2 if overlap else 1
    R = c * m + 8
    rings = [torch.randn(B, R, c * d, device=DEVICE) for _ in range(2)]
    new = [torch.randn(B, S, c * d, device=DEVICE) for _ in range(2)]
    start = torch.tensor([5, 12], dtype=torch.int32, device=DEVICE)
    emit = torch.tensor([[1, 2, 3], [3, 4, -1]], dtype=torch.int32, device=DEVICE)  # raw op: whatever the ring holds
    w = torch.rand(d, device=DEVICE) + 0.5
    cos, sin = torch.randn(64, half, device=DEVICE), torch.randn(64, half, device=DEVICE)
    lay = fp8.IndexerLayout(d, 4) if keys else fp8.KVLayout(d, 2 * half, 4)
    want = _poisoned(lay.shape(B, 10))
    got = want.clone()
    args = (*rings, *new, start, emit, w, cos, sin)
    ref.compress(*args, want, m, overlap, 1e-6)
    cp.compress(*args, got, m, overlap, 1e-6)
    assert torch.equal(got, want)


def _fp8_kv(values, rope, page):
    B, n, D = values.shape
    cache = _poisoned(fp8.KVLayout(D, rope, page).shape(B, n))
    ref.cache_write(cache, values, torch.arange(n, dtype=torch.int32, device=DEVICE).expand(B, n).contiguous())
    return cache


@pytest.mark.parametrize("window_fp8", [False, True])
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("rope, words", [(16, 1), (80, 0)], ids=["word_reader", "byte_reader"])
def test_fp8_sparse_attention_matches_the_reference(window_fp8, splits, rope, words):
    # rope within one 64-channel block: the word-wide reader (load_kv_entries); wider rope: the
    # per-channel byte gathers
    torch.manual_seed(3)
    B, S, H, D = 2, 3, 4, 144
    window = torch.randn(B, 10, D, device=DEVICE)
    kv = _fp8_kv(window, rope, 10) if window_fp8 else window  # concat mode keeps a float window source
    cmp = _fp8_kv(torch.randn(B, 13, D, device=DEVICE), rope, 8)
    q, sink = torch.randn(B, S, H, D, device=DEVICE), torch.randn(H, device=DEVICE)
    kv_idx = torch.randint(-1, 10, (B, S, 5), dtype=torch.int32, device=DEVICE)
    cmp_idx = torch.randint(-1, 13, (B, S, 6), dtype=torch.int32, device=DEVICE)
    cmp_len = torch.randint(0, 14, (B, S), dtype=torch.int32, device=DEVICE)
    args = (q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, D**-0.5)
    want = ref.sparse_attention(*args)
    assert sa.attention_launches(*args, num_splits=splits).attention.meta["FP8_WORDS"] == words
    out = torch.full_like(want, float("nan"))
    got = sa.sparse_attention(*args, out=out, num_splits=splits)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fp8_window_without_a_pool_matches_the_reference():
    # a sliding-window layer of an FP8-cache model: FP8 window ring, no compressed entries (an
    # empty float pool), decode and split-KV (found on the H200: the launcher refused it)
    torch.manual_seed(4)
    B, S, H, D, rope = 2, 1, 4, 144, 16
    kv = _fp8_kv(torch.randn(B, 10, D, device=DEVICE), rope, 10)
    q, sink = torch.randn(B, S, H, D, device=DEVICE), torch.randn(H, device=DEVICE)
    kv_idx = torch.randint(-1, 10, (B, S, 8), dtype=torch.int32, device=DEVICE)
    cmp = torch.zeros(B, 0, D, device=DEVICE)
    none = torch.full((B, S, 0), -1, dtype=torch.int32, device=DEVICE)
    args = (q, kv, kv_idx, cmp, none, torch.zeros(B, S, dtype=torch.int32, device=DEVICE), sink, D**-0.5)
    want = ref.sparse_attention(*args)
    for splits in (1, 2):
        got = sa.sparse_attention(*args, out=torch.full_like(want, float("nan")), num_splits=splits)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("offset, reader", [(0, 2), (1, 1)], ids=["word_reader", "byte_reader"])
def test_fp8_indexer_topk_matches_the_reference(offset, reader):
    # keys 4-byte aligned: codes read as words; a pool starting at an odd byte: a byte per lane
    torch.manual_seed(4)
    B, S, HI, DI, N = 2, 3, 4, 32, 11
    shape = fp8.IndexerLayout(DI, 4).shape(B, N)
    keys = _poisoned((math.prod(shape) + offset,))[offset:].view(shape)
    ref._write_entries_fp8(keys, torch.randn(B, N, DI, device=DEVICE),
                           torch.arange(N, dtype=torch.int32, device=DEVICE).expand(B, N).contiguous())
    q = fp8.rotate(torch.randn(B, S, HI, DI, device=DEVICE))
    w = torch.randn(B, S, HI, device=DEVICE)
    vis = torch.tensor([[0, 5, 11], [12, 1, 7]], dtype=torch.int32, device=DEVICE)  # 12: clamped to the pool
    want = ref.indexer_topk(q, w, keys, vis, 5)
    assert ix.scores_launch(q, w, keys, vis)[1].meta["KEYS_FP8"] == reader
    got = ix.indexer_topk(q, w, keys, vis, 5, out=torch.full_like(want, 77))
    assert torch.equal(got, want)
    scores = ix.indexer_scores(q, w, keys, vis)
    # FP8 queries too (one power-of-two scale a head): the unquantised queries' scores differ
    want_scores = ref.indexer_scores(fp8.simulate_queries(q), w, fp8.read_keys(keys), vis)
    torch.testing.assert_close(scores, want_scores, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ref.indexer_scores(q, w, fp8.read_keys(keys), vis), want_scores, rtol=1e-3, atol=1e-3)


def test_fp8_indexer_bf16_queries_score_as_fp8_queries():
    """bf16 queries over FP8 keys: on a GPU with FP8 MMA an e4m3 x e4m3 tensor-core dot (``FP8_DOT``),
    in the interpreter both sides decoded to bf16. Either way the scores are those of the quantised
    queries (``simulate_queries``) within the tensor cores' accumulation (sm_90 adds FP8 products with
    fewer bits than fp32), and the picks are a best-scoring set within that. V4's indexer widths."""
    torch.manual_seed(6)
    B, S, HI, DI, N, k = 2, 1, 64, 128, 256 if CUDA else 96, 16
    keys = torch.empty(fp8.IndexerLayout(DI, 64).shape(B, N), dtype=torch.uint8, device=DEVICE)
    ref._write_entries_fp8(keys, torch.randn(B, N, DI, device=DEVICE),
                           torch.arange(N, dtype=torch.int32, device=DEVICE).expand(B, N).contiguous())
    q = fp8.rotate(torch.randn(B, S, HI, DI, device=DEVICE)).to(torch.bfloat16)
    w = torch.randn(B, S, HI, device=DEVICE)
    vis = torch.tensor([[N], [N - 5]], dtype=torch.int32, device=DEVICE)
    fp8_mma = CUDA and torch.cuda.get_device_capability() >= (8, 9)
    assert ix.scores_launch(q, w, keys, vis)[1].meta["FP8_DOT"] == int(fp8_mma)
    got = ix.indexer_scores(q, w, keys, vis)
    want = ref.indexer_scores(fp8.simulate_queries(q), w, fp8.read_keys(keys), vis)
    live = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), live)
    span = want[live].abs().max()
    err = (got[live] - want[live]).abs().max() / span
    assert err < 2e-3, f"scores off by {err:.2e} of their range"
    unquantised = ref.indexer_scores(q, w, fp8.read_keys(keys), vis)
    assert ((unquantised[live] - want[live]).abs().max() / span) > 10 * err  # the queries' quantisation is seen
    picks = ix.indexer_topk(q, w, keys, vis, k)
    for b in range(B):
        row = want[b, 0]
        kth = row.sort(descending=True).values[k - 1]
        chosen = row[picks[b, 0].long()]
        assert picks[b, 0].unique().numel() == k and (chosen >= kth - 2e-3 * span).all(), (b, chosen, kth)


def test_fp8_queries_round_as_the_reference_code_for_code():
    """Each query value's e4m3 code, seen through the scores: key ``i`` is the unit vector ``e_i`` and
    only head 0 weighs, so ``score[i] = relu(q_0[i])`` as quantised, one product (exact on any
    tensor core) times two powers of two. Queries on rounding midpoints (ties to even), subnormal
    codes and a head whose amax sits on the scale's boundary; bf16 queries (the e4m3 dot on a GPU)."""
    HI, DI = 64, 128
    keys = torch.empty(fp8.IndexerLayout(DI, 64).shape(1, DI), dtype=torch.uint8, device=DEVICE)
    unit = torch.eye(DI, device=DEVICE)[None]
    ref._write_entries_fp8(keys, fp8.rotate(unit), torch.arange(DI, dtype=torch.int32, device=DEVICE)[None])
    torch.manual_seed(8)
    # the writer rotates what it stores, and rotating twice is the identity: key i holds e_i exactly
    q0 = torch.randn(DI, device=DEVICE).abs() * 3
    # q0 / scale (scale 2^-2: amax 112): 448, midpoints 136 -> 128 and 152 -> 160 (ties to even), 8.5 -> 8,
    # 9.5 -> 10, 0, subnormal codes 3 * 2^-9, and the subnormal midpoints 2.5 * 2^-9 -> 2, 3.5 * 2^-9 -> 4
    q0[:10] = torch.tensor([448.0, 136.0, 152.0, 8.5, 9.5, 0.0, 3 * 2.0**-9, 2.5 * 2.0**-9, 3.5 * 2.0**-9, 2.0],
                           device=DEVICE) / 4
    q = torch.randn(1, 1, HI, DI, device=DEVICE)
    q[0, 0, 0] = q0  # key i meets q0[i] (the op does not rotate its queries)
    q = q.to(torch.bfloat16)
    assert torch.equal(q[0, 0, 0, :10].float(), q0[:10])
    w = torch.zeros(1, 1, HI, device=DEVICE)
    w[0, 0, 0] = 1.0
    vis = torch.full((1, 1), DI, dtype=torch.int32, device=DEVICE)
    got = ix.indexer_scores(q, w, keys, vis)
    want = ref.indexer_scores(fp8.simulate_queries(q), w, fp8.read_keys(keys), vis)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got[0, 0, :10].tolist() == [112.0, 32.0, 40.0, 2.0, 2.5, 0.0, 3 * 2.0**-11, 2.0**-10, 2.0**-9, 0.5]


def test_the_kernel_benchmarks_fp8_cases_run_through_the_kernels():
    # benchmarks/kernel_bench/cases.py builds the FP8 rows of bench_ops (gpu_check.sh ops-fp8): its pages
    # (window ring = one page of W entries, pools of PAGE_SIZE) must be what the kernels read; tiny widths
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks` is not installed
    from benchmarks.kernel_bench import cases as C

    torch.manual_seed(5)
    d = C.TINY["flash"]
    for variant in ("csa", "hca"):
        args = C.sparse_attention_case(d, variant, 2, 256, "flash", "fp8").make(DEVICE)
        want = ref.sparse_attention(*args)
        for splits in (1, 2):
            got = sa.sparse_attention(*args, out=torch.full_like(want, float("nan")), num_splits=splits)
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # bf16 outputs
    args = C.indexer_topk_case(d, 2, 256, "flash", "fp8").make(DEVICE)
    want = ref.indexer_topk(*args)
    assert torch.equal(ix.indexer_topk(*args, out=torch.full_like(want, 77)), want)
