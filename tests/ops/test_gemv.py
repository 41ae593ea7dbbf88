"""dsv4::gemv: the model's dense projections — ``y[t, g] = weight[g] @ x[t, g]``; the Triton GEMV (one
weight read for a decode token) where it beats cuBLAS, ``F.linear`` / a grouped einsum elsewhere;
against a float64 oracle, against ``F.linear`` / the model's einsum, and (Triton kernel,
interpreter on CPU) against the reference; the model's projections all go through it."""
import importlib
import os

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import dsv4_ops
from dsv4_ops.model import linear
from dsv4_ops.reference import ops as ref

CUDA = torch.cuda.is_available()
if not CUDA:
    assert os.environ.get("TRITON_INTERPRET") == "1"  # set by conftest before triton loads
from test_triton_interp import _kernel_module  # noqa: E402

tgemv = _kernel_module("gemv")
gemv_op = importlib.import_module("dsv4_ops.ops.gemv")  # the module (dsv4_ops.ops.gemv is the function)


def make_case(T, G, N, K, device="cpu", dtype=torch.float32):
    x = torch.randn(T, G, K, device=device).to(dtype)
    w = (torch.randn(G, N, K, device=device) * max(K, 1)**-0.5).to(dtype)
    return x, w


def oracle(x, w):
    return torch.einsum("tgk,gnk->tgn", x.double().cpu(), w.double().cpu())


OPCHECK_CASES = {"decode_b1": (1, 1, 48, 32), "grouped": (2, 4, 16, 24), "eight_tokens": (8, 1, 8, 40)}


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_gemv_opcheck(case):
    opcheck(torch.ops.dsv4.gemv.default, make_case(*OPCHECK_CASES[case]))


def test_gemv_fake_matches_real(fake_check):
    for case in OPCHECK_CASES.values():
        for dtype in (torch.float32, torch.bfloat16):
            out = fake_check(torch.ops.dsv4.gemv.default, *make_case(*case, dtype=dtype))
            assert out.dtype == dtype and out.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gemv_matches_reference(device, dtype):
    x, w = make_case(3, 2, 40, 96, device=device, dtype=dtype)
    out = dsv4_ops.ops.gemv(x, w)
    assert out.shape == (3, 2, 40) and out.dtype == dtype
    torch.testing.assert_close(out.cpu(), ref.gemv(x, w).cpu(), atol=1e-5, rtol=1e-5 if dtype == torch.float32 else 1e-2)
    # one group is F.linear; the reference itself against the unrounded float64 oracle
    torch.testing.assert_close(ref.gemv(x[:, :1], w[:1]), F.linear(x[:, 0], w[0])[:, None], atol=1e-5, rtol=1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double().cpu(), oracle(x, w), atol=1e-5, rtol=1e-5)


def test_gemv_edge_cases(device):
    x, w = make_case(0, 1, 16, 8, device=device)  # no tokens
    assert dsv4_ops.ops.gemv(x, w).shape == (0, 1, 16)
    x, w = make_case(2, 1, 16, 0, device=device)  # K = 0: exactly zero
    assert torch.equal(dsv4_ops.ops.gemv(x, w), torch.zeros(2, 1, 16, device=device))
    x, w = make_case(2, 3, 5, 7, device=device)  # widths no block divides
    torch.testing.assert_close(dsv4_ops.ops.gemv(x, w).double().cpu(), oracle(x, w), atol=1e-5, rtol=1e-5)
    for G in (1, 3):  # past the kernel's 8 tokens: the GEMM path, same contract
        x, w = make_case(40, G, 24, 32, device=device)
        torch.testing.assert_close(dsv4_ops.ops.gemv(x, w).double().cpu(), oracle(x, w), atol=1e-5, rtol=1e-5)


