"""The cache_write kernels (``lowering/triton/cache_write.py``) against the reference, exactly: rows at
their slots for fp32 and bf16 (a decode row, a full ring of rows wider than one channel block),
into one layer's view of a stacked buffer, strided values, every slot skipped; slots outside the
cache are skipped like -1, as in the reference; and the quantising FP8 write, bit for bit.

Under ``TRITON_INTERPRET=1`` on CPU (small shapes), the compiled kernels on a GPU. Every destination
starts poisoned (NaN, or a byte no write produces), so a row the kernel writes where it should not,
or fails to write, shows.
"""
import pytest
import torch

from dsv4_ops.reference import fp8_cache as fp8
from dsv4_ops.reference import ops as ref
from fp8_cases import poisoned
from launchers import DEVICE, i32, kernel_module

tcache = kernel_module("cache_write")

I32 = torch.int32


def _slots(B, S, N, p_skip=0.3):
    slots = torch.stack([torch.randperm(max(N, S))[:S] for _ in range(B)]).to(I32)
    skip = (torch.rand(B, S) < p_skip) | (slots >= N)
    return torch.where(skip, -1, slots).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,N,S,C", [(2, 8, 3, 5), (1, 16, 1, 512), (2, 6, 6, 1100)],
                         ids=["small", "decode_row", "full_ring_two_channel_blocks"])
def test_cache_write_kernel_matches_reference(B, N, S, C, dtype, poison):
    cache = poison(torch.empty(B, N, C, device=DEVICE, dtype=dtype))
    values = torch.randn(B, S, C, device=DEVICE).to(dtype)
    slots = _slots(B, S, N)
    first = slots[0].tolist()  # make the last row addressable, keeping row 0's slots distinct
    if N - 1 in first:
        slots[0, first.index(N - 1)] = first[0]
    slots[0, 0] = N - 1
    want = cache.clone()
    ref.cache_write(want, values, slots)
    assert tcache.cache_write(cache, values, slots) is None
    torch.testing.assert_close(cache, want, rtol=0, atol=0, equal_nan=True)


def test_cache_write_kernel_writes_a_layer_view_and_skips():
    stacked = torch.randn(3, 2, 8, 4, device=DEVICE)
    before = stacked.clone()
    values = torch.randn(2, 3, 4, device=DEVICE)
    slots = i32([[-1, 7, 0], [-1, -1, -1]])  # row 1: every slot skipped
    tcache.cache_write(stacked[1], values, slots)
    want = before[1].clone()
    ref.cache_write(want, values, slots)
    assert torch.equal(stacked[1], want)
    assert torch.equal(stacked[0], before[0]) and torch.equal(stacked[2], before[2])
    # strided values (a channel slice of a wider projection) and slots past N are skipped
    wide = torch.randn(2, 3, 10, device=DEVICE)
    cache = torch.randn(2, 8, 4, device=DEVICE)
    want = cache.clone()
    tcache.cache_write(cache, wide[..., 2:6], i32([[1, 8, 3], [99, 0, -1]]))
    ref.cache_write(want, wide[..., 2:6], i32([[1, -1, 3], [-1, 0, -1]]))
    assert torch.equal(cache, want)


def test_cache_write_kernel_skips_out_of_range_slots_like_the_reference():
    """The raw-op contract on the Triton path: slots outside the cache are skipped like -1 --
    exactly what the reference does with the same values."""
    cache, values = torch.randn(2, 6, 8, device=DEVICE), torch.randn(2, 3, 8, device=DEVICE)
    bad, clean = i32([[6, 1, 99], [-5, 2, 2**31 - 1]]), i32([[-1, 1, -1], [-1, 2, -1]])
    got, want, skipped = cache.clone(), cache.clone(), cache.clone()
    tcache.cache_write(got, values, bad)
    ref.cache_write(want, values, bad)
    ref.cache_write(skipped, values, clean)
    assert torch.equal(got, want) and torch.equal(want, skipped)


def test_fp8_cache_write_kernel_is_the_reference_bit_for_bit():
    B, D, rope = 2, 144, 16
    lay = fp8.KVLayout(D, rope, 4)
    want = poisoned(lay.shape(B, 10), DEVICE)
    got = want.clone()
    values = torch.randn(B, 5, D, device=DEVICE) * torch.logspace(-3, 2, D, device=DEVICE)
    slots = torch.tensor([[0, 3, -1, 7, 9], [11, 2, 5, -1, 4]], dtype=torch.int32, device=DEVICE)
    ref.cache_write(want, values, slots)
    tcache.launch(tcache.fp8_cache_write_kernel, tcache.fp8_cache_write_launch(got, values, slots, rope,
                                                                               lay.data_bytes, lay.scale_bytes))
    assert torch.equal(got, want)
