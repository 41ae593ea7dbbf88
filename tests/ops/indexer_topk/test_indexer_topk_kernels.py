"""The lightning indexer's kernels (``lowering/triton/indexer.py``) against the reference: the scores
kernel (fp32 and bf16, chunks spanning several blocks, rows cut mid-block, mid-chunk and at 0) and
every top-k path -- the row in registers (5-, 8- and 3-bit digits), the looped kernel for rows past
``TOPK_ROW``, the split top-k forced on -- exactly, on integer-valued inputs (exact scores, many
ties: descending score, ties to the lower index, -1 after ``min(topk, visible)``): visible below
topk, past the pool, topk wider than the pool, topk = 1, several row chunks, V4's 64 heads; ties at
-0.0, nothing visible, an empty pool, visible out of range (read as clamped); random fp32 scores
pick the stable top-k of the kernel's own scores; a long prefill chunk scored in token groups
reusing one scratch; the launch configs (scores chunks that keep the grid in one wave or many, the
row top-k up to 32K scores on CUDA); and FP8 keys (word and byte readers; FP8 queries, the e4m3
tensor-core dot for bf16 queries on a GPU, query rounding code for code).

Under ``TRITON_INTERPRET=1`` on CPU (small grids), the compiled kernels on a GPU. Every output
buffer is poisoned before the launch. The split and fused top-k have their own files.
"""
import math

import pytest
import torch

from dsv4_ops.reference import fp8_cache as fp8
from dsv4_ops.reference import ops as ref
from fp8_cases import poisoned, write_index_keys
from indexer_topk_cases import kernel_inputs
from launchers import CUDA, DEVICE, kernel_module

indexer = kernel_module("indexer")


# the top-k paths: row in registers (default 5-bit digits, whose last pass re-reads known
# bits; 8-bit; 3-bit), the looped kernel for rows past TOPK_ROW (several blocks) and the split
# top-k forced on with 16-entry segments (rows of more than 16 scores; test_indexer_topk_split.py)
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
    q, w, keys, visible = kernel_inputs(2, 2, 8, 32, 70, dtype)
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
    q, w, keys, visible = kernel_inputs(1, 4, 8, 32, 150, torch.float32)
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
    q, w, keys, visible = kernel_inputs(B, S, HI, DI, N, dtype, integer=True, visible=visible)
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
    q, w, keys, visible = kernel_inputs(B, S, HI, DI, N, torch.float32, integer=True)
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
    q, w, keys, visible = kernel_inputs(B, S, HI, 16, 48, torch.float32, integer=True, weights=w)
    visible = torch.full_like(visible, 48)
    got = _run_topk(poison, q, w, keys, visible, 24, topk_path)
    assert torch.equal(got, ref.indexer_topk(q, w, keys, visible, 24))


def test_indexer_topk_all_invisible_and_empty_pool(poison, topk_path):
    q, w, keys, visible = kernel_inputs(2, 2, 4, 32, 20, torch.float32, visible=None)
    visible = torch.zeros_like(visible)
    assert torch.equal(_run_topk(poison, q, w, keys, visible, 8, topk_path), torch.full((2, 2, 8), -1, dtype=torch.int32, device=DEVICE))
    empty = keys[:, :0]
    got = _run_topk(poison, q, w, empty, visible + 3, 8, topk_path)
    assert torch.equal(got, ref.indexer_topk(q, w, empty, visible + 3, 8))


def test_indexer_topk_visible_out_of_range_is_clamped(poison, topk_path):
    """The raw-op contract on the Triton path: ``visible`` reads as clamped to [0, N]."""
    q, w, keys, _ = kernel_inputs(2, 2, 4, 32, 20, torch.float32, integer=True)
    visible = torch.tensor([[-4, 21], [2**31 - 1, 5]], dtype=torch.int32, device=DEVICE)
    got = _run_topk(poison, q, w, keys, visible, 8, topk_path)
    assert torch.equal(got, ref.indexer_topk(q, w, keys, visible, 8))
    assert torch.equal(got, ref.indexer_topk(q, w, keys, visible.clamp(0, 20), 8))


def test_indexer_topk_random_scores(poison, topk_path, tol):
    """Random fp32 inputs: the picks are exactly the stable top-k of the kernel's own scores,
    and their reference scores match the reference picks' scores (summation order may differ)."""
    q, w, keys, visible = kernel_inputs(2, 2, 8, 32, 300, torch.float32)
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
    torch.testing.assert_close(pick(got), pick(want), **tol("indexer_pick_scores_fp32"))


