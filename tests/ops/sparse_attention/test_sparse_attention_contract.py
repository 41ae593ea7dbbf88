"""dsv4::sparse_attention as an op: opcheck on a basic call, one query, an empty pool (no picks, or
picks all -1), no picks with a dense prefix, all sentinels; the fake matches the real op in fp32
and bf16 (a contiguous output for a non-contiguous q too); the public wrapper refuses bad dtypes,
ranks, widths, devices and indices out of range, naming the argument and the limit; the raw op
reads indices outside the rows like -1 and clamps cmp_len to [0, Nc]."""
import pytest
import torch
from torch.library import opcheck

import dsv4_ops
from sparse_attention_cases import OPCHECK_CASES, make_inputs


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
