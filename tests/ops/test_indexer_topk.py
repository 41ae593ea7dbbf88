"""dsv4::indexer_topk: the picked entries are a best-scoring visible set (float64 oracle), in
descending score order, ties to the lower index, padded with -1."""
import pytest
import torch
from torch.library import opcheck

import dsv4_ops

I32 = torch.int32


def make_inputs(B=2, S=3, HI=4, DI=8, N=10, topk=4, dtype=torch.float32, device="cpu", visible=None):
    q = torch.randn(B, S, HI, DI, device=device).to(dtype)
    weights = torch.randn(B, S, HI, device=device).to(dtype)
    keys = torch.randn(B, N, DI, device=device).to(dtype)
    if visible is None:
        visible = torch.randint(0, N + 1, (B, S), dtype=I32, device=device)
    return [q, weights, keys, visible, topk]


def oracle_scores(q, weights, keys, b, s, n):
    """float64 scores of entries 0..n-1 for query (b, s), one entry at a time."""
    qs, w = q[b, s].cpu().double(), weights[b, s].cpu().double()
    return [float((w * (qs @ keys[b, i].cpu().double()).relu()).sum()) for i in range(n)]


def check_valid_topk(out, q, weights, keys, visible, topk, atol):
    """Tie-aware: the picks are distinct visible entries whose scores are the top multiset."""
    B, S = visible.shape
    assert out.shape == (B, S, topk) and out.dtype == I32 and out.is_contiguous()
    for b in range(B):
        for s in range(S):
            vis = int(visible[b, s])
            n = min(topk, vis)
            row = out[b, s].tolist()
            assert row[n:] == [-1] * (topk - n), f"({b},{s}): slots past min(topk, visible)={n} must be -1: {row}"
            picked = row[:n]
            assert len(set(picked)) == n and all(0 <= i < vis for i in picked), f"({b},{s}): bad picks {row}"
            scores = oracle_scores(q, weights, keys, b, s, vis)
            got = [scores[i] for i in picked]
            best = sorted(scores, reverse=True)[:n]
            torch.testing.assert_close(torch.tensor(got), torch.tensor(best), atol=atol, rtol=0)
            # descending order (within rounding)
            assert all(got[j] >= got[j + 1] - atol for j in range(n - 1)), f"({b},{s}): not descending {got}"


def oracle_exact(q, weights, keys, visible, topk):
    """Exact tie rule (for inputs whose scores are exact in fp32): sort by (-score, index)."""
    B, S = visible.shape
    out = torch.full((B, S, topk), -1, dtype=I32)
    for b in range(B):
        for s in range(S):
            scores = oracle_scores(q, weights, keys, b, s, int(visible[b, s]))
            order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:topk]
            out[b, s, : len(order)] = torch.tensor(order, dtype=I32)
    return out


OPCHECK_CASES = {
    "basic": dict(),
    "one_query": dict(B=1, S=1),
    "empty_pool": dict(N=0, visible=torch.zeros(2, 3, dtype=I32)),
    "k_above_pool": dict(N=3, topk=8),
    "nothing_visible_all_-1": dict(visible=torch.zeros(2, 3, dtype=I32)),
}


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_indexer_topk_opcheck(case):
    opcheck(torch.ops.dsv4.indexer_topk.default, make_inputs(**OPCHECK_CASES[case]))


