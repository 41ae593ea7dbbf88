"""dsv4::moe_gemv: the routed experts — per token, the router-weighted sum of its experts' clamped
SwiGLU MLPs; against a per-assignment float64 loop, against the blocked / grouped expert paths it
takes beyond a few tokens, and (Triton kernels, interpreter on CPU) against the reference.
"""
import importlib
import os

import pytest
import torch
from torch.library import opcheck

import dsv4_ops
from dsv4_ops.lowering.aten.experts import experts_blocked, experts_grouped_mm
from dsv4_ops.model import moe
from dsv4_ops.reference import ops as ref

CUDA = torch.cuda.is_available()
if not CUDA:
    assert os.environ.get("TRITON_INTERPRET") == "1"  # set by conftest before triton loads
from test_triton_interp import _kernel_module  # noqa: E402

tmoe = _kernel_module("moe_gemv")
moe_op = importlib.import_module("dsv4_ops.ops.moe_gemv")  # the module (dsv4_ops.ops.moe_gemv is the function)
LIMIT = 10.0


def make_case(T, K, E, D, I, device="cpu", dtype=torch.float32, scale=0.2):
    x = torch.randn(T, D, device=device).to(dtype)
    indices = torch.randint(0, E, (T, K), device=device)
    weights = torch.rand(T, K, device=device) + 0.1
    w13 = (torch.randn(E, 2 * I, D, device=device) * scale).to(dtype)
    w2 = (torch.randn(E, D, I, device=device) * scale).to(dtype)
    return x, indices, weights, w13, w2