def test_gemv_rejects_bad_input():
    x, w = make_case(2, 2, 8, 16)
    with pytest.raises(ValueError, match=r"gemv: x must have rank 3 \[T, G, K\]"):
        dsv4_ops.ops.gemv(x[0], w)
    with pytest.raises(ValueError, match=r"gemv: weight.shape\[2\] must be 16 \(K of x\), got 15"):
        dsv4_ops.ops.gemv(x, w[..., :15])
    with pytest.raises(ValueError, match=r"gemv: weight.shape\[0\] must be 2 \(G of x\), got 1"):
        dsv4_ops.ops.gemv(x, w[:1])
    with pytest.raises(ValueError, match="gemv: weight must have the dtype of x"):
        dsv4_ops.ops.gemv(x, w.bfloat16())
    with pytest.raises(ValueError, match="gemv: x must be a floating-point tensor"):
        dsv4_ops.ops.gemv(x.int(), w.int())


# ---- the Triton kernel itself (interpreter on CPU) ----------------------------------------
@pytest.mark.parametrize("T, G, N, K", [(1, 1, 64, 1024), (3, 2, 20, 300), (8, 1, 33, 130), (5, 8, 12, 64)],
                         ids=["decode_two_k_blocks", "odd_widths", "eight_tokens", "grouped_o_a"])
def test_gemv_kernel_matches_reference(T, G, N, K, poison):
    dev = torch.device("cuda" if CUDA else "cpu")
    x, w = make_case(T, G, N, K, device=dev)
    y = poison(torch.empty(T, G, N, device=dev))
    got = tgemv.gemv(x, w, y=y)
    assert got is y
    torch.testing.assert_close(got.double().cpu(), oracle(x, w), atol=1e-5, rtol=1e-5)


def test_gemv_kernel_at_the_default_tile():
    # enough rows that the launch keeps DEFAULT_CONFIG's 8-row tile (small tests shrink it)
    dev = torch.device("cuda" if CUDA else "cpu")
    x, w = make_case(1, 1, 8 * 264, 96, device=dev)
    y, spec = tgemv.gemv_launch(x, w)
    assert spec.meta["BLOCK_N"] == tgemv.DEFAULT_CONFIG["rows"] == 8
    torch.testing.assert_close(tgemv.gemv(x, w).double().cpu(), oracle(x, w), atol=1e-5, rtol=1e-5)


def test_gemv_kernel_in_bf16_rounds_once():
    dev = torch.device("cuda" if CUDA else "cpu")
    x, w = make_case(2, 1, 48, 200, device=dev, dtype=torch.bfloat16)
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


# ---- the model's projections go through the op, which takes the kernel where it pays ---------
def test_projections_run_the_op_and_get_what_f_linear_gets(monkeypatch):
    torch.manual_seed(0)
    lin = linear.Linear(32, 256, bias=False)
    w_a = torch.randn(4, 64, 16)
    calls = []
    real = torch.ops.dsv4.gemv

    def spy(*args):
        calls.append(tuple(a.shape for a in args))
        return real(*args)

    one, many, grouped = torch.randn(1, 1, 32), torch.randn(2, 3, 32), torch.randn(1, 1, 4, 16)
    with torch.no_grad():
        want_one, want_many = F.linear(one, lin.weight), F.linear(many, lin.weight)
        want_grouped = torch.einsum("bsgk,gnk->bsgn", grouped, w_a)
        monkeypatch.setattr(torch.ops.dsv4, "gemv", spy, raising=False)
        assert torch.equal(lin(one), want_one) and torch.equal(lin(many), want_many)  # F.linear's bits
        assert calls == [((1, 1, 32), (1, 256, 32)), ((6, 1, 32), (1, 256, 32))]
        torch.testing.assert_close(linear.grouped_linear(grouped, w_a), want_grouped, atol=1e-5, rtol=1e-5)
        assert calls[-1] == ((1, 4, 16), (4, 64, 16))
        assert linear.Linear(32, 8, bias=True)(one).shape == (1, 1, 8) and len(calls) == 3  # a bias: F.linear
    lin(one)  # autograd needs a graph through the weight: F.linear, never the op
    assert len(calls) == 3


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


