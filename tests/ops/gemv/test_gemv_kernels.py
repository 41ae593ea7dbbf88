"""The gemv kernel (``lowering/triton/gemv.py``: one weight read for a decode token) against the
float64 oracle and the reference: a decode token over two K blocks, odd widths, eight tokens (the
most it takes), grouped rows, the default 8-row tile, bf16 rounding once; its launch rule (a narrow
projection still gives every multiprocessor two programs; eight tokens keep one token's registers)
and which V4-Flash decode projections take it rather than cuBLAS (measured, BENCHMARKS.md).

Under ``TRITON_INTERPRET=1`` on CPU, the compiled kernel on a GPU; outputs are poisoned first.
"""
import importlib

import pytest
import torch

from dsv4_ops.reference import ops as ref
from gemv_cases import make_case, oracle
from launchers import DEVICE, kernel_module

tgemv = kernel_module("gemv")
gemv_op = importlib.import_module("dsv4_ops.ops.gemv")  # the module (dsv4_ops.ops.gemv is the function)


@pytest.mark.parametrize("T, G, N, K", [(1, 1, 64, 1024), (3, 2, 20, 300), (8, 1, 33, 130), (5, 8, 12, 64)],
                         ids=["decode_two_k_blocks", "odd_widths", "eight_tokens", "grouped_o_a"])
def test_gemv_kernel_matches_reference(T, G, N, K, poison, tol):
    x, w = make_case(T, G, N, K, device=DEVICE)
    y = poison(torch.empty(T, G, N, device=DEVICE))
    got = tgemv.gemv(x, w, y=y)
    assert got is y
    torch.testing.assert_close(got.double().cpu(), oracle(x, w), **tol(torch.float32))


def test_gemv_kernel_at_the_default_tile(tol):
    # enough rows that the launch keeps DEFAULT_CONFIG's 8-row tile (small tests shrink it)
    x, w = make_case(1, 1, 8 * 264, 96, device=DEVICE)
    y, spec = tgemv.gemv_launch(x, w)
    assert spec.meta["BLOCK_N"] == tgemv.DEFAULT_CONFIG["rows"] == 8
    torch.testing.assert_close(tgemv.gemv(x, w).double().cpu(), oracle(x, w), **tol(torch.float32))


def test_gemv_kernel_in_bf16_rounds_once():
    x, w = make_case(2, 1, 48, 200, device=DEVICE, dtype=torch.bfloat16)
    got = tgemv.gemv(x, w).cpu()
    want = ref.gemv(x, w).cpu()
    # fp32 accumulation in another order, one rounding to bf16: at most one bf16 ulp apart
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-6).all()


def test_gemv_launch_spreads_narrow_projections():
    # a narrow projection still gives every multiprocessor two programs (fewer rows per program)
    meta = dict(device="meta")
    x, w = torch.empty(1, 1, 4096, **meta), torch.empty(1, 512, 4096, **meta)
    _, spec = tgemv.gemv_launch(x, w)
    assert spec.meta["BLOCK_N"] == 1 and spec.grid == (512, 1)
    _, spec = tgemv.gemv_launch(x, torch.empty(1, 32768, 4096, **meta))
    assert spec.meta["BLOCK_N"] == 8 and spec.meta["BLOCK_K"] == 512 and spec.meta["TOKENS"] == 1
    _, spec = tgemv.gemv_launch(torch.empty(8, 1, 4096, **meta), torch.empty(1, 32768, 4096, **meta))
    assert spec.meta["TOKENS"] == 8 and spec.meta["BLOCK_K"] == 64  # the same registers for 8 tokens


@pytest.mark.parametrize("name, rows, k, takes_kernel", [
    ("q_a", 1024, 4096, True), ("q_b", 32768, 1024, False), ("kv", 512, 4096, True), ("o_a (8 groups)", 8192, 4096, True),
    ("o_b", 4096, 8192, True), ("shared down", 4096, 2048, True), ("indexer q_b", 8192, 1024, False),
    ("indexer weights", 64, 4096, False)])
def test_which_v4_flash_projections_take_the_kernel(monkeypatch, name, rows, k, takes_kernel):
    # the measured choice (BENCHMARKS.md) at V4-Flash widths, one bf16 decode token on a Triton device
    monkeypatch.setattr(gemv_op, "use_triton", lambda t: True)
    G = 8 if name.startswith("o_a") else 1
    meta = dict(dtype=torch.bfloat16, device="meta")
    x, w = torch.empty(1, G, k, **meta), torch.empty(G, rows // G, k, **meta)
    assert gemv_op.takes_kernel(x, w) == takes_kernel
    assert not gemv_op.takes_kernel(x.expand(2, G, k), w)  # two tokens: cuBLAS
    # a sliced, non-contiguous weight would be copied every call: cuBLAS reads it in place
    wide = torch.empty(G, rows // G, 2 * k, **meta)
    assert not gemv_op.takes_kernel(x, wide[..., :k])
    monkeypatch.setattr(gemv_op, "use_triton", lambda t: False)  # CPU, or the reference backend
    assert not gemv_op.takes_kernel(x, w)