# ---- FP8 keys ------------------------------------------------------------------------------------
@pytest.mark.parametrize("offset, reader", [(0, 2), (1, 1)], ids=["word_reader", "byte_reader"])
def test_fp8_indexer_topk_matches_the_reference(offset, reader, tol):
    # keys 4-byte aligned: codes read as words; a pool starting at an odd byte: a byte per lane
    torch.manual_seed(4)
    B, S, HI, DI, N = 2, 3, 4, 32, 11
    shape = fp8.IndexerLayout(DI, 4).shape(B, N)
    keys = write_index_keys(poisoned((math.prod(shape) + offset,), DEVICE)[offset:].view(shape),
                            torch.randn(B, N, DI, device=DEVICE))
    q = fp8.rotate(torch.randn(B, S, HI, DI, device=DEVICE))
    w = torch.randn(B, S, HI, device=DEVICE)
    vis = torch.tensor([[0, 5, 11], [12, 1, 7]], dtype=torch.int32, device=DEVICE)  # 12: clamped to the pool
    want = ref.indexer_topk(q, w, keys, vis, 5)
    assert indexer.scores_launch(q, w, keys, vis)[1].meta["KEYS_FP8"] == reader
    got = indexer.indexer_topk(q, w, keys, vis, 5, out=torch.full_like(want, 77))
    assert torch.equal(got, want)
    scores = indexer.indexer_scores(q, w, keys, vis)
    # FP8 queries too (one power-of-two scale a head): the unquantised queries' scores differ
    want_scores = ref.indexer_scores(fp8.simulate_queries(q), w, fp8.read_keys(keys), vis)
    torch.testing.assert_close(scores, want_scores, **tol(torch.float32))
    assert not torch.allclose(ref.indexer_scores(q, w, fp8.read_keys(keys), vis), want_scores,
                              **tol("fp8_query_quantisation_is_seen"))


def test_fp8_indexer_bf16_queries_score_as_fp8_queries(tol):
    """bf16 queries over FP8 keys: on a GPU with FP8 MMA an e4m3 x e4m3 tensor-core dot (``FP8_DOT``),
    in the interpreter both sides decoded to bf16. Either way the scores are those of the quantised
    queries (``simulate_queries``) within the tensor cores' accumulation (sm_90 adds FP8 products with
    fewer bits than fp32), and the picks are a best-scoring set within that. V4's indexer widths."""
    torch.manual_seed(6)
    B, S, HI, DI, N, k = 2, 1, 64, 128, 256 if CUDA else 96, 16
    keys = write_index_keys(torch.empty(fp8.IndexerLayout(DI, 64).shape(B, N), dtype=torch.uint8, device=DEVICE),
                            torch.randn(B, N, DI, device=DEVICE))
    q = fp8.rotate(torch.randn(B, S, HI, DI, device=DEVICE)).to(torch.bfloat16)
    w = torch.randn(B, S, HI, device=DEVICE)
    vis = torch.tensor([[N], [N - 5]], dtype=torch.int32, device=DEVICE)
    fp8_mma = CUDA and torch.cuda.get_device_capability() >= (8, 9)
    assert indexer.scores_launch(q, w, keys, vis)[1].meta["FP8_DOT"] == int(fp8_mma)
    got = indexer.indexer_scores(q, w, keys, vis)
    want = ref.indexer_scores(fp8.simulate_queries(q), w, fp8.read_keys(keys), vis)
    live = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), live)
    span = want[live].abs().max()
    err = (got[live] - want[live]).abs().max() / span
    assert err < tol("fp8_e4m3_dot_scores")["rel"], f"scores off by {err:.2e} of their range"
    unquantised = ref.indexer_scores(q, w, fp8.read_keys(keys), vis)
    assert ((unquantised[live] - want[live]).abs().max() / span) > 10 * err  # the queries' quantisation is seen
    picks = indexer.indexer_topk(q, w, keys, vis, k)
    for b in range(B):
        row = want[b, 0]
        kth = row.sort(descending=True).values[k - 1]
        chosen = row[picks[b, 0].long()]
        within = (chosen >= kth - tol("fp8_e4m3_dot_scores")["rel"] * span).all()
        assert picks[b, 0].unique().numel() == k and within, (b, chosen, kth)


def test_fp8_queries_round_as_the_reference_code_for_code():
    """Each query value's e4m3 code, seen through the scores: key ``i`` is the unit vector ``e_i`` and
    only head 0 weighs, so ``score[i] = relu(q_0[i])`` as quantised, one product (exact on any
    tensor core) times two powers of two. Queries on rounding midpoints (ties to even), subnormal
    codes and a head whose amax sits on the scale's boundary; bf16 queries (the e4m3 dot on a GPU)."""
    HI, DI = 64, 128
    keys = torch.empty(fp8.IndexerLayout(DI, 64).shape(1, DI), dtype=torch.uint8, device=DEVICE)
    unit = torch.eye(DI, device=DEVICE)[None]
    write_index_keys(keys, fp8.rotate(unit))
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
    got = indexer.indexer_scores(q, w, keys, vis)
    want = ref.indexer_scores(fp8.simulate_queries(q), w, fp8.read_keys(keys), vis)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got[0, 0, :10].tolist() == [112.0, 32.0, 40.0, 2.0, 2.5, 0.0, 3 * 2.0**-11, 2.0**-10, 2.0**-9, 0.5]
