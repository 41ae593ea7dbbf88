"""dsv4::plan as an op: opcheck on decode, verify (with a padding row), concat prefill and MTP
steps; the fake's sizes, strides and dtypes equal the real outputs'; the public wrapper refuses bad
input naming the argument and the limit; the raw op counts negative lengths as zero."""
import pytest
import torch
from torch.library import opcheck

import dsv4_ops
from plan_cases import FIELDS, I32, OPCHECK_CASES, args_of, cfg


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_plan_opcheck(case):
    opcheck(torch.ops.dsv4.plan.default, args_of(*OPCHECK_CASES[case]))


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_plan_fake_matches_real(fake_check, case):
    fake_check(torch.ops.dsv4.plan.default, *args_of(*OPCHECK_CASES[case]))


def test_plan_rejects_bad_input():
    L = torch.tensor([0, 5], dtype=I32)
    n = torch.tensor([1, 1], dtype=I32)

    def bad(match, lengths=L, n_new=n, **kw):
        with pytest.raises(ValueError, match=match):
            dsv4_ops.plan(lengths, n_new, *cfg(**kw).values())

    bad(r"plan: lengths must be torch.int32, got torch.int64", lengths=L.long())
    bad(r"n_new must be torch.int32, got torch.float32", n_new=n.float())
    bad(r"n_new.shape\[0\] must be 2 \(B of lengths\), got 3", n_new=torch.ones(3, dtype=I32))
    bad(r"lengths must have rank 1 \[B\], got shape \(1, 2\)", lengths=L[None])
    bad(r"all tensors must be on one device: lengths is on cpu, n_new is on meta", n_new=n.to("meta"))
    bad(r"win_ring must be >= 7 \(ring mode: window \+ num_tokens - 1 = 4 \+ 4 - 1\), got 6", win_ring=6)
    bad(r"win_ring must be >= 3 \(concat mode", win_ring=2, win_concat=True)
    bad(r"csa_ring must be >= 8 \(2 \* csa_ratio = 2 \* 4\), got 7", csa_ring=7)
    bad(r"hca_ring must be >= 8 \(hca_ratio = 8\), got 4", hca_ring=4)
    bad(r"csa_ratio must be >= 1, got 0", csa_ratio=0)
    bad(r"steps must be >= 1, got 0", steps=0)
    bad(r"window must be >= 1, got 0", window=0)
    bad(r"n_new\[1\] = 5 is beyond num_tokens=4", n_new=torch.tensor([1, 5], dtype=I32))
    bad(r"n_new\[0\] = -1 is below the minimum 0", n_new=torch.tensor([-1, 1], dtype=I32))
    bad(r"lengths\[1\] = -3 is below the minimum 0", lengths=torch.tensor([0, -3], dtype=I32))
    bad(r"lengths \+ steps \* n_new\[0\] = 2147483648 is beyond the int32 position range",
        lengths=torch.tensor([2**31 - 1, 0], dtype=I32))


def test_plan_raw_op_counts_negative_lengths_as_zero(device):
    """The raw op (no wrapper checks) counts negative lengths / n_new as 0, on every backend."""
    c = cfg(num_tokens=3, steps=2)
    i32 = dict(dtype=I32, device=device)
    got = torch.ops.dsv4.plan(torch.tensor([-9, 6], **i32), torch.tensor([2, -4], **i32), *c.values())
    want = torch.ops.dsv4.plan(torch.tensor([0, 6], **i32), torch.tensor([2, 0], **i32), *c.values())
    for name, g, w in zip(FIELDS, got, want):
        assert torch.equal(g, w), name
