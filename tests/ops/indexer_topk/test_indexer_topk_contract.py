"""dsv4::indexer_topk as an op: opcheck on a basic call, one query, an empty pool, topk above the
pool and nothing visible; the fake matches the real op; the public wrapper refuses bad dtypes,
widths, ranks, topk < 1, devices and visible lengths out of range, naming the argument and the
limit; the raw op reads visible as clamped to [0, N]."""
import pytest
import torch
from torch.library import opcheck

import dsv4_ops
from indexer_topk_cases import I32, OPCHECK_CASES, make_inputs


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_indexer_topk_opcheck(case):
    opcheck(torch.ops.dsv4.indexer_topk.default, make_inputs(**OPCHECK_CASES[case]))


@pytest.mark.parametrize("case", ["basic", "empty_pool", "k_above_pool"])
def test_indexer_topk_fake_matches_real(fake_check, case):
    fake_check(torch.ops.dsv4.indexer_topk.default, *make_inputs(**OPCHECK_CASES[case]))


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
