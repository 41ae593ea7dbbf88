"""dsv4::gemv as an op: opcheck at a batch-1 decode token, a grouped projection and eight tokens; the
fake matches the real op in fp32 and bf16 (the input's dtype, contiguous); the public wrapper refuses
bad ranks, widths, group counts, dtypes naming the argument."""
import pytest
import torch
from torch.library import opcheck

import dsv4_ops
from gemv_cases import OPCHECK_CASES, make_case


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_gemv_opcheck(case):
    opcheck(torch.ops.dsv4.gemv.default, make_case(*OPCHECK_CASES[case]))


def test_gemv_fake_matches_real(fake_check):
    for case in OPCHECK_CASES.values():
        for dtype in (torch.float32, torch.bfloat16):
            out = fake_check(torch.ops.dsv4.gemv.default, *make_case(*case, dtype=dtype))
            assert out.dtype == dtype and out.is_contiguous()


def test_gemv_rejects_bad_input():
    x, w = make_case(2, 2, 8, 16)
    with pytest.raises(ValueError, match=r"gemv: x must have rank 3 \[T, G, K\]"):
        dsv4_ops.ops.gemv(x[0], w)
    with pytest.raises(ValueError, match=r"gemv: weight.shape\[2\] must be 16 \(K of x\), got 15"):
        dsv4_ops.ops.gemv(x, w[..., :15])
    with pytest.raises(ValueError, match=r"gemv: weight.shape\[0\] must be 2 \(G of x\), got 1"):
        dsv4_ops.ops.gemv(x, w[:1])
    with pytest.raises(ValueError, match="gemv: weight must have the dtype of x"):
        dsv4_ops.ops.gemv(x, w.bfloat16())
    with pytest.raises(ValueError, match="gemv: x must be a floating-point tensor"):
        dsv4_ops.ops.gemv(x.int(), w.int())
