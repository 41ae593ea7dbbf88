"""What an eager call of each op does on its hot path (#47), counted, never timed: a public wrapper
runs its metadata checks once per signature (shapes, dtypes, devices, static ints) and still
rejects bad values on a signature it has seen; its value checks read the host once a call (none
for the ops without value checks), none inside ``ops.value_checks(False)``, where a bad value reaches the raw op,
which handles it as documented; the raw ``torch.ops.dsv4`` ops, what the model calls, read
nothing back (on CUDA: no sync, under ``torch.cuda.set_sync_debug_mode("error")``); launch
configurations are memoised, each call getting its own dict; a body's shape checks that hold on plain ints skip
``torch._check`` (a traced body's symbolic ones go through it). Also a smoke run of
benchmarks/bench_op_overhead.py."""
import argparse
import contextlib
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

import dsv4_ops
from dsv4_ops import ops
from dsv4_ops.lowering.triton import sparse_attention as sa
from dsv4_ops.lowering.triton.launch import cached_config
from dsv4_ops.ops import direct, validate

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` is a package at the repo root
from benchmarks import bench_op_overhead as bench  # noqa: E402

CPU = torch.device("cpu")
VALUE_CHECKED = ("plan", "cache_write", "compress", "indexer_topk", "sparse_attention", "moe_gemv")


@pytest.fixture
def no_seen_signatures(monkeypatch):
    monkeypatch.setattr(validate, "_passed_signatures", set())


def counting_metadata_checks(op: str, monkeypatch) -> list:
    """Count the calls of ``op``'s metadata checks (its module's ``_check_arguments``)."""
    module = sys.modules[getattr(ops, op).__module__]
    calls, real = [], module._check_arguments

    def counted(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(module, "_check_arguments", counted)
    return calls


@pytest.mark.parametrize("op", bench.OPS)
def test_metadata_checks_run_once_per_signature(op, monkeypatch, no_seen_signatures):
    calls = counting_metadata_checks(op, monkeypatch)
    wrapper = getattr(ops, op)
    one_row = bench.op_inputs(op, 1, torch.float32, CPU)
    wrapper(*one_row)
    wrapper(*bench.op_inputs(op, 1, torch.float32, CPU))  # new tensors, the same signature
    assert len(calls) == 1
    wrapper(*bench.op_inputs(op, 2, torch.float32, CPU))  # another batch: checked
    wrapper(*one_row)
    assert len(calls) == 2


def test_metadata_checks_fail_every_time_and_a_failed_signature_is_not_remembered(no_seen_signatures):
    args = list(bench.op_inputs("sparse_attention", 1, torch.float32, CPU))
    dsv4_ops.sparse_attention(*args)
    args[2] = args[2].long()
    for _ in range(2):
        with pytest.raises(ValueError, match=r"sparse_attention: kv_idx must be torch.int32, got torch.int64"):
            dsv4_ops.sparse_attention(*args)


def test_a_seen_signature_still_rejects_bad_values(no_seen_signatures):
    args = list(bench.op_inputs("sparse_attention", 1, torch.float32, CPU))
    dsv4_ops.sparse_attention(*args)
    args[2] = args[2].clone()
    args[2][0, 0, 3] = 16  # the window ring has 16 rows
    with pytest.raises(ValueError, match=r"kv_idx\[0, 0, 3\] = 16 is beyond kv rows N=16 \(valid: -1 or 0..15\)"):
        dsv4_ops.sparse_attention(*args)
    slots_args = list(bench.op_inputs("cache_write", 2, torch.float32, CPU))
    dsv4_ops.cache_write(*slots_args)
    slots_args[2] = torch.tensor([[3], [-2]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cache_write: slots\[1, 0\] = -2 is below the minimum -1"):
        dsv4_ops.cache_write(*slots_args)


@pytest.mark.parametrize("op", bench.OPS)
def test_wrapper_reads_the_host_once_a_call_for_its_value_checks(op):
    args = bench.op_inputs(op, 2, torch.float32, CPU)
    wrapper = getattr(ops, op)
    wrapper(*args)
    counts = {}
    with bench.counting_host_reads(counts):
        wrapper(*args)
    assert counts == ({"tolist": 1} if op in VALUE_CHECKED else {})


@pytest.mark.parametrize("op", VALUE_CHECKED)
def test_with_value_checks_off_a_wrapper_reads_nothing_and_writes_the_raw_ops_bits(op):
    args = bench.op_inputs(op, 2, torch.float32, CPU)
    copies = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    wrapper = getattr(ops, op)
    counts = {}
    with ops.value_checks(False), bench.counting_host_reads(counts):
        got = wrapper(*args)
    want = getattr(torch.ops.dsv4, op)(*copies)
    assert counts == {}
    for g, w in zip(torch.utils._pytree.tree_leaves((got, args)), torch.utils._pytree.tree_leaves((want, copies))):
        if isinstance(g, torch.Tensor):
            assert torch.equal(g, w)  # outputs and mutated arguments alike


def test_with_value_checks_off_a_bad_index_reaches_the_raw_op_and_metadata_is_still_checked(no_seen_signatures):
    args = list(bench.op_inputs("sparse_attention", 1, torch.float32, CPU))
    args[2] = args[2].clone()
    args[2][0, 0, 3] = 16  # past the window ring's 16 rows: the raw op skips it like -1
    with ops.value_checks(False):
        got = dsv4_ops.sparse_attention(*args)
        with pytest.raises(ValueError, match=r"sparse_attention: kv_idx must be torch.int32, got torch.int64"):
            dsv4_ops.sparse_attention(*args[:2], args[2].long(), *args[3:])
    skipped = args[2].clone()
    skipped[0, 0, 3] = -1
    assert torch.equal(got, torch.ops.dsv4.sparse_attention(*args[:2], skipped, *args[3:]))
    with pytest.raises(ValueError, match=r"kv_idx\[0, 0, 3\] = 16 is beyond kv rows N=16"):
        dsv4_ops.sparse_attention(*args)  # on again after the block


def test_value_checks_come_back_on_after_an_exception_and_take_only_a_bool():
    args = list(bench.op_inputs("cache_write", 2, torch.float32, CPU))
    args[2] = torch.tensor([[3], [-2]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="inside"):
        with ops.value_checks(False):
            ops.cache_write(*args)  # unchecked: the raw op skips slot -2
            raise RuntimeError("inside")
    with pytest.raises(ValueError, match=r"cache_write: slots\[1, 0\] = -2 is below the minimum -1"):
        ops.cache_write(*args)
    with pytest.raises(ValueError, match=r"value_checks: enabled must be a bool, got 0"):
        with ops.value_checks(0):
            pass


def test_a_compiled_wrapper_does_not_recompile_when_value_checks_switch():
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    compiled = torch.compile(lambda *a: ops.cache_write(*a), backend=counter, fullgraph=True)
    args = bench.op_inputs("cache_write", 1, torch.float32, CPU)
    compiled(*args)
    with ops.value_checks(False):
        compiled(*args)
    compiled(*args)
    assert counter.frame_count == 1


@pytest.mark.parametrize("op", bench.OPS)
def test_raw_op_reads_nothing_back(op):
    args = bench.op_inputs(op, 2, torch.float32, CPU)
    raw = getattr(torch.ops.dsv4, op)
    raw(*args)
    counts = {}
    with bench.counting_host_reads(counts):
        raw(*args)
    assert counts == {}


@pytest.mark.gpu
@pytest.mark.parametrize("op", bench.OPS)
def test_raw_op_never_syncs_on_cuda(op):
    args = bench.op_inputs(op, 1, torch.bfloat16, torch.device("cuda"))
    raw = getattr(torch.ops.dsv4, op)
    raw(*args)  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        raw(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("op", VALUE_CHECKED)
def test_a_wrapper_with_value_checks_off_never_syncs_on_cuda(op):
    args = bench.op_inputs(op, 1, torch.bfloat16, torch.device("cuda"))
    wrapper = getattr(ops, op)
    wrapper(*args)  # compiles the kernels, checks the metadata
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with ops.value_checks(False):
            wrapper(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("op", bench.OPS)
def test_the_bench_replays_the_ops_launches_through_the_compiled_launchers_with_the_same_bits(op):
    """bench_op_overhead's launch rows: Triton's JIT and the compiled kernels' launchers write the same bits."""
    device = torch.device("cuda")
    rows = bench.launch_rows(op, bench.op_inputs(op, 1, torch.bfloat16, device), device,
                             argparse.Namespace(calls=3, repeats=1))
    assert [r["entry"] for r in rows] in ([], ["triton jit", "jit binder", "compiled launcher"])
    assert all(r["same_bits"] for r in rows)
    assert rows or op == "gemv"  # only the F.linear route launches no Triton kernel at these widths


def test_launch_configs_are_memoised_and_each_call_gets_its_own_dict():
    first = sa.attention_config(1, 1, 64, 512, 640, 132, None, "cuda", torch.bfloat16)
    first["NUM_SPLITS"] = 99  # what attention_launches does with a num_splits override
    again = sa.attention_config(1, 1, 64, 512, 640, 132, None, "cuda", torch.bfloat16)
    assert again["NUM_SPLITS"] != 99 and again is not first
    assert sa.attention_config.__wrapped__(1, 1, 64, 512, 640, 132, None, "cuda", torch.bfloat16) == again
    calls = []

    @cached_config
    def config(n):
        calls.append(n)
        return {"n": n}

    assert config(3) == config(3) == {"n": 3} and calls == [3]
    assert config([4]) == {"n": [4]}  # unhashable (a SymInt while tracing): computed afresh


def test_bench_op_overhead_cpu_smoke(tmp_path):
    out = tmp_path / "overhead.json"
    assert bench.main(["--device", "cpu", "--ops", "plan", "gemv", "--calls", "3", "--repeats", "1",
                       "--breakdown", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["op"], r["entry"]) for r in rows] == [(op, entry) for op in ("plan", "gemv")
                                                      for entry in ("wrapper", "unchecked", "direct", "raw", "checks")] + \
        [(op, "baseline") for op in ("torch.add", "F.linear", "torch.empty")]
    assert all(r["host_us"] > 0 and r["host_us_best"] <= r["host_us"] and r["cpu_us"] >= 0 for r in rows)
    assert isinstance(direct.dsv4.plan, direct.DirectOp)  # the checks row's stub is gone
    assert {r["route"] for r in rows} == {"reference (aten)", "F.linear", "aten"}
    profiled = [r for r in rows if "breakdown" in r]
    assert len(profiled) == 1 and profiled[0]["breakdown"]["us_by_part"]


# ---- the model's calls: the op's body in plain eager calls, the registered op where anything watches --------------
@contextlib.contextmanager
def counting_dispatched(op: str):
    """Count the calls of ``op`` that ``direct.dsv4`` routes through the registered op (the dispatcher)."""
    direct_op, calls = getattr(direct.dsv4, op), []
    real = direct_op.op

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    direct_op.op = counted
    try:
        yield calls
    finally:
        direct_op.op = real


@pytest.mark.parametrize("grad_mode", [torch.inference_mode, torch.no_grad])
@pytest.mark.parametrize("op", bench.OPS)
def test_plain_eager_calls_run_the_body_with_the_registered_ops_bits(op, grad_mode):
    with grad_mode():
        args = bench.op_inputs(op, 2, torch.float32, CPU)
        copies = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        with counting_dispatched(op) as calls:
            got = getattr(direct.dsv4, op)(*args)
        want = getattr(torch.ops.dsv4, op)(*copies)
    assert calls == []
    for g, w in zip(torch.utils._pytree.tree_leaves((got, args)), torch.utils._pytree.tree_leaves((want, copies))):
        if isinstance(g, torch.Tensor):
            assert torch.equal(g, w)  # outputs and mutated arguments alike


def test_a_mutating_call_bumps_the_mutated_arguments_version_once_as_adinplaceorview_does():
    # autograd compares a saved tensor's version with its current one; a write it cannot see is a silent wrong gradient.
    # The dispatched call bumps at least once (torch 2.11 once; 2.13 once more from the body's own in-place ops).
    with torch.no_grad():
        cache, values, slots = bench.op_inputs("cache_write", 1, torch.float32, CPU)
        before = cache._version
        direct.dsv4.cache_write(cache, values, slots)
        assert cache._version - before == 1
        before = cache._version
        torch.ops.dsv4.cache_write(cache, values, slots)
        assert cache._version - before >= 1


def test_calls_that_something_watches_go_through_the_registered_op():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode

    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x, w = torch.randn(1, 1, 32), torch.randn(1, 8, 32)
    with counting_dispatched("gemv") as calls:
        with torch.inference_mode():
            direct.dsv4.gemv(x, w)
        assert len(calls) == 0
        with Passing():
            direct.dsv4.gemv(x, w)
        assert len(calls) == 1
        with FakeTensorMode() as mode:
            direct.dsv4.gemv(mode.from_tensor(x), mode.from_tensor(w))
        assert len(calls) == 2
        with warnings.catch_warnings():  # the op has no autograd formula: the dispatcher warns
            warnings.simplefilter("ignore")
            direct.dsv4.gemv(x, w.requires_grad_())
        assert len(calls) == 3
        direct.dsv4.gemv(x, w.detach())  # grad enabled, nothing requires it: the body
        assert len(calls) == 3
        with torch.no_grad():
            direct.dsv4.gemv(x, torch.nn.Parameter(w.detach()))  # a module's weight, as the model passes it: the body
        assert len(calls) == 3

        class Subclass(torch.Tensor):
            pass

        direct.dsv4.gemv(x.as_subclass(Subclass), w.detach())  # a tensor subclass may override anything: the op
        assert len(calls) == 4


def test_a_compiled_call_is_the_registered_op_in_the_graph():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x, w = torch.randn(1, 1, 32), torch.randn(1, 8, 32)
    got = torch.compile(lambda x, w: direct.dsv4.gemv(x, w) * 2, backend=backend, fullgraph=True)(x, w)
    assert torch.equal(got, torch.ops.dsv4.gemv(x, w) * 2)
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.dsv4.gemv in targets


def counting_torch_checks(monkeypatch) -> list:
    calls, real = [], torch._check

    def counted(cond, message=None):
        calls.append((cond, message))
        return real(cond, message)
    monkeypatch.setattr(torch, "_check", counted)
    return calls


def test_a_bodys_shape_check_that_holds_on_plain_ints_skips_torch_check_and_a_failing_one_raises_its_error(
        monkeypatch):
    from dsv4_ops.ops._backend import check
    calls = counting_torch_checks(monkeypatch)
    check(3 == 3, lambda: "never built")
    assert calls == []
    with pytest.raises(RuntimeError, match="cache_write: values must be"):
        check(2 == 3, lambda: "cache_write: values must be [B, S, D]")
    assert [c for c, _ in calls] == [False]
    cache, values, slots = bench.op_inputs("cache_write", 1, torch.float32, CPU)
    with pytest.raises(RuntimeError, match="cache_write"):
        torch.ops.dsv4.cache_write(cache, values[:, :, :-1], slots)  # the raw op's body rejects the shape


def test_a_traced_bodys_shape_checks_on_symbolic_sizes_go_through_torch_check(monkeypatch):
    torch._dynamo.reset()
    cache, values, slots = bench.op_inputs("cache_write", 2, torch.float32, CPU)
    calls = counting_torch_checks(monkeypatch)

    @torch.compile(backend="eager", fullgraph=True, dynamic=True)
    def step(cache, values, slots):
        torch.ops.dsv4.cache_write(cache, values, slots)

    step(cache, values, slots)
    torch._dynamo.reset()
    ours = [c for c, m in calls if getattr(m, "__code__", None) and m.__code__.co_filename.endswith("cache_write.py")]
    assert ours and any(isinstance(c, torch.SymBool) for c in ours)
