"""The backend is chosen once at import from the environment and the visible devices, and every
op body honours it: CUDA tensors take the Triton kernels only when the backend is ``triton``; the
Triton branch of every op body launches its kernels through ``wrap_triton`` and (run under the
interpreter on CPU) matches the reference op."""
import sys
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import dsv4_ops  # noqa: F401  (registers the ops)
from dsv4_ops import lowering
from dsv4_ops.lowering import BACKEND, select_backend
from dsv4_ops.reference import ops as ref
from launchers import DEVICE, i32, rope_tables


def test_default_is_triton_on_gpu_and_reference_on_cpu():
    assert select_backend(None, gpu_available=True) == "triton"
    assert select_backend(None, gpu_available=False) == "reference"
    assert select_backend("auto", gpu_available=True) == "triton"


def test_env_override_wins():
    assert select_backend("reference", gpu_available=True) == "reference"
    assert select_backend(" Triton ", gpu_available=False) == "triton"


def test_bad_env_value_names_the_variable():
    with pytest.raises(ValueError, match="DSV4_OPS_BACKEND"):
        select_backend("cudnn", gpu_available=True)


def test_this_process_resolved_a_valid_backend():
    assert BACKEND in ("triton", "reference")


# --------------------------------------------------------------------------------------
# the ops honour the selection: the static device branch of every op body
# --------------------------------------------------------------------------------------


def test_use_triton_only_for_cuda_tensors_with_the_triton_backend(monkeypatch):
    monkeypatch.setattr(lowering, "BACKEND", "triton")
    assert lowering.use_triton("cuda") and not lowering.use_triton("cpu") and not lowering.use_triton("meta")
    monkeypatch.setattr(lowering, "BACKEND", "reference")
    assert not lowering.use_triton("cuda") and not lowering.use_triton("cpu")


OP_MODULES = ("plan", "cache_write", "compressor", "indexer", "attention")  # dsv4_ops/ops/<module>.py


