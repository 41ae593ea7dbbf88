"""dsv4::sinkhorn against its meaning: the mHC mixing matrix after 2*iters-1 alternating
normalisations, vs an element-by-element float64 oracle; every sum offset by eps; the last step
normalises columns, so they sum to 1. fp32 and bf16 inputs, N = 2, 3, 4 and 1 to 20 iterations;
edge cases: no tokens, N = 1, an already doubly stochastic matrix, a transposed view."""
import pytest
import torch

import dsv4_ops
from sinkhorn_cases import make_comb


def oracle(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Explicit loops over every matrix, row and column, in float64."""
    N = comb.shape[-1]
    mats = comb.double().reshape(-1, N, N).tolist()
    for m in mats:
        def columns():
            for j in range(N):
                s = sum(m[i][j] for i in range(N)) + eps
                for i in range(N):
                    m[i][j] /= s

        columns()
        for _ in range(iters - 1):
            for i in range(N):
                s = sum(m[i]) + eps
                m[i] = [x / s for x in m[i]]
            columns()
    return torch.tensor(mats, dtype=torch.float64).reshape(comb.shape)


@pytest.mark.parametrize("N, iters", [(4, 20), (2, 5), (4, 1), (3, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sinkhorn_matches_reference(device, N, iters, dtype, tol):
    comb = make_comb(3, 70, N=N, device=device, dtype=dtype)  # T = 210: several programs on GPU
    out = dsv4_ops.ops.sinkhorn(comb, iters, 1e-6)
    assert out.shape == comb.shape and out.dtype == torch.float32
    expected = oracle(comb, iters, 1e-6)  # from the same (rounded) inputs
    torch.testing.assert_close(out.double().cpu(), expected, **tol("sinkhorn_vs_float64"))
    # the last normalisation is over columns: they sum to 1 (up to eps)
    torch.testing.assert_close(out.sum(-2).cpu(), torch.ones(3, 70, N), **tol("sinkhorn_column_sums"))


def test_sinkhorn_edge_cases(device, tol):
    # no tokens (an empty batch bucket): an empty fp32 result
    empty = dsv4_ops.ops.sinkhorn(make_comb(0, 1, device=device), 20, 1e-6)
    assert empty.shape == (0, 1, 4, 4) and empty.dtype == torch.float32
    # N = 1: every entry becomes c / (c + eps) per step
    one = torch.rand(6, 1, 1, device=device) + 0.5
    torch.testing.assert_close(dsv4_ops.ops.sinkhorn(one, 3, 1e-6).double().cpu(), oracle(one, 3, 1e-6),
                               **tol("sinkhorn_1x1_vs_float64"))
    # an already doubly stochastic matrix (a permutation + eps) stays put
    perm = torch.eye(4, device=device)[torch.tensor([2, 0, 3, 1])] + 1e-6
    out = dsv4_ops.ops.sinkhorn(perm[None], 20, 1e-6)
    torch.testing.assert_close(out[0], perm, **tol("sinkhorn_fixed_point"))
    # a non-contiguous input (a transposed view) is read by value
    comb = make_comb(8, device=device)
    torch.testing.assert_close(dsv4_ops.ops.sinkhorn(comb.transpose(-1, -2), 20, 1e-6).double().cpu(),
                               oracle(comb.transpose(-1, -2).cpu(), 20, 1e-6), **tol("sinkhorn_vs_float64"))