def oracle(x, indices, weights, w13, w2, limit):
    """One (token, k) at a time in float64, no rounding: the math the op approximates."""
    T, K = indices.shape
    I = w2.shape[2]
    out = torch.zeros(T, x.shape[1], dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(indices[t, k])
            gu = w13[e].double().cpu() @ x[t].double().cpu()
            gate, up = gu[:I].clamp(max=limit), gu[I:].clamp(-limit, limit)
            out[t] += float(weights[t, k]) * (w2[e].double().cpu() @ (torch.nn.functional.silu(gate) * up))
    return out


OPCHECK_CASES = {"decode_b1_top6": (1, 6, 16, 32, 16), "b3_top2": (3, 2, 4, 24, 8), "top1": (2, 1, 3, 16, 8)}


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_moe_gemv_opcheck(case):
    opcheck(torch.ops.dsv4.moe_gemv.default, (*make_case(*OPCHECK_CASES[case]), LIMIT))


def test_moe_gemv_fake_matches_real(fake_check):
    for case in OPCHECK_CASES.values():
        out = fake_check(torch.ops.dsv4.moe_gemv.default, *make_case(*case), LIMIT)
        assert out.dtype == torch.float32 and out.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_moe_gemv_matches_reference(device, dtype):
    x, idx, w, w13, w2 = make_case(4, 6, 16, 96, 40, device=device, dtype=dtype)
    idx[1, 2] = idx[1, 4]  # one token naming an expert twice (hash layers): counts twice
    idx[2] = 5  # every assignment of a token on one expert
    out = dsv4_ops.ops.moe_gemv(x, idx, w, w13, w2, LIMIT)
    assert out.shape == (4, 96) and out.dtype == torch.float32
    want = ref.moe_gemv(x, idx, w, w13, w2, LIMIT).cpu()
    if dtype == torch.bfloat16 and device.type == "cpu":
        # the blocked path rounds each expert's output to bf16 (1 ulp = 0.4%); the kernels sum them in fp32
        assert (out.cpu() - want).abs().max() <= 1e-2 * want.abs().max()
    else:
        torch.testing.assert_close(out.cpu(), want, atol=2e-5, rtol=2e-5)
    if dtype == torch.float32:  # the reference itself, against the unrounded float64 oracle
        torch.testing.assert_close(out.double().cpu(), oracle(x, idx, w, w13, w2, LIMIT), atol=1e-4, rtol=1e-4)


def test_moe_gemv_clamps_like_the_model():
    # large activations: the SwiGLU clamp (gate from above, up on both sides) decides the output
    x, idx, w, w13, w2 = make_case(2, 3, 5, 32, 16, scale=3.0)
    out = dsv4_ops.ops.moe_gemv(x, idx, w, w13, w2, 1.5)
    blocked = experts_blocked(x, idx, w13, w2, 1.5).view(2, 3, -1)
    torch.testing.assert_close(out, (blocked * w.unsqueeze(-1)).sum(1), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, dsv4_ops.ops.moe_gemv(x, idx, w, w13, w2, 100.0))


def test_moe_gemv_edge_cases(device):
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
    torch.testing.assert_close(got.cpu(), want.cpu(), atol=1e-5, rtol=1e-5)


def test_moe_gemv_rejects_bad_input():
    x, idx, w, w13, w2 = make_case(2, 2, 4, 32, 16)
    with pytest.raises(ValueError, match=r"moe_gemv: x must have rank 2 \[T, D\]"):
        dsv4_ops.ops.moe_gemv(x[None], idx, w, w13, w2, LIMIT)
    with pytest.raises(ValueError, match=r"moe_gemv: indices\[1, 0\] = 4 is beyond the experts E=4"):
        dsv4_ops.ops.moe_gemv(x, torch.tensor([[0, 1], [4, 2]]), w, w13, w2, LIMIT)
    with pytest.raises(ValueError, match=r"moe_gemv: indices\[0, 1\] = -1 is below the minimum 0"):
        dsv4_ops.ops.moe_gemv(x, torch.tensor([[0, -1], [3, 2]]), w, w13, w2, LIMIT)
    with pytest.raises(ValueError, match="moe_gemv: w13 must have the dtype of x"):
        dsv4_ops.ops.moe_gemv(x, idx, w, w13.bfloat16(), w2, LIMIT)
    with pytest.raises(ValueError, match=r"moe_gemv: w13.shape\[1\] must be 32 \(2 \* I, I from w2\)"):
        dsv4_ops.ops.moe_gemv(x, idx, w, w13[:, :30], w2, LIMIT)
    with pytest.raises(ValueError, match="moe_gemv: weights must have the shape of indices"):
        dsv4_ops.ops.moe_gemv(x, idx, w[:, :1], w13, w2, LIMIT)
    with pytest.raises(ValueError, match="moe_gemv: indices must be int32 or int64"):
        dsv4_ops.ops.moe_gemv(x, idx.float(), w, w13, w2, LIMIT)


# ---- the Triton kernels themselves (interpreter on CPU) --------------------------------
@pytest.mark.parametrize("T, K, E, D, I", [(1, 6, 16, 64, 32), (3, 2, 5, 40, 24), (2, 3, 4, 300, 20)],
                         ids=["decode_top6", "odd_widths", "D_over_one_block"])
def test_moe_gemv_kernels_match_reference(T, K, E, D, I, poison):
    dev = torch.device("cuda" if CUDA else "cpu")
    x, idx, w, w13, w2 = make_case(T, K, E, D, I, device=dev)
    idx[0, -1] = idx[0, 0]  # a repeated expert
    out = poison(torch.empty(T, D, device=dev))
    got = tmoe.moe_gemv(x, idx, w, w13, w2, LIMIT, out=out)
    assert got is out
    torch.testing.assert_close(got.cpu(), ref.moe_gemv(x, idx, w, w13, w2, LIMIT).cpu(), atol=1e-5, rtol=1e-5)


def test_moe_gemv_kernels_in_bf16():
    # gate / up and h are rounded to bf16 (a rounding step apart from the reference's is a few
    # bf16 ulps of h, so the bound is relative to the output's scale)
    dev = torch.device("cuda" if CUDA else "cpu")
    x, idx, w, w13, w2 = make_case(1, 4, 6, 64, 32, device=dev, dtype=torch.bfloat16)
    got = tmoe.moe_gemv(x, idx, w, w13, w2, LIMIT).cpu()
    want = ref.moe_gemv(x, idx, w, w13, w2, LIMIT).cpu()
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()


# ---- the model takes the op for a few tokens, and gets what the other paths get --------
def test_experts_run_the_op_which_takes_the_kernel_for_few_assignments(monkeypatch):
    experts = moe.Experts(8, 48, 24)
    x, idx = torch.randn(2, 48), torch.randint(0, 8, (2, 6))
    w = torch.rand(2, 6)
    calls = []
    real = torch.ops.dsv4.moe_gemv

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(torch.ops.dsv4, "moe_gemv", spy, raising=False)
    with torch.no_grad():
        got = experts(x, idx, w)
    blocked = experts_blocked(x, idx, experts.gate_up_proj, experts.down_proj, experts.swiglu_limit)
    torch.testing.assert_close(got, (blocked.view(2, 6, -1) * w.unsqueeze(-1)).sum(1), atol=0, rtol=0)  # CPU: blocked
    assert len(calls) == 1
    monkeypatch.setattr(moe_op, "use_triton", lambda t: True)  # as on a GPU
    assert moe_op.takes_kernel(x, experts.gate_up_proj, 12)
    assert not moe_op.takes_kernel(x, experts.gate_up_proj, 11 * 6)  # > MAX_ASSIGNMENTS: grouped / blocked
    assert 11 * 6 > tmoe.MAX_ASSIGNMENTS
    assert not moe_op.takes_kernel(x.bfloat16(), experts.gate_up_proj, 12)  # dtype mismatch: not taken


@pytest.mark.gpu
def test_moe_gemv_matches_grouped_mm_at_flash_widths():
    # V4-Flash expert widths, bf16 on the GPU: the op vs the model's grouped GEMM path
    x, idx, w, w13, w2 = make_case(8, 6, 32, 4096, 2048, device="cuda", dtype=torch.bfloat16, scale=0.02)
    got = dsv4_ops.ops.moe_gemv(x, idx, w, w13, w2, LIMIT)
    want = (experts_grouped_mm(x, idx, w13, w2, LIMIT).float().view(8, 6, -1) * w.unsqueeze(-1)).sum(1)
    # the grouped path rounds each expert's output to bf16 (1 ulp = 0.4%); the op sums them in fp32
    assert (got - want).abs().max() <= 1e-2 * want.abs().max()
    # the reference rounds where the kernels do: only accumulation order differs (a rare bf16 flip of h)
    expected = ref.moe_gemv(x, idx, w, w13, w2, LIMIT)
    assert (got - expected).abs().max() <= 2e-3 * expected.abs().max()