def _plan_shapes(lengths, n_new, S, steps, W, win_ring, win_concat, csa_m, csa_ring, hca_m, hca_ring):
    B = lengths.shape[0]
    return [(steps, B, S)] * 2 + [(steps, B, S, W)] + [
        s for m in (csa_m, hca_m) for s in ((steps, B, S), (steps, B, -(-S // m)), (steps, B, S))]


# op -> output of the right shape (no math: the point is which branch runs)
RESULTS = {
    "plan": lambda *a: tuple(a[0].new_empty(s, dtype=torch.int32) for s in _plan_shapes(*a)),
    "cache_write": lambda *a: None,
    "compress": lambda *a: None,
    "indexer_topk": lambda q, w, k, v, topk, block_table=None: q.new_empty((*v.shape, topk), dtype=torch.int32),
    "sparse_attention": lambda q, *a: q.new_empty(q.shape),
}
# op -> the kernels its Triton branch launches for the inputs of call_every_op
KERNELS = {"plan": ["plan_kernel"], "cache_write": ["cache_write_kernel"], "compress": ["compress_kernel"],
           "indexer_topk": ["indexer_scores_kernel", "topk_row_kernel"],
           "sparse_attention": ["sparse_attention_kernel"]}


class Spy:
    """Records which branch each op body takes: ``wrap_triton`` in each op module records the
    kernel it wraps (and launches nothing), ``reference`` stands in for the ops' ``ref`` module
    and returns outputs of the right shape. No kernel and no GPU is needed (and the reference
    never builds CUDA tensors on a CPU-only torch)."""

    def __init__(self, monkeypatch):
        self.calls = []

        def recorder(name):
            def fn(*args):
                self.calls.append(("reference", name))
                return RESULTS[name](*args)
            return fn

        def wrap_triton(kernel):
            self.calls.append(("triton", kernel.fn.__name__))
            return _NoLaunch()

        self.reference = types.SimpleNamespace(**{n: recorder(n) for n in RESULTS})
        for module in OP_MODULES:
            monkeypatch.setattr(sys.modules[f"dsv4_ops.ops.{module}"], "ref", self.reference)
            monkeypatch.setattr(sys.modules[f"dsv4_ops.ops.{module}"], "wrap_triton", wrap_triton)

    def branches(self):
        return {kind for kind, _ in self.calls}, sorted(name for _, name in self.calls)


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **meta: None


def call_every_op(device):
    """Each torch.ops.dsv4 op once, on tensors of ``device`` (fake CUDA tensors need no GPU)."""
    i32 = dict(dtype=torch.int32, device=device)
    B, S, H, D, d = 2, 4, 2, 8, 8
    p = torch.ops.dsv4.plan(torch.zeros(B, **i32), torch.ones(B, **i32), S, 1, 2, 8, False, 4, 8, 8, 8)
    assert [tuple(t.shape) for t in p] == [(1, B, S)] * 2 + [(1, B, S, 2), (1, B, S), (1, B, 1), (1, B, S),
                                                                 (1, B, S), (1, B, 1), (1, B, S)]
    cache = torch.zeros(B, 8, d, device=device)
    torch.ops.dsv4.cache_write(cache, torch.ones(B, S, d, device=device), torch.zeros(B, S, **i32))
    ring = torch.zeros(B, 8, 2 * d, device=device)
    new = torch.ones(B, S, 2 * d, device=device)
    torch.ops.dsv4.compress(ring, ring, new, new, torch.zeros(B, **i32), torch.zeros(B, 1, **i32),
                            torch.ones(d, device=device), torch.ones(16, 2, device=device),
                            torch.zeros(16, 2, device=device), cache, 4, True, 1e-6)
    q = torch.ones(B, S, H, D, device=device)
    picked = torch.ops.dsv4.indexer_topk(q, torch.ones(B, S, H, device=device), torch.ones(B, 8, D, device=device),
                                         torch.full((B, S), 3, **i32), 2)
    assert picked.shape == (B, S, 2) and picked.dtype == torch.int32
    out = torch.ops.dsv4.sparse_attention(q, torch.ones(B, 8, D, device=device), torch.zeros(B, S, 2, **i32),
                                          torch.ones(B, 8, D, device=device), picked, torch.zeros(B, S, **i32),
                                          torch.zeros(H, device=device), 0.5)
    assert out.shape == q.shape and out.device.type == torch.device(device).type


EVERY_OP = sorted(RESULTS)


def test_cuda_tensors_take_the_triton_kernels_when_the_backend_is_triton(monkeypatch):
    spy = Spy(monkeypatch)
    monkeypatch.setattr(lowering, "BACKEND", "triton")
    with FakeTensorMode():  # fake CUDA tensors: the op bodies run (they are also the fakes)
        call_every_op("cuda")
    assert spy.branches() == ({"triton"}, sorted(k for op in EVERY_OP for k in KERNELS[op]))


def test_backend_reference_keeps_cuda_tensors_on_the_reference(monkeypatch):
    spy = Spy(monkeypatch)
    monkeypatch.setattr(lowering, "BACKEND", "reference")
    with FakeTensorMode():
        call_every_op("cuda")
    assert spy.branches() == ({"reference"}, EVERY_OP)


def test_cpu_tensors_take_the_reference_whatever_the_backend(monkeypatch):
    spy = Spy(monkeypatch)
    monkeypatch.setattr(lowering, "BACKEND", "triton")
    call_every_op("cpu")
    assert spy.branches() == ({"reference"}, EVERY_OP)


# --------------------------------------------------------------------------------------
# the Triton branch of every op body, run (under the interpreter on CPU)
# --------------------------------------------------------------------------------------
BODY_KERNELS = dict(KERNELS, sinkhorn=["sinkhorn_kernel"])  # the kernels each body launches for _op_inputs
MODULE_OF = {"plan": "plan", "cache_write": "cache_write", "compress": "compressor", "indexer_topk": "indexer",
             "sparse_attention": "attention", "sinkhorn": "sinkhorn"}  # op -> dsv4_ops/ops/<module>.py


def _op_inputs():
    """Small inputs for every torch.ops.dsv4 op: (name, args), each with -1 sentinels."""
    cos, sin = rope_tables(32, 4)
    cache, values, slots = torch.randn(2, 6, 8, device=DEVICE), torch.randn(2, 2, 8, device=DEVICE), \
        i32([[0, 5], [-1, 2]])
    ring = [torch.randn(2, 8, 32, device=DEVICE) for _ in range(2)]
    new = [torch.randn(2, 2, 32, device=DEVICE) for _ in range(2)]
    compress = (*ring, *new, i32([6, 2]), i32([[1], [0]]), torch.rand(16, device=DEVICE) + 0.5, cos, sin,
                torch.randn(2, 4, 16, device=DEVICE), 4, True, 1e-6)
    q = torch.randint(-2, 3, (2, 2, 4, 32), device=DEVICE).float()
    keys = torch.randint(-2, 3, (2, 40, 32), device=DEVICE).float()
    indexer = (q, torch.randint(1, 3, (2, 2, 4), device=DEVICE).float(), keys, i32([[40, 3], [0, 17]]), 8)
    attention = (torch.randn(2, 2, 4, 64, device=DEVICE), torch.randn(2, 12, 64, device=DEVICE),
                 i32([[[0, 11, -1], [3, -1, 5]], [[7, 7, 2], [-1, -1, -1]]]), torch.randn(2, 10, 64, device=DEVICE),
                 i32([[[9, -1], [0, 1]], [[-1, -1], [4, 2]]]), i32([[3, 0], [10, 2]]), torch.randn(4, device=DEVICE),
                 0.125)
    return {"plan": (i32([3, 9]), i32([2, 1]), 2, 1, 4, 6, False, 4, 8, 8, 8),
            "cache_write": (cache, values, slots), "compress": compress, "indexer_topk": indexer,
            "sparse_attention": attention, "sinkhorn": (torch.rand(3, 2, 4, 4, device=DEVICE) + 0.1, 20, 1e-6)}


def test_op_bodies_launch_their_kernels_through_wrap_triton(monkeypatch, tol):
    """The Triton branch of every op body (CPU tensors take it here, under the interpreter)
    launches its kernels through ``wrap_triton`` and matches the reference op."""
    monkeypatch.setattr(lowering, "use_triton", lambda device_type: True)
    launched = []
    for op, module in MODULE_OF.items():
        mod = sys.modules[f"dsv4_ops.ops.{module}"]

        def spy(kernel, real=mod.wrap_triton):
            launched.append(kernel.fn.__name__)
            return real(kernel)

        monkeypatch.setattr(mod, "wrap_triton", spy)
    for op, args in _op_inputs().items():
        launched.clear()
        mine = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        want = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        got = getattr(torch.ops.dsv4, op)(*mine)
        expect = getattr(ref, op)(*want)
        assert launched == BODY_KERNELS[op], op
        for g, w in zip(got if isinstance(got, tuple) else [got] + mine, expect if isinstance(expect, tuple)
                        else [expect] + want):
            if isinstance(g, torch.Tensor):
                torch.testing.assert_close(g, w, **tol(torch.float32), msg=lambda m: f"{op}: {m}")
