"""dsv4::sparse_attention against its meaning: one softmax over window rows, picked and dense-prefix
compressed entries and a per-head sink, checked against a per-query float64 loop; fp32 and bf16,
decode, wide, HCA (no picks) and single-entry shapes; edge cases: a query with no entries gets exact
zeros, an empty compressed pool, a dense prefix covering the pool, a single window row, large logits
(the softmax stays finite)."""
import pytest
import torch

import dsv4_ops
from sparse_attention_cases import make_inputs


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
