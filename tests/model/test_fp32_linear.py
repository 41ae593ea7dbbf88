"""``model.linear.fp32_linear``: the fp32 projections of the mHC mixing weights and the routers.

Compiled with a decode step's few tokens it is a product and a sum (one Inductor reduction, no
GEMM call); eager, or with many tokens, it is ``F.linear`` in fp32. Either way the same numbers.
"""
import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from dsv4_ops.model import linear
from dsv4_ops.model.hyper_connection import HyperConnection
from dsv4_ops.model.moe import Router


def _compiled_code(fn, *args):
    torch._dynamo.reset()
    out, code = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    return out, "\n".join(code)


@pytest.mark.parametrize("tokens", [1, linear.FP32_SUM_MAX_TOKENS])
def test_few_tokens_compile_to_a_sum_not_a_gemm(tokens, tol):
    torch.manual_seed(0)
    x = torch.randn(tokens, 256, dtype=torch.bfloat16)
    w = torch.randn(24, 256, dtype=torch.bfloat16)
    got, code = _compiled_code(linear.fp32_linear, x, w)
    assert "extern_kernels.mm" not in code and "extern_kernels.addmm" not in code
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x.float(), w.float()), **tol(torch.float32))


def test_many_tokens_keep_the_gemm(tol):
    torch.manual_seed(0)
    x = torch.randn(linear.FP32_SUM_MAX_TOKENS + 1, 256)
    w = torch.randn(24, 256)
    got, code = _compiled_code(linear.fp32_linear, x, w)
    assert "extern_kernels.mm" in code
    torch.testing.assert_close(got, F.linear(x, w), **tol(torch.float32))


def test_eager_is_f_linear_in_fp32():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    w = torch.randn(8, 64, dtype=torch.bfloat16)
    assert torch.equal(linear.fp32_linear(x, w), F.linear(x.float(), w.float()))


@torch.no_grad()
def test_compiled_mhc_site_and_router_at_decode_match_eager(tol):
    """The two users, compiled at one token, against their eager (F.linear) selves."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    hc = HyperConnection(dim=64, hc_mult=4)
    with torch.no_grad():
        hc.base.normal_()
    x = torch.randn(1, 1, 4, 64)
    want = hc.collapse(x)
    got = torch.compile(hc.collapse, fullgraph=True)(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol("compiled_vs_eager_fp32"))
    router = Router(dim=64, n_experts=16, top_k=2)
    h = torch.randn(1, 64, dtype=torch.bfloat16)
    (w_want, i_want), (w_got, i_got) = router(h), torch.compile(router, fullgraph=True)(h)
    assert torch.equal(i_got.sort(-1).values, i_want.sort(-1).values)
    torch.testing.assert_close(w_got.gather(1, i_got.argsort(-1)), w_want.gather(1, i_want.argsort(-1)))


@torch.no_grad()
def test_compiled_mhc_expand_is_a_fused_sum_equal_to_the_matmul(tol):
    """``HyperConnection.expand`` compiled: no GEMM call (the 4-term mixing sum is fused), the eager
    matmul's values."""
    torch.manual_seed(0)
    y, x = torch.randn(2, 3, 64, dtype=torch.bfloat16), torch.randn(2, 3, 4, 64, dtype=torch.bfloat16)
    post, comb = torch.rand(2, 3, 4), torch.rand(2, 3, 4, 4)
    got, code = _compiled_code(HyperConnection.expand, y, x, post, comb)
    assert "extern_kernels.bmm" not in code and "extern_kernels.mm" not in code
    want = HyperConnection.expand(y, x, post, comb)
    torch.testing.assert_close(got.float(), want.float(), **tol("bf16_one_rounding"))  # bf16 output, one rounding
    assert (got.float() - want.float()).abs().max() <= 2 * want.float().abs().max() * 2 ** -8
