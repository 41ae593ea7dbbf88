"""dsv4::gemv against its meaning, ``y[t, g] = weight[g] @ x[t, g]``: the op vs the reference and the
reference vs the unrounded float64 oracle (one group is ``F.linear``), fp32 and bf16; edge cases: no
tokens, K = 0 (exactly zero), widths no block divides, past the kernel's 8 tokens (the GEMM path,
same contract); on the GPU, V4-Flash's decode projections in bf16 against cuBLAS and the oracle."""
import pytest
import torch
import torch.nn.functional as F

import dsv4_ops
from dsv4_ops.reference import ops as ref
from gemv_cases import make_case, oracle


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gemv_matches_reference(device, dtype, tol):
    x, w = make_case(3, 2, 40, 96, device=device, dtype=dtype)
    out = dsv4_ops.ops.gemv(x, w)
    assert out.shape == (3, 2, 40) and out.dtype == dtype
    torch.testing.assert_close(out.cpu(), ref.gemv(x, w).cpu(),
                               **tol(torch.float32 if dtype == torch.float32 else "gemv_bf16_vs_reference"))
    # one group is F.linear; the reference itself against the unrounded float64 oracle
    torch.testing.assert_close(ref.gemv(x[:, :1], w[:1]), F.linear(x[:, 0], w[0])[:, None], **tol(torch.float32))
    if dtype == torch.float32:
        torch.testing.assert_close(out.double().cpu(), oracle(x, w), **tol(torch.float32))


def test_gemv_edge_cases(device, tol):
    x, w = make_case(0, 1, 16, 8, device=device)  # no tokens
    assert dsv4_ops.ops.gemv(x, w).shape == (0, 1, 16)
    x, w = make_case(2, 1, 16, 0, device=device)  # K = 0: exactly zero
    assert torch.equal(dsv4_ops.ops.gemv(x, w), torch.zeros(2, 1, 16, device=device))
    x, w = make_case(2, 3, 5, 7, device=device)  # widths no block divides
    torch.testing.assert_close(dsv4_ops.ops.gemv(x, w).double().cpu(), oracle(x, w), **tol(torch.float32))
    for G in (1, 3):  # past the kernel's 8 tokens: the GEMM path, same contract
        x, w = make_case(40, G, 24, 32, device=device)
        torch.testing.assert_close(dsv4_ops.ops.gemv(x, w).double().cpu(), oracle(x, w), **tol(torch.float32))


@pytest.mark.gpu
def test_gemv_matches_cublas_at_flash_widths(tol):
    # the decode projections of V4-Flash in bf16: the op vs F.linear (cuBLAS) and the reference
    torch.manual_seed(0)
    for N, K in ((1024, 4096), (32768, 1024), (512, 4096), (4096, 8192), (2048, 4096)):
        x, w = make_case(1, 1, N, K, device="cuda", dtype=torch.bfloat16)
        got = dsv4_ops.ops.gemv(x, w)
        cublas = F.linear(x[:, 0], w[0])[:, None]
        scale = cublas.float().abs().max()
        assert (got.float() - cublas.float()).abs().max() <= tol("bf16_gemv_vs_cublas")["rel"] * scale, (N, K)
        assert (got.float() - oracle(x, w).cuda()).abs().max() <= tol("bf16_gemv_vs_cublas")["rel"] * scale, (N, K)
    x, w = make_case(1, 8, 1024, 4096, device="cuda", dtype=torch.bfloat16)  # o_a: 8 groups
    torch.testing.assert_close(dsv4_ops.ops.gemv(x, w).float(), oracle(x, w).cuda().float(), **tol(torch.bfloat16))
