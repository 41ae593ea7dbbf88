"""dsv4::sinkhorn as an op: opcheck on decode, a prefill chunk, one iteration and hc_mult = 2; the
fake matches the real op (an fp32, contiguous result); the public wrapper refuses a comb that is not
[..., N, N] or not floating point, and iters < 1, naming them."""
import pytest
import torch
from torch.library import opcheck

import dsv4_ops
from sinkhorn_cases import OPCHECK_CASES, make_comb


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_sinkhorn_opcheck(case):
    lead, iters = OPCHECK_CASES[case]
    N = 2 if case == "hc2" else 4
    opcheck(torch.ops.dsv4.sinkhorn.default, (make_comb(*lead, N=N), iters, 1e-6))


def test_sinkhorn_fake_matches_real(fake_check):
    for lead, iters in OPCHECK_CASES.values():
        out = fake_check(torch.ops.dsv4.sinkhorn.default, make_comb(*lead), iters, 1e-6)
        assert out.dtype == torch.float32 and out.is_contiguous()


def test_sinkhorn_rejects_bad_input():
    with pytest.raises(ValueError, match=r"sinkhorn: comb must be \[\.\.\., N, N\]"):
        dsv4_ops.ops.sinkhorn(torch.rand(2, 4, 3), 20, 1e-6)
    with pytest.raises(ValueError, match=r"sinkhorn: comb must be \[\.\.\., N, N\]"):
        dsv4_ops.ops.sinkhorn(torch.rand(4), 20, 1e-6)
    with pytest.raises(ValueError, match="sinkhorn: comb must be a floating-point tensor"):
        dsv4_ops.ops.sinkhorn(torch.ones(2, 4, 4, dtype=torch.int32), 20, 1e-6)
    with pytest.raises(ValueError, match="sinkhorn: iters must be >= 1, got 0"):
        dsv4_ops.ops.sinkhorn(make_comb(2), 0, 1e-6)