@pytest.mark.parametrize("case", ["basic", "empty_pool", "k_above_pool"])
def test_indexer_topk_fake_matches_real(fake_check, case):
    fake_check(torch.ops.dsv4.indexer_topk.default, *make_inputs(**OPCHECK_CASES[case]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "shape", [dict(), dict(B=1, S=1, N=40, topk=8), dict(B=3, S=4, HI=8, DI=16, N=33, topk=5)],
    ids=["basic", "decode", "wide"],
)
def test_indexer_topk_matches_reference(device, dtype, shape, tol):
    args = make_inputs(dtype=dtype, device=device, **shape)
    out = dsv4_ops.indexer_topk(*args)
    # the op accumulates in fp32 whatever the input dtype; the oracle is float64 on the same inputs
    check_valid_topk(out.cpu(), *args, atol=tol(torch.float32)["atol"] * 10)


def test_indexer_topk_tie_rule(device):
    # integer inputs: every score is an exact small integer in fp32, with many ties and many
    # exact zeros from the ReLUs; the documented order is (score desc, index asc)
    B, S, HI, DI, N, k = 2, 4, 3, 4, 24, 9
    q = torch.randint(-1, 2, (B, S, HI, DI), device=device).float()
    keys = torch.randint(-1, 2, (B, N, DI), device=device).float()
    weights = torch.randint(1, 3, (B, S, HI), device=device).float()
    visible = torch.tensor([[24, 13, 9, 3], [0, 24, 20, 1]], dtype=I32, device=device)
    out = dsv4_ops.indexer_topk(q, weights, keys, visible, k)
    expected = oracle_exact(q, weights, keys, visible, k)
    assert torch.equal(out.cpu(), expected)
    # all-equal scores: the lowest indices win, in index order
    out = dsv4_ops.indexer_topk(q, weights, torch.zeros_like(keys), visible, k)
    for b in range(B):
        for s in range(S):
            n = min(k, int(visible[b, s]))
            assert out[b, s].tolist() == list(range(n)) + [-1] * (k - n)


def test_indexer_topk_edge_cases(device, tol):
    atol = tol(torch.float32)["atol"] * 10

    def run(**kw):
        args = make_inputs(device=device, **kw)
        out = dsv4_ops.indexer_topk(*args)
        check_valid_topk(out.cpu(), *args, atol=atol)
        return out

    # fewer legal entries than k (visible 0..3 < k = 6), and visible = N exactly
    run(N=12, topk=6, visible=torch.tensor([[0, 1, 3], [5, 12, 12]], dtype=I32, device=device))
    # nothing visible: all -1
    out = run(visible=torch.zeros(2, 3, dtype=I32, device=device))
    assert (out == -1).all()
    # empty pool (N = 0)
    out = run(N=0, topk=3, visible=torch.zeros(2, 3, dtype=I32, device=device))
    assert out.shape == (2, 3, 3) and (out == -1).all()
    # k larger than the pool; k = 1
    run(N=3, topk=8)
    run(N=7, topk=1)
    # causal visibility (t+1)//4 over positions 0..128 at ratio 4, crossing block boundaries
    t = torch.tensor([[0, 2, 3, 4, 5, 126, 127, 128]], dtype=I32, device=device)
    run(B=1, S=8, N=32, topk=4, visible=(t + 1) // 4)


def test_indexer_topk_rejects_bad_input():
    def bad(i, value, match):
        args = make_inputs()
        args[i] = value(args)
        with pytest.raises(ValueError, match=match):
            dsv4_ops.indexer_topk(*args)

    bad(3, lambda a: a[3].long(), r"indexer_topk: visible must be torch.int32, got torch.int64")
    bad(2, lambda a: a[2].bfloat16(), r"keys must have the dtype of q \(torch.float32\), got torch.bfloat16")
    bad(1, lambda a: a[1].int(), r"weights must be a floating-point tensor, got torch.int32")
    bad(2, lambda a: torch.randn(2, 10, 9), r"keys.shape\[2\] must be 8 \(DI of q\), got 9")
    bad(1, lambda a: torch.randn(2, 3, 5), r"weights.shape\[2\] must be 4 \(HI of q\), got 5")
    bad(0, lambda a: a[0][..., 0], r"q must have rank 4")
    bad(4, lambda a: 0, r"topk must be >= 1, got 0")
    bad(2, lambda a: a[2].to("meta"), r"all tensors must be on one device: q is on cpu, keys is on meta")
    bad(3, lambda a: a[3].fill_(11), r"visible\[0, 0\] = 11 is beyond keys entries N=10")
    bad(3, lambda a: a[3].fill_(-1), r"visible\[0, 0\] = -1 is below the minimum 0")


def test_indexer_topk_raw_op_clamps_visible(device):
    """The raw op (no wrapper checks) reads visible as clamped to [0, N], on every backend."""
    q, w, keys, _, topk = make_inputs(B=2, S=2, N=10, topk=4, device=device)
    visible = torch.tensor([[-3, 11], [2**31 - 1, 4]], dtype=I32, device=device)
    got = torch.ops.dsv4.indexer_topk(q, w, keys, visible, topk)
    assert torch.equal(got, torch.ops.dsv4.indexer_topk(q, w, keys, visible.clamp(0, 10), topk))
