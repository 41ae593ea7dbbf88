"""On an NVIDIA GPU, the indexer's top-k is the CUDA kernel (``csrc/kernels/topk_rows.cu``), the C++
op ``dsv4::topk_rows_cuda`` of dsv4_ops' native library, routed to by ``dsv4::indexer_topk``: its
picks equal the stable sort's (descending score, ties to the lower index, -1 past
``min(topk, visible)``) on rows with heavy ties, signed zeros, -inf scores, every register-row size
it is built for, rows whose candidates overflow its shared list and unaligned rows; bad input is a
ValueError naming the argument and the limit; it is what eager calls, compiled graphs and CUDA-graph
replays run, equal to the Triton top-k that runs with the route off."""
import re

import pytest
import torch
from torch.library import opcheck

import dsv4_ops
from dsv4_ops.ops import topk_cuda
from routes import triton_topk
from dsv4_ops.lowering.triton import indexer as ix

NVIDIA = torch.cuda.is_available() and torch.version.hip is None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not NVIDIA, reason="the CUDA top-k serves NVIDIA GPUs only")]
I32 = torch.int32
OP = "dsv4::topk_rows_cuda"


def topk_rows(scores, visible, topk):
    return torch.ops.dsv4.topk_rows_cuda(scores, visible, topk)


def stable_topk(scores, visible, topk):
    """The contract, by a stable sort: entries >= visible never picked."""
    B, S, N = scores.shape
    vis = visible.clamp(0, N).long()
    # + 0.0 turns -0.0 into +0.0: the contract compares them equal (a radix sort would not)
    masked = torch.where(torch.arange(N, device=scores.device) < vis[..., None], scores + 0.0,
                         torch.full_like(scores, float("-inf")))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :topk]
    rank = torch.arange(order.shape[-1], device=scores.device)
    picked = torch.where(rank < vis[..., None], order, -1)
    if picked.shape[-1] < topk:
        picked = torch.cat([picked, picked.new_full((B, S, topk - picked.shape[-1]), -1)], -1)
    return picked.to(I32)


