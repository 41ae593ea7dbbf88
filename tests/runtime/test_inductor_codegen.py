"""GPU box: under torch.compile every dsv4 op lowers to OUR Triton kernels inside Inductor's
generated code (triton_op + wrap_triton), with no "assuming every input is mutated" fallback, and
the compiled step matches eager and the CPU reference. The one opaque ``torch.ops.dsv4`` extern
call allowed is the CUDA top-k (``dsv4::topk_rows_cuda``, a C++ op that Inductor cannot inline:
``dsv4_ops/ops/topk_cuda.py``), and only where it applies; with that route off
(``DSV4_OPS_CUDA_TOPK=0``) the graph holds Triton kernels alone. (CPU keeps the reference path; that is
tests/ops/test_compile_ops.py.)"""
from __future__ import annotations

import contextlib
import logging
import re

import pytest
import torch

from dsv4_ops import lowering
from dsv4_ops.ops import topk_cuda
from layer_step import CSA_RING, S, TOPK, WIN_RING, csa_layer_step
from routes import triton_topk

pytestmark = pytest.mark.gpu

B, H, D, HI, DI = 2, 4, 64, 4, 32  # rows, heads, head dim (= pool d), indexer heads / dim
N, P, HALF = 16, 80, 8  # pool entries, rope rows, rope pairs

# Every kernel the step below must launch (by @triton.jit function name). The split-KV
# combine_kernel only runs for some static sizes, so it is not required. The Triton top-k
# (topk_row_kernel) runs where the CUDA top-k does not.
KERNELS = ("plan_kernel", "cache_write_kernel", "compress_kernel", "indexer_scores_kernel", "sparse_attention_kernel")
TRITON_TOPK = "topk_row_kernel"


def step(*args):
    """One CSA layer step through all five ops (``layer_step.csa_layer_step``), and the plan's index tensors."""
    out, picked, p = csa_layer_step(*args)
    return out, picked, p.positions, p.win_idx, p.csa_emit, p.hca_emit


def make_inputs(lengths, n_new, device):
    g = torch.Generator().manual_seed(sum(lengths) * 7 + sum(n_new))

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device)

    angle = torch.rand(P, HALF, generator=g) * 6.28
    inputs = [torch.tensor(lengths, dtype=torch.int32, device=device),
              torch.tensor(n_new, dtype=torch.int32, device=device),
              randn(B, S, H, D), randn(B, S, D), randn(B, S, 2 * D), randn(B, S, 2 * D),
              randn(B, S, HI, DI), randn(B, S, HI), randn(H), (torch.rand(D, generator=g) + 0.5).to(device),
              angle.cos().to(device), angle.sin().to(device)]
    # state buffers hold random "history" (integer-valued indexer keys: exact scores, stable picks)
    state = [randn(B, WIN_RING, D), randn(B, CSA_RING, 2 * D), randn(B, CSA_RING, 2 * D), randn(B, N, D),
             torch.randint(-2, 3, (B, N, DI), generator=g).float().to(device)]
    inputs[6] = torch.randint(-2, 3, (B, S, HI, DI), generator=g).float().to(device)
    inputs[7] = torch.randint(1, 3, (B, S, HI), generator=g).float().to(device)
    return inputs, state


def defines(code: str, kernel: str) -> bool:
    """The generated code holds ``kernel``'s source (its name alone also appears in other kernels' docstrings)."""
    return re.search(rf"\bdef {kernel}\(", code) is not None


@contextlib.contextmanager
def torch_warnings():
    """Collect WARNING records of torch's loggers (they may not propagate to the root logger)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(level=logging.WARNING)
    loggers = [logging.getLogger(n) for n in ("torch", "torch._dynamo", "torch._inductor", "torch._higher_order_ops")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield records
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cuda_topk", [True, False], ids=["cuda_topk", "triton_topk"])
def test_compiled_step_calls_our_triton_kernels_and_matches_eager(cuda_topk, tol):
    assert lowering.BACKEND == "triton", "run without DSV4_OPS_BACKEND=reference"
    from torch._inductor.utils import run_and_get_code

    dev = torch.device("cuda")
    if cuda_topk and not topk_cuda.applies((B, S, N), dev, TOPK):
        pytest.skip(f"the CUDA top-k does not apply here ({topk_cuda.unavailable_reason()}): only the Triton "
                    "top-k runs")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch._dynamo.reset()
    route = contextlib.nullcontext if cuda_topk else triton_topk  # (a fresh context for each case)
    # the only opaque calls the graph may hold, by op name
    opaque_ok = {"topk_rows_cuda"} if cuda_topk else set()
    kernels = KERNELS if cuda_topk else KERNELS + (TRITON_TOPK,)
    compiled = torch.compile(step, fullgraph=True)
    seen = set()
    for case, (lengths, n_new) in enumerate((([7, 30], [4, 1]), ([0, 12], [3, 0]))):
        inputs, state = make_inputs(lengths, n_new, dev)
        eager_state = [t.clone() for t in state]
        cpu_state = [t.cpu() for t in state]
        with torch_warnings() as warnings, torch._inductor.config.patch(force_disable_caches=True), route():
            if case == 0:
                got, codes = run_and_get_code(compiled, *inputs, *state)
                code = "\n".join(codes)
                assert codes, "Inductor produced no code"
                missing = [k for k in kernels if not defines(code, k)]
                assert not missing, f"kernels missing from the generated code: {missing}"
                opaque = set(re.findall(r"torch\.ops\.dsv4\.(\w+)", code))
                assert opaque == opaque_ok, f"opaque extern calls {sorted(opaque)}, expected {sorted(opaque_ok)}"
                if cuda_topk:
                    assert not defines(code, TRITON_TOPK), "the Triton top-k ran beside the CUDA one"
                seen.update(k for k in kernels if defines(code, k))
            else:  # new lengths, same shapes: the same graph
                got = compiled(*inputs, *state)
        mutated = [r.getMessage() for r in warnings if "assuming every input is mutated" in r.getMessage()]
        assert not mutated, mutated
        want = step(*inputs, *eager_state)  # eager on CUDA: the same kernels, launched directly
        ref = step(*[t.cpu() for t in inputs], *cpu_state)  # the plain-aten reference on CPU
        for name, g, w, r in zip(("out", "picked", "positions", "win_idx", "csa_emit", "hca_emit"), got, want, ref):
            torch.testing.assert_close(g, w, **tol("compiled_vs_eager_fp32"), msg=lambda m: f"{name} vs eager: {m}")
            torch.testing.assert_close(g.cpu(), r, **tol("cuda_step_vs_cpu_reference"),
                                       msg=lambda m: f"{name} vs reference: {m}")
        for name, g, w, r in zip(("win", "ring_kv", "ring_gate", "pool"), state, eager_state, cpu_state):
            torch.testing.assert_close(g, w, **tol("compiled_vs_eager_fp32"),
                                       msg=lambda m: f"state {name} vs eager: {m}")
            torch.testing.assert_close(g.cpu(), r, **tol("cuda_step_vs_cpu_reference"),
                                       msg=lambda m: f"state {name} vs reference: {m}")
    assert seen == set(kernels)
