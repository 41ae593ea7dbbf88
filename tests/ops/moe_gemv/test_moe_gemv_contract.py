"""dsv4::moe_gemv as an op: opcheck at a batch-1 decode token's top-6, three tokens' top-2 and top-1;
the fake matches the real op (an fp32, contiguous result); the public wrapper refuses bad ranks,
expert ids out of range, dtypes, widths, weights of another shape and float indices, naming them."""
import pytest
import torch
from torch.library import opcheck

import dsv4_ops
from moe_gemv_cases import LIMIT, OPCHECK_CASES, make_case


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_moe_gemv_opcheck(case):
    opcheck(torch.ops.dsv4.moe_gemv.default, (*make_case(*OPCHECK_CASES[case]), LIMIT))


def test_moe_gemv_fake_matches_real(fake_check):
    for case in OPCHECK_CASES.values():
        out = fake_check(torch.ops.dsv4.moe_gemv.default, *make_case(*case), LIMIT)
        assert out.dtype == torch.float32 and out.is_contiguous()


def test_moe_gemv_rejects_bad_input():
    x, idx, w, w13, w2 = make_case(2, 2, 4, 32, 16)
    with pytest.raises(ValueError, match=r"moe_gemv: x must have rank 2 \[T, D\]"):
        dsv4_ops.ops.moe_gemv(x[None], idx, w, w13, w2, LIMIT)
    with pytest.raises(ValueError, match=r"moe_gemv: indices\[1, 0\] = 4 is beyond the experts E=4"):
        dsv4_ops.ops.moe_gemv(x, torch.tensor([[0, 1], [4, 2]]), w, w13, w2, LIMIT)
    with pytest.raises(ValueError, match=r"moe_gemv: indices\[0, 1\] = -1 is below the minimum 0"):
        dsv4_ops.ops.moe_gemv(x, torch.tensor([[0, -1], [3, 2]]), w, w13, w2, LIMIT)
    with pytest.raises(ValueError, match="moe_gemv: w13 must have the dtype of x"):
        dsv4_ops.ops.moe_gemv(x, idx, w, w13.bfloat16(), w2, LIMIT)
    with pytest.raises(ValueError, match=r"moe_gemv: w13.shape\[1\] must be 32 \(2 \* I, I from w2\)"):
        dsv4_ops.ops.moe_gemv(x, idx, w, w13[:, :30], w2, LIMIT)
    with pytest.raises(ValueError, match="moe_gemv: weights must have the shape of indices"):
        dsv4_ops.ops.moe_gemv(x, idx, w[:, :1], w13, w2, LIMIT)
    with pytest.raises(ValueError, match="moe_gemv: indices must be int32 or int64"):
        dsv4_ops.ops.moe_gemv(x, idx.float(), w, w13, w2, LIMIT)
