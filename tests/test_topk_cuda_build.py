"""The CUDA top-k (``csrc/kernels/topk_rows.cu``) without a GPU: nvcc builds it for sm_90 with no
register spills in any of its row sizes, the build is cached by the source's hash, the library
loads and reports its limits, and the route (``dsv4_ops/ops/topk_cuda.py``) never takes CPU
tensors, turns off under ``disabled()`` and says why when nvcc is missing. Skipped (with the
reason) where this machine has no nvcc; the kernel's results are checked on the GPU
(``tests/ops/test_topk_rows_cuda.py``)."""
import ctypes
import re
import subprocess

import pytest
import torch

from dsv4_ops.ops import topk_cuda
from lowering.cuda import topk_rows as lib

needs_nvcc = pytest.mark.skipif(lib.nvcc() is None, reason="no nvcc on this machine")


@needs_nvcc
def test_compiles_for_sm90_within_its_registers(tmp_path):
    """One kernel per register-row size (4 .. 64 scores a thread, 512 threads: at most 128
    registers), none spilling. The 64-a-thread kernel (rows up to 32768 scores) spilled 188 B until
    session 17: its candidates now go to a shared list (or are read again from the row when too
    many), so its 64 registers of the row need not live through the select."""
    cmd = lib.build_command(lib.nvcc(), "90", str(tmp_path / "k.so")) + ["-Xptxas", "-v"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    reports = re.findall(r"topk_rows_(?:list_)?kernelILi(\d+)E.*?(\d+) bytes spill stores, (\d+) bytes spill loads.*?"
                         r"Used (\d+) registers", done.stderr, flags=re.S)
    by_items = {int(items): (int(st), int(ld), int(regs)) for items, st, ld, regs in reports}
    assert sorted(by_items) == [4, 8, 16, 32, 64], done.stderr
    for items, (stores, loads, regs) in by_items.items():
        assert 0 < regs <= 128, (items, regs)
        assert stores == loads == 0, (items, stores, loads)


@needs_nvcc
def test_build_is_cached_by_source_and_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4_OPS_CACHE", str(tmp_path))
    path = lib.build("90")
    assert path.parent == tmp_path and path.name.startswith("topk_rows-sm90-")
    stamp = path.stat().st_mtime_ns
    assert lib.build("90") == path and path.stat().st_mtime_ns == stamp  # reused, not rebuilt
    so = ctypes.CDLL(str(path))  # static cudart: loads without a GPU
    assert so.dsv4_topk_rows_max_n() == 32768 and so.dsv4_topk_rows_max_topk() == 2048
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary files left


def test_missing_nvcc_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(lib, "nvcc", lambda: None)
    with pytest.raises(RuntimeError, match="nvcc not found"):
        lib.build("90")


def test_route_never_takes_cpu_tensors_and_turns_off_for_export():
    assert not topk_cuda.applies((1, 1, 8192), torch.device("cpu"), 512)
    saved = topk_cuda._enabled
    with topk_cuda.disabled():
        assert topk_cuda._enabled is False
    assert topk_cuda._enabled is saved


@pytest.mark.parametrize("rows, N, topk, want", [
    (1, 8258, 512, True),      # the Flash slice's 32K pool at batch 1: CUDA (10.3 against the split's 19.2 us)
    (64, 8192, 512, True),     # 11.5 against 20.0 us
    (128, 32768, 512, True),   # 27.7 against 120.1 us (no split at 128 rows)
    (64, 32768, 512, True),    # many long rows: CUDA (the whole op 161.8 against 187.6 us)
    (1, 32768, 512, True),     # one long row: CUDA since its candidate list (the op 21.2 against the split's 27.0 us)
    (16, 32768, 512, True),
    (1, 16384, 512, True),     # up to 32 scores a thread: CUDA
    (1, 32769, 512, False),    # past the kernel's row
    (1, 100, 2049, False),     # past its sort
    (0, 100, 512, False),
])
def test_which_rows_take_the_cuda_topk(rows, N, topk, want):
    assert topk_cuda.serves(rows, N, topk, max_n=32768, max_k=2048) is want


def test_a_library_that_did_not_build_serves_nothing():
    assert not topk_cuda.serves(64, 8192, 512, max_n=0, max_k=0)
