"""dsv4::cache_write against its meaning: rows land exactly at their slots, -1 skips, nothing else
changes (the cache is poisoned first and compared exactly, NaN included); fp32 and bf16, decode and
prefill shapes; edge cases: every slot -1, the first and last row, a view (one layer of a stacked
buffer), and plan's slots for a chunk longer than the ring."""
import pytest
import torch

import dsv4_ops
from cache_write_cases import I32, distinct_slots, make_inputs


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
