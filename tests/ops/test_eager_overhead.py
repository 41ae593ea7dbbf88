"""What an eager call of each op does on its hot path (#47), counted, never timed: a public wrapper
runs its metadata checks once per signature (shapes, dtypes, devices, static ints) and still
rejects bad values on a signature it has seen; its value checks read the host once a call (none
for the ops without value checks); the raw ``torch.ops.dsv4`` ops, what the model calls, read
nothing back (on CUDA: no sync, under ``torch.cuda.set_sync_debug_mode("error")``); launch
configurations are memoised, each call getting its own dict. Also a smoke run of
benchmarks/bench_op_overhead.py."""
import json
import sys
from pathlib import Path

import pytest
import torch

import dsv4_ops
from dsv4_ops import ops
from dsv4_ops.lowering.triton import sparse_attention as sa
from dsv4_ops.lowering.triton.launch import cached_config
from dsv4_ops.ops import validate

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
                                                      for entry in ("wrapper", "raw", "checks")]
    assert all(r["host_us"] > 0 and r["host_us_best"] <= r["host_us"] and r["cpu_us"] >= 0 for r in rows)
    assert isinstance(torch.ops.dsv4.plan, torch._ops.OpOverloadPacket)  # the checks row's stub is gone
    assert {r["route"] for r in rows} == {"reference (aten)", "F.linear"}
    profiled = [r for r in rows if "breakdown" in r]
    assert len(profiled) == 1 and profiled[0]["breakdown"]["us_by_part"]
