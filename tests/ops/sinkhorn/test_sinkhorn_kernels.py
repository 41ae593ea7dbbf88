"""The sinkhorn kernel (``lowering/triton/sinkhorn.py``) against the reference: one decode token to a
prefill's 130 matrices spanning several programs in every tile (2, 8 or 64 matrices a program), N
= 2, 3 (padded to 4) and 4, 1 to 20 iterations; and the launch config: one warp, with a lane per
entry at decode and 4 entries a lane for a long prefill.

Under ``TRITON_INTERPRET=1`` on CPU, the compiled kernel on a GPU; the output is poisoned (NaN)
before the launch.
"""
import pytest
import torch

from dsv4_ops.reference import ops as ref
from launchers import DEVICE, kernel_module

tsinkhorn = kernel_module("sinkhorn")


@pytest.mark.parametrize("config", [None, dict(BLOCK_T=8), dict(BLOCK_T=64, num_warps=4)],
                         ids=["default", "prefill_tile", "4_warps"])
@pytest.mark.parametrize("T, N, iters", [(1, 4, 20), (130, 4, 20), (7, 2, 5), (5, 3, 2), (3, 4, 1)])
def test_sinkhorn_kernel_matches_reference(T, N, iters, config, poison, tol):
    """T = 130 spans several programs in every tile (2, 8 or 64 matrices of 4 x 4 each); N = 3 pads to 4."""
    comb = (torch.rand(T, N, N, device=DEVICE) * 3).softmax(-1) + 1e-6
    out = poison(torch.empty(T, N, N, device=DEVICE))
    tsinkhorn.sinkhorn(comb, iters, 1e-6, out=out, config=config)
    torch.testing.assert_close(out, ref.sinkhorn(comb, iters, 1e-6), **tol("sinkhorn_vs_float64"))


def test_sinkhorn_config_is_one_warp_with_a_lane_per_entry_at_decode():
    """A decode step's few matrices: one warp, 32 entries (two 4 x 4 matrices) per program, so the
    row / column sums stay inside the warp; a long prefill's: 4 entries per lane."""
    assert tsinkhorn.sinkhorn_config(1, 4) == dict(BLOCK_T=2, num_warps=1)
    assert tsinkhorn.sinkhorn_config(64, 4) == dict(BLOCK_T=2, num_warps=1)
    assert tsinkhorn.sinkhorn_config(8192, 4) == dict(BLOCK_T=2, num_warps=1)
    assert tsinkhorn.sinkhorn_config(8193, 4) == dict(BLOCK_T=8, num_warps=1)
    assert tsinkhorn.sinkhorn_config(1, 2) == dict(BLOCK_T=8, num_warps=1)
    assert tsinkhorn.sinkhorn_config(1, 3) == dict(BLOCK_T=2, num_warps=1)
