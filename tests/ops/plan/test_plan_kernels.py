"""The plan kernel (``lowering/triton/plan.py``) against the reference plan, exactly: decode,
verify with a padding row, concat prefill, MTP steps, a chunk larger than the ring, many query
blocks with a wide window, V4's rates at prefill and positions near the int32 limit; the launcher
allocates contiguous int32 outputs, launches nothing for no query slots and refuses an ``out`` of
another layout; negative lengths and ``n_new`` count as 0, as in the reference.

Under ``TRITON_INTERPRET=1`` on CPU (small shapes), the compiled kernel on a GPU. Every output is
poisoned before the launch (a large negative value), so a slot the kernel fails to write shows.
"""
import pytest
import torch

from dsv4_ops.reference import ops as ref
from launchers import DEVICE, i32, kernel_module

tplan = kernel_module("plan")

I32 = torch.int32

PLAN_CASES = {
    # name: (lengths, n_new, num_tokens, steps, window, win_ring, win_concat, csa m, csa ring, hca m, hca ring)
    "decode": ([5, 0, 127], [1, 1, 1], 1, 1, 4, 4, False, 4, 8, 8, 8),
    "verify_with_padding_row": ([7, 126, 3], [4, 0, 2], 4, 1, 4, 9, False, 4, 8, 8, 8),
    "concat_prefill": ([0, 13], [9, 5], 9, 1, 4, 4, True, 4, 8, 4, 4),
    "mtp_steps": ([127, 128], [1, 1], 1, 3, 4, 6, False, 4, 8, 128, 130),
    "chunk_larger_than_ring": ([3, 1], [6, 2], 6, 1, 2, 7, False, 2, 4, 4, 4),
    "many_query_blocks_and_wide_window": ([0, 200], [70, 33], 70, 1, 200, 199, True, 4, 8, 16, 16),
    "v4_rates_prefill": ([0, 1000], [130, 129], 130, 1, 128, 128, True, 4, 8, 128, 128),
    "positions_near_int32_max": ([2**31 - 12], [4], 4, 2, 8, 11, False, 4, 8, 128, 128),
}


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_plan_kernel_matches_reference_exactly(case, poison):
    lengths, n_new, *rest = PLAN_CASES[case]
    args = (i32(lengths), i32(n_new), *rest)
    want = ref.plan(*args)
    out = tuple(poison(torch.empty(w.shape, dtype=I32, device=DEVICE)) for w in want)
    got = tplan.plan(*args, out=out)
    assert all(g is o for g, o in zip(got, out))
    for name, g, w in zip(("positions", "win_write", "win_idx", "csa_len", "csa_emit", "csa_write", "hca_len",
                           "hca_emit", "hca_write"), got, want):
        assert torch.equal(g, w), f"{name}:\n{g}\nwant\n{w}"


def test_plan_launcher_allocates_contiguous_outputs_and_handles_empty():
    args = (i32([4, 9]), i32([2, 1]), 3, 2, 5, 8, False, 4, 8, 8, 8)
    for g, w in zip(tplan.plan(*args), ref.plan(*args)):
        assert g.dtype == I32 and g.is_contiguous() and torch.equal(g, w)
    empty = (i32([4, 9]), i32([0, 0]), 0, 1, 5, 8, False, 4, 8, 8, 8)  # num_tokens = 0: nothing to launch
    assert [g.shape for g in tplan.plan(*empty)] == [w.shape for w in ref.plan(*empty)]
    with pytest.raises(ValueError, match=r"plan: out\[2\] must be a contiguous int32 tensor of shape"):
        tplan.plan(*args, out=tuple(torch.empty(w.shape, dtype=I32, device=DEVICE).mT if w.dim() == 4 else
                                    torch.empty(w.shape, dtype=I32, device=DEVICE) for w in ref.plan(*args)))


def test_plan_kernel_counts_negative_lengths_and_n_new_as_zero():
    """The raw-op contract on the Triton path: negative lengths and n_new count as 0 -- exactly
    what the reference does with the same values."""
    args = (3, 2, 4, 8, False, 4, 8, 8, 8)
    for bad, clean in (((i32([-7, 5]), i32([2, -3])), (i32([0, 5]), i32([2, 0]))),):
        got = tplan.plan(*bad, *args)
        for g, w, c in zip(got, ref.plan(*bad, *args), ref.plan(*clean, *args)):
            assert torch.equal(g, w) and torch.equal(w, c)
