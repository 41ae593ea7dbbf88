"""dsv4::cache_write: rows land exactly at their slots, -1 skips, nothing else changes."""
import pytest
import torch
from torch.library import opcheck

import dsv4_ops

I32 = torch.int32


def distinct_slots(B, S, N, p_skip=0.3, device="cpu"):
    """[B, S] int32: distinct slots per row (a random permutation prefix), some -1."""
    slots = torch.stack([torch.randperm(max(N, S), device=device)[:S] for _ in range(B)]).to(I32)
    skip = (torch.rand(B, S, device=device) < p_skip) | (slots >= N)
    return torch.where(skip, torch.full_like(slots, -1), slots)


def make_inputs(B=2, N=8, S=3, C=5, dtype=torch.float32, device="cpu"):
    cache = torch.randn(B, N, C, device=device).to(dtype)
    values = torch.randn(B, S, C, device=device).to(dtype)
    return [cache, values, distinct_slots(B, S, N, device=device)]


def oracle(cache, values, slots):
    out = cache.clone()
    for b in range(slots.shape[0]):
        for s, slot in enumerate(slots[b].tolist()):
            if slot >= 0:
                out[b, slot] = values[b, s]
    return out


def check(cache, values, slots, poison):
    poison(cache)  # untouched rows must stay exactly what they were (NaN)
    expected = oracle(cache, values, slots)
    assert dsv4_ops.cache_write(cache, values, slots) is None
    torch.testing.assert_close(cache, expected, rtol=0, atol=0, equal_nan=True)


OPCHECK_CASES = {
    "basic": dict(),
    "one_token": dict(S=1),
    "all_-1": dict(N=0),
    "full_ring": dict(N=4, S=4),
}


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_cache_write_opcheck(case):
    opcheck(torch.ops.dsv4.cache_write.default, make_inputs(**OPCHECK_CASES[case]))


def test_cache_write_fake_matches_real(fake_check):
    for kw in OPCHECK_CASES.values():
        fake_check(torch.ops.dsv4.cache_write.default, *make_inputs(**kw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [dict(), dict(B=1, N=16, S=1), dict(B=3, N=130, S=129, C=7)],
                         ids=["basic", "decode", "prefill"])
def test_cache_write_matches_reference(device, dtype, shape, poison):
    check(*make_inputs(dtype=dtype, device=device, **shape), poison)


def test_cache_write_edge_cases(device, poison):
    # every slot -1: nothing changes
    cache, values, slots = make_inputs(device=device)
    check(cache, values, slots.fill_(-1), poison)
    # first and last row of the cache
    cache, values, _ = make_inputs(N=8, S=2, device=device)
    check(cache, values, torch.tensor([[0, 7], [7, 0]], dtype=I32, device=device), poison)
    # a view: one layer of a stacked [L, B, N, C] buffer; the other layers stay untouched
    stacked = torch.randn(3, 2, 8, 4, device=device)
    before = stacked.clone()
    values = torch.randn(2, 3, 4, device=device)
    slots = distinct_slots(2, 3, 8, device=device)
    dsv4_ops.cache_write(stacked[1], values, slots)
    assert torch.equal(stacked[1], oracle(before[1], values, slots))
    assert torch.equal(stacked[0], before[0]) and torch.equal(stacked[2], before[2])
    # slots from plan for a chunk longer than the ring: only the last R tokens are written
    ring = 4
    p = dsv4_ops.plan(torch.tensor([3], dtype=I32, device=device), torch.tensor([6], dtype=I32, device=device),
                      6, 1, 2, 7, False, 2, ring, 4, ring)
    cache, values, _ = make_inputs(B=1, N=ring, S=6, device=device)
    check(cache, values, p.csa_write[0], poison)
    for j in range(2, 6):  # positions 5..8 land at p % ring; positions 3, 4 are overwritten later
        assert torch.equal(cache[0, (3 + j) % ring], values[0, j])


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
