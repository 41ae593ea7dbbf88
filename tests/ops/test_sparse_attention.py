"""dsv4::sparse_attention: one softmax over window rows, picked and dense-prefix compressed
entries and a per-head sink, checked against a per-query float64 loop."""
import pytest
import torch
from torch.library import opcheck

import dsv4_ops

I32 = torch.int32


def make_inputs(B=2, S=3, H=4, D=16, N=10, W=4, Nc=6, K=3, dtype=torch.float32, device="cpu"):
    """Random inputs with every index kind: real rows, -1 sentinels, a dense prefix."""
    q = torch.randn(B, S, H, D, device=device).to(dtype)
    kv = torch.randn(B, N, D, device=device).to(dtype)
    cmp = torch.randn(B, Nc, D, device=device).to(dtype)
    kv_idx = torch.randint(-1, max(N, 0), (B, S, W), dtype=I32, device=device) if N else \
        torch.full((B, S, W), -1, dtype=I32, device=device)
    cmp_idx = torch.randint(-1, Nc, (B, S, K), dtype=I32, device=device) if Nc else \
        torch.full((B, S, K), -1, dtype=I32, device=device)
    cmp_len = torch.randint(0, Nc + 1, (B, S), dtype=I32, device=device)
    sink = torch.randn(H, device=device)
    return [q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, D**-0.5]


def oracle(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale):
    """Per (b, s): list the entries, then exp-normalise against the sink in float64."""
    B, S, H, D = q.shape
    out = torch.zeros(B, S, H, D, dtype=torch.float64)
    q, kv, cmp, sink = q.cpu().double(), kv.cpu().double(), cmp.cpu().double(), sink.cpu().double()
    for b in range(B):
        for s in range(S):
            ents = [kv[b, i] for i in kv_idx[b, s].tolist() if i >= 0]
            ents += [cmp[b, i] for i in cmp_idx[b, s].tolist() if i >= 0]
            ents += [cmp[b, i] for i in range(int(cmp_len[b, s]))]
            if not ents:
                continue  # only the sink, whose value is zero
            e = torch.stack(ents)  # [L, D]
            logits = scale * q[b, s] @ e.T  # [H, L]
            top = torch.maximum(logits.max(-1).values, sink)
            w = torch.exp(logits - top[:, None])
            out[b, s] = (w @ e) / (w.sum(-1) + torch.exp(sink - top))[:, None]
    return out


def check(args, tol):
    out = dsv4_ops.sparse_attention(*args)
    q = args[0]
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    torch.testing.assert_close(out.cpu().double(), oracle(*args), **tol(q.dtype))
    return out


OPCHECK_CASES = {
    "basic": dict(),
    "one_query": dict(B=1, S=1),
    "empty_pool": dict(Nc=0, K=0),
    "empty_pool_picks_all_-1": dict(Nc=0, K=3),
    "no_picks_dense_prefix": dict(K=0),
}


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_sparse_attention_opcheck(case):
    opcheck(torch.ops.dsv4.sparse_attention.default, make_inputs(**OPCHECK_CASES[case]))


def test_sparse_attention_opcheck_all_sentinels():
    args = make_inputs()
    args[2].fill_(-1)
    args[4].fill_(-1)
    args[5].zero_()
    opcheck(torch.ops.dsv4.sparse_attention.default, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sparse_attention_fake_matches_real(fake_check, dtype):
    args = make_inputs(dtype=dtype)
    fake_check(torch.ops.dsv4.sparse_attention.default, *args)
    # non-contiguous q: the output is still contiguous, in the fake as in the real op
    args[0] = torch.randn(2, 4, 3, 16).to(dtype).transpose(1, 2)
    fake_check(torch.ops.dsv4.sparse_attention.default, *args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "shape",
    [dict(), dict(B=1, S=1, W=8), dict(B=3, S=5, H=2, D=32, N=20, W=6, Nc=12, K=5), dict(K=0), dict(W=1, K=1)],
    ids=["basic", "decode", "wide", "hca", "single"],
)
def test_sparse_attention_matches_reference(device, dtype, shape, tol):
    check(make_inputs(dtype=dtype, device=device, **shape), tol)


def test_sparse_attention_edge_cases(device, tol):
    # a query with no entries at all gets exact zeros; others in the same batch are unaffected
    args = make_inputs(device=device)
    args[2][0, 1] = -1
    args[4][0, 1] = -1
    args[5][0, 1] = 0
    out = check(args, tol)
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1]))
    # empty compressed pool: picks all -1 (K > 0) and K = 0
    check(make_inputs(Nc=0, K=4, device=device), tol)
    check(make_inputs(Nc=0, K=0, device=device), tol)
    # dense prefix covering the whole pool, and single-row window source
    args = make_inputs(N=1, device=device)
    args[5].fill_(args[3].shape[1])
    check(args, tol)
    # large logits: the softmax must stay finite and exact (max-subtraction)
    args = make_inputs(device=device)
    args[-1] = 10.0
    args[6] = args[6] * 30
    out = check(args, tol)
    assert torch.isfinite(out).all()