def rows(B, S, N, kind, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(B, S, N, generator=g, device="cuda")
    if kind == "ties":  # few distinct values: the k-th score is shared by many entries
        x = torch.randint(-3, 4, (B, S, N), generator=g, device="cuda").float()
    elif kind == "zeros":  # relu-like: most scores exactly +0.0 or -0.0
        x = torch.where(x > 1.0, x, torch.zeros_like(x))
        x[..., ::3] = -0.0
    elif kind == "inf":
        x[..., ::5] = float("-inf")
        x[..., 7::11] = float("inf")
    elif kind == "rising":  # ascending scores: thread 0's maximum is the floor, nearly all of a row a candidate
        x = torch.randint(-50, 50, (B, S, N), generator=g, device="cuda").float().sort(-1).values
    elif kind == "grid64":  # Gaussian scores rounded to 1/64: ~16 copies of the 512th best of 8192
        x = (x * 64).round() / 64
    return x


def cuda_topk_calls(fn):
    """``fn()`` and how many times it called the op (the profiler records every dispatcher op, also
    those a Python op body calls)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, sum(1 for e in prof.events() if e.name == OP)


@pytest.fixture(scope="module", autouse=True)
def loaded():
    if not topk_cuda.available():
        pytest.fail(f"the native library is not loaded: {topk_cuda.unavailable_reason()}")


def test_the_limits_are_the_kernels():
    """The Python mirror of the kernel's limits (``topk_cuda.MAX_ENTRIES`` / ``MAX_TOPK``) is what
    the op accepts: the largest row and width run, one more is rejected."""
    x = rows(1, 1, topk_cuda.MAX_ENTRIES, "randn")
    visible = torch.full((1, 1), topk_cuda.MAX_ENTRIES, device="cuda", dtype=I32)
    got = topk_rows(x, visible, topk_cuda.MAX_TOPK)
    torch.testing.assert_close(got, stable_topk(x, visible, topk_cuda.MAX_TOPK), rtol=0, atol=0)
    with pytest.raises(ValueError, match=re.escape(f"in [1, {topk_cuda.MAX_ENTRIES}]")):
        topk_rows(rows(1, 1, topk_cuda.MAX_ENTRIES + 1, "randn"), visible, 8)
    with pytest.raises(ValueError, match=re.escape(f"in [1, {topk_cuda.MAX_TOPK}]")):
        topk_rows(x, visible, topk_cuda.MAX_TOPK + 1)


def test_topk_rows_cuda_opcheck():
    x = rows(2, 3, 3000, "ties", seed=9)
    opcheck(torch.ops.dsv4.topk_rows_cuda, (x, torch.tensor([[3000, 10, 0], [512, 2999, 7]], device="cuda",
                                                            dtype=I32), 512))


def test_topk_rows_cuda_fake_matches_real(fake_check):
    fake_check(torch.ops.dsv4.topk_rows_cuda, rows(2, 1, 8192, "randn"),
               torch.full((2, 1), 8192, device="cuda", dtype=I32), 512)


@pytest.mark.parametrize("kind", ["randn", "ties", "zeros", "inf", "rising", "grid64"])
@pytest.mark.parametrize("N", [1, 100, 2048, 2049, 4096, 8192, 8258, 16384, 16387, 32768])
def test_topk_rows_cuda_matches_reference(N, kind):
    """Every register-row size (4 .. 64 scores a thread, and the sizes just past each), random
    visible lengths (all, none, fewer than topk)."""
    B, S, topk = 3, 2, 512
    x = rows(B, S, N, kind, seed=N)
    g = torch.Generator(device="cuda").manual_seed(1)
    visible = torch.randint(0, N + 1, (B, S), generator=g, device="cuda", dtype=I32)
    visible[0, 0], visible[0, 1], visible[1, 0] = N, 0, min(N, 511)  # whole row, none, fewer than topk
    torch.testing.assert_close(topk_rows(x, visible, topk), stable_topk(x, visible, topk), rtol=0, atol=0)


def test_rows_whose_candidates_overflow_the_shared_list_read_them_from_the_row():
    """Rows of more than 8192 scores put up to 8192 candidates (entries at or above the floor) in a
    shared list, which the select and the compaction then read; a row with more reads them from the
    row again. Random rows of 32768 scores take the list, rising rows (all but thread 0's entries
    candidates) the row; both pick as the stable sort."""
    N = 32768
    x = torch.cat([rows(1, 2, N, "randn", seed=3), rows(1, 2, N, "rising", seed=4)])
    visible = torch.full((2, 2), N, device="cuda", dtype=I32)
    visible[1, 1] = 9000  # just past the list's capacity
    torch.testing.assert_close(topk_rows(x, visible, 512), stable_topk(x, visible, 512), rtol=0, atol=0)


@pytest.mark.parametrize("N", [8192, 16384, 32768])
@pytest.mark.parametrize("kind", ["randn", "ties", "rising"])
def test_aligned_and_unaligned_rows_pick_alike(N, kind):
    """Aligned rows of more than 8192 scores load by bulk copies, others (one float past 16 bytes)
    by plain loads; both give the stable sort's picks."""
    x = rows(2, 2, N + 4, kind, seed=N)
    visible = torch.tensor([[N, N - 3], [511, N // 2]], device="cuda", dtype=I32)
    for view in (x[..., :N], x[..., 1:N + 1]):  # 16-byte aligned rows, and rows one float past
        torch.testing.assert_close(topk_rows(view, visible, 512), stable_topk(view, visible, 512), rtol=0, atol=0)


@pytest.mark.parametrize("N", [2048, 4096, 8192, 8196])
def test_entries_past_visible_are_never_picked_though_the_kernel_reads_them(N):
    """Rows of at most 8192 scores load whole, before their visible length arrives (so that the loads
    need not wait for it), and every later stage must drop the entries at or past ``visible``. Here
    those entries are the row's best by far (+inf, 1e30): one picked, or counted into the select's
    histograms, would change the picks. ``visible`` cuts through a thread's entries (not a multiple of
    its 4 to 16), leaves fewer live entries than ``topk``, and none."""
    x = rows(2, 3, N, "randn", seed=N)
    visible = torch.tensor([[N - 5, N // 2 + 3, 300], [1, 0, N]], device="cuda", dtype=I32)
    dead = torch.arange(N, device="cuda") >= visible[..., None]
    x = torch.where(dead, torch.where(torch.arange(N, device="cuda") % 2 == 0, float("inf"), 1e30), x)
    got = topk_rows(x, visible, 512)
    torch.testing.assert_close(got, stable_topk(x, visible, 512), rtol=0, atol=0)
    assert (got < visible[..., None]).all()  # -1 included


@pytest.mark.parametrize("N", [4096, 8192, 32768])
@pytest.mark.parametrize("topk", [100, 512, 1024, 2048])
@pytest.mark.parametrize("kind", ["randn", "grid64", "ties"])
def test_both_sorts_order_as_the_stable_sort(N, topk, kind):
    """Up to 1024 picks are ordered by buckets of their keys (each pick placed by the picks of its
    bucket better than it) unless a bucket is crowded; then, and past 1024 picks, by the bitonic
    sort. Random rows take the buckets, also with ~15 equal scores at the k-th best (grid64: equal
    keys in one bucket, told apart by index); long rows of 7 distinct scores and 2048 picks the
    bitonic sort. Every order is the stable sort's."""
    x = rows(2, 2, N, kind, seed=topk + N)
    visible = torch.tensor([[N, N - 3], [N // 2, topk // 2]], device="cuda", dtype=I32)
    torch.testing.assert_close(topk_rows(x, visible, topk), stable_topk(x, visible, topk), rtol=0, atol=0)


@pytest.mark.parametrize("topk", [1, 2, 100, 512, 1024, 2048])
def test_topk_rows_cuda_edge_cases(topk):
    """Every output width the sort serves (one pick a thread up to four), ties throughout."""
    x = rows(2, 3, 8192, "ties", seed=topk)
    visible = torch.tensor([[8192, 3000, 1], [topk, topk - 1 if topk > 1 else 0, 8192]], device="cuda", dtype=I32)
    torch.testing.assert_close(topk_rows(x, visible, topk), stable_topk(x, visible, topk), rtol=0, atol=0)


def test_topk_rows_cuda_edge_case_strided_views_and_out_of_range_visible():
    """A row-sliced view (offset base: the scalar load path), a strided ``visible`` with values
    outside [0, N] (clamped), and no rows at all."""
    base = rows(2, 4, 4099, "randn", seed=5)
    x = base[:, 1:, 3:]  # [2, 3, 4096], rows not 16-byte aligned
    visible = torch.tensor([[-5, 0, 4096, 0, 9999, 0], [17, 0, 2000, 0, 4096, 0]], device="cuda", dtype=I32)[:, ::2]
    got = topk_rows(x, visible, 512)
    assert got.shape == (2, 3, 512) and got.dtype == I32 and got.is_contiguous()
    torch.testing.assert_close(got, stable_topk(x, visible, 512), rtol=0, atol=0)
    empty = topk_rows(x[:, :0], visible[:, :0], 512)
    assert empty.shape == (2, 0, 512) and empty.dtype == I32


@pytest.mark.parametrize("change, message", [
    (lambda x, v, k: (torch.randn(1, 1, 32769, device="cuda"), v[:1, :1], k),
     "topk_rows_cuda: scores' last dim N (got 32769) must be in [1, 32768]"),
    (lambda x, v, k: (x, v, 2049), "topk_rows_cuda: topk (got 2049) must be in [1, 2048]"),
    (lambda x, v, k: (x, v, 0), "topk_rows_cuda: topk (got 0) must be in [1, 2048]"),
    (lambda x, v, k: (x.half(), v, k), "topk_rows_cuda: scores must be float32"),
    (lambda x, v, k: (x[0], v, k), "topk_rows_cuda: scores must be [B, S, N]"),
    (lambda x, v, k: (x.transpose(1, 2), v, k), "topk_rows_cuda: scores must have a contiguous last dim"),
    (lambda x, v, k: (x, v.long(), k), "topk_rows_cuda: visible must be int32"),
    (lambda x, v, k: (x, v[:, :2], k), "topk_rows_cuda: visible must be [B, S] = [2, 3] of scores"),
    (lambda x, v, k: (x, v.cpu(), k), "topk_rows_cuda: visible must be on scores' device"),
])
def test_topk_rows_cuda_rejects_bad_input(change, message):
    """Outside what the kernel serves: a ValueError naming the argument and the limit (the op's
    TORCH_CHECK_VALUE), never a launch (the public op never routes such inputs here)."""
    x = rows(2, 3, 64, "randn")
    v = torch.full((2, 3), 64, device="cuda", dtype=I32)
    with pytest.raises(ValueError, match=re.escape(message)):
        topk_rows(*change(x, v, 8))


def indexer_inputs(B, N, seed=0, DI=128, HI=64):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, 1, HI, DI, generator=g, device="cuda").bfloat16()
    w = torch.randn(B, 1, HI, generator=g, device="cuda")
    keys = torch.randn(B, N, DI, generator=g, device="cuda").bfloat16()
    visible = torch.randint(N // 2, N + 1, (B, 1), generator=g, device="cuda", dtype=I32)
    return q, w, keys, visible


def test_indexer_topk_routes_here_and_equals_the_triton_topk():
    q, w, keys, visible = indexer_inputs(4, 8258)
    got, calls = cuda_topk_calls(lambda: dsv4_ops.indexer_topk(q, w, keys, visible, 512))
    assert calls == 1
    with triton_topk():
        want, calls = cuda_topk_calls(lambda: dsv4_ops.indexer_topk(q, w, keys, visible, 512))
    assert calls == 0
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    scores = ix.indexer_scores(q, w, keys, visible)
    torch.testing.assert_close(got, stable_topk(scores, visible, 512), rtol=0, atol=0)


def test_compiled_and_graphed_equal_eager():
    """The compiled graph calls the op (an extern kernel: C++ that Inductor cannot inline), and a
    CUDA graph of it replays its launch on new inputs."""
    from torch._inductor.utils import run_and_get_code

    q, w, keys, visible = indexer_inputs(2, 4100, seed=3)
    eager = dsv4_ops.indexer_topk(q, w, keys, visible, 512)
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: torch.ops.dsv4.indexer_topk(*a, 512), fullgraph=True)
    with torch._inductor.config.patch(force_disable_caches=True):  # (a cache hit would generate no code)
        got, codes = run_and_get_code(fn, q, w, keys, visible)
    torch.testing.assert_close(got, eager, rtol=0, atol=0)
    assert "torch.ops.dsv4.topk_rows_cuda" in "\n".join(codes), "the compiled graph does not call the CUDA top-k"
    static = [t.clone() for t in (q, w, keys, visible)]
    fn(*static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static)
    q2, w2, keys2, visible2 = indexer_inputs(2, 4100, seed=4)
    for dst, src in zip(static, (q2, w2, keys2, visible2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, dsv4_ops.indexer_topk(q2, w2, keys2, visible2, 512), rtol=0, atol=0)


def test_rows_it_does_not_serve_keep_the_triton_topk():
    """Rows past the CUDA kernel's 32768 scores keep the Triton top-k; one row of 20000 or 32768 scores
    takes the CUDA one (``topk_cuda.serves``), and both equal the stable sort."""
    assert not topk_cuda.applies((1, 1, 32769), torch.device("cuda"), 512)
    assert topk_cuda.applies((1, 1, 32768), torch.device("cuda"), 512)
    assert topk_cuda.applies((64, 1, 32768), torch.device("cuda"), 512)
    for N, routed in ((32800, False), (20000, True), (32768, True)):
        q, w, keys, visible = indexer_inputs(1, N, seed=6)
        got, calls = cuda_topk_calls(lambda: dsv4_ops.indexer_topk(q, w, keys, visible, 512))
        assert calls == int(routed), N
        torch.testing.assert_close(got, stable_topk(ix.indexer_scores(q, w, keys, visible), visible, 512),
                                   rtol=0, atol=0)