@pytest.mark.gpu
def test_gemv_matches_cublas_at_flash_widths():
    # the decode projections of V4-Flash in bf16: the op vs F.linear (cuBLAS) and the reference
    torch.manual_seed(0)
    for N, K in ((1024, 4096), (32768, 1024), (512, 4096), (4096, 8192), (2048, 4096)):
        x, w = make_case(1, 1, N, K, device="cuda", dtype=torch.bfloat16)
        got = dsv4_ops.ops.gemv(x, w)
        cublas = F.linear(x[:, 0], w[0])[:, None]
        scale = cublas.float().abs().max()
        assert (got.float() - cublas.float()).abs().max() <= 1e-2 * scale, (N, K)
        assert (got.float() - oracle(x, w).cuda()).abs().max() <= 1e-2 * scale, (N, K)
    x, w = make_case(1, 8, 1024, 4096, device="cuda", dtype=torch.bfloat16)  # o_a: 8 groups
    torch.testing.assert_close(dsv4_ops.ops.gemv(x, w).float(), oracle(x, w).cuda().float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_compiled_projection_takes_gemv_and_matches_cublas():
    # the model's Linear on the GPU at decode: eager and fullgraph-compiled both run the op
    torch.manual_seed(0)
    lin = linear.Linear(4096, 2048, bias=False).cuda().bfloat16()
    x = torch.randn(1, 1, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        eager, cublas = lin(x), F.linear(x, lin.weight)
        compiled = torch.compile(lin, fullgraph=True)(x)
        direct = torch.ops.dsv4.gemv(x.view(1, 1, 4096), lin.weight.unsqueeze(0)).view(1, 1, 2048)
    assert torch.equal(eager, direct)  # eager took the op
    scale = cublas.float().abs().max()
    assert (eager.float() - cublas.float()).abs().max() <= 1e-2 * scale
    assert (compiled.float() - eager.float()).abs().max() <= 1e-2 * scale


@pytest.mark.gpu
def test_compiled_model_decode_with_gemv_matches_cublas_projections(monkeypatch):
    # widths where q_a, o_b, the shared experts and the MTP projections take the op (rows of
    # 2048 inputs); the same bf16 model, compiled + CUDA graphs, with the op and with cuBLAS
    # everywhere (the op's kernel rule off), fed the same tokens: the same logits up to bf16 rounding.
    # No discrete choice may differ between the two, or one flip moves the logits by far more than
    # rounding (session 27: with score-routed experts and an indexer picking 8 of 12 entries the
    # two runs' logits differed by 4.6% of their range): experts routed by token id (hash), and an
    # indexer width above the 12 CSA entries of 49 tokens, so every entry is picked.
    from dsv4_ops import DSV4Config, Generator
    from model_util import random_model

    cfg = DSV4Config.tiny(hidden_size=2048, q_lora_rank=512, o_lora_rank=1024, moe_intermediate_size=512,
                          mlp_layer_types=["hash_moe"] * 4, index_topk=16)
    m = random_model(cfg, dtype=torch.bfloat16, device="cuda")
    x = torch.empty(1, 1, 2048, dtype=torch.bfloat16, device="cuda")
    takes = {n for n, mod in m.named_modules() if isinstance(mod, linear.Linear)
             and gemv_op.takes_kernel(x[..., : mod.in_features], mod.weight.unsqueeze(0))}
    assert any("q_a_proj" in n for n in takes) and any("o_b_proj" in n for n in takes)
    prompts = [list(range(3, 40))]
    kw = dict(max_batch_size=1, max_seq_len=128, prefill_chunk=16)
    with_op = Generator(m, **kw)  # compiled (and captured) at its first prefill / decode, below
    want = [with_op.prefill(prompts)]
    ids = []
    for _ in range(12):
        ids.append(want[-1].argmax(-1))
        want.append(with_op.decode(ids[-1]))
    monkeypatch.setattr(gemv_op, "takes_kernel", lambda x, w: False)  # read while tracing: cuBLAS everywhere
    cublas = Generator(m, **kw)
    got = [cublas.prefill(prompts)] + [cublas.decode(i) for i in ids]
    for a, b in zip(want, got):
        assert (a.float() - b.float()).abs().max() <= 3e-2 * b.float().abs().max()
    # two paths ran: their accumulation orders differ, so some logits differ in the last bits
    assert any(not torch.equal(a, b) for a, b in zip(want, got))