def test_sparse_attention_rejects_bad_input():
    f = dsv4_ops.sparse_attention

    def bad(i, value, match, exc=ValueError):
        args = make_inputs()
        args[i] = value(args) if callable(value) else value
        with pytest.raises(exc, match=match):
            f(*args)

    bad(2, lambda a: a[2].long(), r"sparse_attention: kv_idx must be torch.int32, got torch.int64")
    bad(4, lambda a: a[4].long(), r"cmp_idx must be torch.int32")
    bad(5, lambda a: a[5].long(), r"cmp_len must be torch.int32")
    bad(6, lambda a: a[6].bfloat16(), r"sink must be torch.float32, got torch.bfloat16")
    bad(1, lambda a: a[1].bfloat16(), r"kv must have the dtype of q \(torch.float32\), got torch.bfloat16")
    bad(0, lambda a: a[0].int(), r"q must be a floating-point tensor")
    bad(0, lambda a: a[0][0], r"q must have rank 4 \[B, S, H, D\], got shape \(3, 4, 16\)")
    bad(3, lambda a: torch.randn(2, 6, 17), r"cmp.shape\[2\] must be 16 \(D of q\), got 17")
    bad(2, lambda a: a[2][:, :2], r"kv_idx.shape\[1\] must be 3 \(S of q\), got 2")
    bad(6, lambda a: torch.randn(5), r"sink.shape\[0\] must be 4 \(H of q\), got 5")
    bad(1, lambda a: a[1].to("meta"), r"all tensors must be on one device: q is on cpu, kv is on meta")
    bad(2, lambda a: a[2].index_fill(2, torch.tensor([1]), 10),
        r"kv_idx\[0, 0, 1\] = 10 is beyond kv rows N=10 \(valid: -1 or 0..9\)")
    bad(2, lambda a: a[2].index_fill(2, torch.tensor([0]), -2), r"kv_idx\[0, 0, 0\] = -2 is below the minimum -1")
    bad(4, lambda a: a[4].index_fill(2, torch.tensor([2]), 6), r"cmp_idx\[0, 0, 2\] = 6 is beyond cmp entries N=6")
    bad(5, lambda a: a[5].fill_(7), r"cmp_len\[0, 0\] = 7 is beyond cmp entries Nc=6")


def test_sparse_attention_raw_op_skips_out_of_range_indices(device):
    """The raw op (no wrapper checks) reads indices outside the rows like -1 and clamps
    cmp_len to [0, Nc], on every backend: the same result as with those values replaced."""
    args = make_inputs(device=device)
    clean = list(args)
    args[2], args[4], args[5] = args[2].clone(), args[4].clone(), args[5].clone()
    clean[2], clean[4], clean[5] = args[2].clone(), args[4].clone(), args[5].clone()
    args[2][0, 0, :3] = torch.tensor([10, 2**31 - 1, -7])  # N = 10
    clean[2][0, 0, :3] = -1
    args[4][1, 2, :2] = torch.tensor([6, -3])  # Nc = 6
    clean[4][1, 2, :2] = -1
    args[5][0, 1], args[5][1, 0] = 99, -5
    clean[5][0, 1], clean[5][1, 0] = 6, 0
    got = torch.ops.dsv4.sparse_attention(*args)
    torch.testing.assert_close(got, torch.ops.dsv4.sparse_attention(*clean), rtol=0, atol=0)
    # an empty window source: every index is out of range
    args = make_inputs(N=0, device=device)
    args[2] = torch.zeros_like(args[2])
    clean = list(args)
    clean[2] = torch.full_like(args[2], -1)
    torch.testing.assert_close(torch.ops.dsv4.sparse_attention(*args), torch.ops.dsv4.sparse_attention(*clean),
                               rtol=0, atol=0)
