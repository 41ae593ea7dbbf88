"""The routed-expert kernels (``lowering/triton/moe_gemv.py``: gate/up, then down) against the
reference: a decode token's top-6 with a repeated expert, odd widths, D past one block; in bf16 (gate
/ up and h rounded to bf16, the bound relative to the output's scale).

Under ``TRITON_INTERPRET=1`` on CPU, the compiled kernels on a GPU; the output is poisoned first.
"""
import pytest
import torch

from dsv4_ops.reference import ops as ref
from launchers import DEVICE, kernel_module
from moe_gemv_cases import LIMIT, make_case

tmoe = kernel_module("moe_gemv")


@pytest.mark.parametrize("T, K, E, D, I", [(1, 6, 16, 64, 32), (3, 2, 5, 40, 24), (2, 3, 4, 300, 20)],
                         ids=["decode_top6", "odd_widths", "D_over_one_block"])
def test_moe_gemv_kernels_match_reference(T, K, E, D, I, poison, tol):
    x, idx, w, w13, w2 = make_case(T, K, E, D, I, device=DEVICE)
    idx[0, -1] = idx[0, 0]  # a repeated expert
    out = poison(torch.empty(T, D, device=DEVICE))
    got = tmoe.moe_gemv(x, idx, w, w13, w2, LIMIT, out=out)
    assert got is out
    torch.testing.assert_close(got.cpu(), ref.moe_gemv(x, idx, w, w13, w2, LIMIT).cpu(), **tol(torch.float32))


def test_moe_gemv_kernels_in_bf16():
    # gate / up and h are rounded to bf16 (a rounding step apart from the reference's is a few
    # bf16 ulps of h, so the bound is relative to the output's scale)
    x, idx, w, w13, w2 = make_case(1, 4, 6, 64, 32, device=DEVICE, dtype=torch.bfloat16)
    got = tmoe.moe_gemv(x, idx, w, w13, w2, LIMIT).cpu()
    want = ref.moe_gemv(x, idx, w, w13, w2, LIMIT).cpu()
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()
