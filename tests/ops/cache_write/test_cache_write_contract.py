"""dsv4::cache_write as an op: opcheck on a basic write, one token, all slots -1 and a full ring; the
fake matches the real op; the public wrapper refuses bad input naming the argument and the limit
(dtype, shape, rank, device, slots out of range or twice in a row); the raw op skips slots outside
[0, N) like -1."""
import pytest
import torch
from torch.library import opcheck

import dsv4_ops
from cache_write_cases import I32, OPCHECK_CASES, make_inputs


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_cache_write_opcheck(case):
    opcheck(torch.ops.dsv4.cache_write.default, make_inputs(**OPCHECK_CASES[case]))


def test_cache_write_fake_matches_real(fake_check):
    for kw in OPCHECK_CASES.values():
        fake_check(torch.ops.dsv4.cache_write.default, *make_inputs(**kw))


def test_cache_write_rejects_bad_input():
    def bad(i, value, match):
        args = make_inputs()
        args[i] = value(args)
        with pytest.raises(ValueError, match=match):
            dsv4_ops.cache_write(*args)

    bad(2, lambda a: a[2].long(), r"cache_write: slots must be torch.int32, got torch.int64")
    bad(1, lambda a: a[1].double(), r"values must have the dtype of cache \(torch.float32\), got torch.float64")
    bad(1, lambda a: torch.randn(2, 3, 6), r"values.shape\[2\] must be 5 \(C of cache\), got 6")
    bad(2, lambda a: a[2][:, :2], r"slots.shape\[1\] must be 3 \(S of values\), got 2")
    bad(0, lambda a: a[0][0], r"cache must have rank 3")
    bad(1, lambda a: a[1].to("meta"), r"all tensors must be on one device: cache is on cpu, values is on meta")
    bad(2, lambda a: torch.tensor([[0, 17, -1], [1, 2, 3]], dtype=I32),
        r"cache_write: slots\[0, 1\] = 17 is beyond cache rows N=8")
    bad(2, lambda a: torch.tensor([[0, 1, -1], [1, -5, 3]], dtype=I32), r"slots\[1, 1\] = -5 is below the minimum -1")
    bad(2, lambda a: torch.tensor([[0, 1, -1], [2, 5, 2]], dtype=I32), r"slots\[1\] holds index 2 twice")


def test_cache_write_raw_op_skips_out_of_range_slots(device):
    """The raw op (no wrapper checks) skips slots outside [0, N) like -1, on every backend."""
    cache, values, _ = make_inputs(N=8, S=4, device=device)
    bad = torch.tensor([[8, 1, 2**31 - 1, -6], [-1, 99, 0, 9]], dtype=I32, device=device)
    got, want = cache.clone(), cache.clone()
    torch.ops.dsv4.cache_write(got, values, bad)
    torch.ops.dsv4.cache_write(want, values, torch.where((bad >= 0) & (bad < 8), bad, -1))
    assert torch.equal(got, want)
