"""dsv4::moe_gemv against its meaning: per token, the router-weighted sum of its experts' clamped
SwiGLU MLPs -- the op vs the reference and the reference vs a per-assignment float64 loop (an expert
named twice counts twice), fp32 and bf16; the clamp decides large activations as in the model;
edge cases: no tokens, zero router weights, expert ids outside [0, E) skipped by the raw op; on the
GPU, V4-Flash expert widths in bf16 against the grouped GEMM path and the reference."""
import pytest
import torch

import dsv4_ops
from dsv4_ops.lowering.aten.experts import experts_blocked, experts_grouped_mm
from dsv4_ops.reference import ops as ref
from moe_gemv_cases import LIMIT, make_case, oracle


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_moe_gemv_matches_reference(device, dtype, tol):
    x, idx, w, w13, w2 = make_case(4, 6, 16, 96, 40, device=device, dtype=dtype)
    idx[1, 2] = idx[1, 4]  # one token naming an expert twice (hash layers): counts twice
    idx[2] = 5  # every assignment of a token on one expert
    out = dsv4_ops.ops.moe_gemv(x, idx, w, w13, w2, LIMIT)
    assert out.shape == (4, 96) and out.dtype == torch.float32
    want = ref.moe_gemv(x, idx, w, w13, w2, LIMIT).cpu()
    if dtype == torch.bfloat16 and device.type == "cpu":
        # the blocked path rounds each expert's output to bf16 (1 ulp = 0.4%); the kernels sum them in fp32
        assert (out.cpu() - want).abs().max() <= tol("bf16_expert_outputs")["rel"] * want.abs().max()
    else:
        torch.testing.assert_close(out.cpu(), want, **tol("moe_gemv_vs_reference"))
    if dtype == torch.float32:  # the reference itself, against the unrounded float64 oracle
        torch.testing.assert_close(out.double().cpu(), oracle(x, idx, w, w13, w2, LIMIT),
                                   **tol("moe_gemv_reference_vs_float64"))


def test_moe_gemv_clamps_like_the_model(tol):
    # large activations: the SwiGLU clamp (gate from above, up on both sides) decides the output
    x, idx, w, w13, w2 = make_case(2, 3, 5, 32, 16, scale=3.0)
    out = dsv4_ops.ops.moe_gemv(x, idx, w, w13, w2, 1.5)
    blocked = experts_blocked(x, idx, w13, w2, 1.5).view(2, 3, -1)
    torch.testing.assert_close(out, (blocked * w.unsqueeze(-1)).sum(1), **tol(torch.float32))
    assert not torch.allclose(out, dsv4_ops.ops.moe_gemv(x, idx, w, w13, w2, 100.0))


def test_moe_gemv_edge_cases(device, tol):
    # no tokens: an empty fp32 result
    x, idx, w, w13, w2 = make_case(0, 6, 8, 32, 16, device=device)
    assert dsv4_ops.ops.moe_gemv(x, idx, w, w13, w2, LIMIT).shape == (0, 32)
    # zero router weights give exactly zero, whatever the experts
    x, idx, w, w13, w2 = make_case(2, 2, 4, 32, 16, device=device)
    assert torch.equal(dsv4_ops.ops.moe_gemv(x, idx, torch.zeros_like(w), w13, w2, LIMIT),
                       torch.zeros(2, 32, device=device))
    # the raw op skips ids outside [0, E) (zero contribution); the other assignments still count
    bad = idx.clone()
    bad[0, 1], bad[1, 0] = -1, 4
    got = torch.ops.dsv4.moe_gemv(x, bad, w, w13, w2, LIMIT)
    keep = w * ((bad >= 0) & (bad < 4))
    want = ref.moe_gemv(x, idx.clamp(0, 3), keep, w13, w2, LIMIT)
    torch.testing.assert_close(got.cpu(), want.cpu(), **tol(torch.float32))


@pytest.mark.gpu
def test_moe_gemv_matches_grouped_mm_at_flash_widths(tol):
    # V4-Flash expert widths, bf16 on the GPU: the op vs the model's grouped GEMM path
    x, idx, w, w13, w2 = make_case(8, 6, 32, 4096, 2048, device="cuda", dtype=torch.bfloat16, scale=0.02)
    got = dsv4_ops.ops.moe_gemv(x, idx, w, w13, w2, LIMIT)
    want = (experts_grouped_mm(x, idx, w13, w2, LIMIT).float().view(8, 6, -1) * w.unsqueeze(-1)).sum(1)
    # the grouped path rounds each expert's output to bf16 (1 ulp = 0.4%); the op sums them in fp32
    assert (got - want).abs().max() <= tol("bf16_expert_outputs")["rel"] * want.abs().max()
    # the reference rounds where the kernels do: only accumulation order differs (a rare bf16 flip of h)
    expected = ref.moe_gemv(x, idx, w, w13, w2, LIMIT)
    assert (got - expected).abs().max() <= 2e-3 * expected.abs().max()
