"""dsv4::indexer_topk against its meaning: the picked entries are a best-scoring visible set (float64
oracle), in descending score order, ties to the lower index, padded with -1; fp32 and bf16, decode
and wide shapes; the exact tie rule on integer inputs (many ties and ReLU zeros; all-equal scores
pick the lowest indices); edge cases: fewer visible entries than topk, visible = N, nothing
visible, an empty pool, topk above the pool, topk = 1, causal visibility across block boundaries."""
import pytest
import torch

import dsv4_ops
from indexer_topk_cases import I32, make_inputs


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
