"""The CUDA top-k (``csrc/kernels``) without a GPU: when setup.py builds the native library (a
pure function of the installing torch, nvcc and ``DSV4_USE_CPP``) and for which architectures; the
limits and the schema that Python mirrors agree with the C++ source; without the library (here:
a CPU torch) importing dsv4_ops gives the Triton route, a reason and no noise; the route never
takes CPU tensors. Where nvcc is found, the kernel compiles for sm_90 within its registers and the
binding compiles against torch's headers. The op itself is tested on the GPU
(``test_topk_rows_cuda.py``, this folder)."""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4_ops import native
from dsv4_ops.ops import topk_cuda

ROOT = Path(__file__).resolve().parents[3]
KERNELS = ROOT / "csrc" / "kernels"
NVCC = "/usr/local/cuda/bin/nvcc"


def _load_setup():
    """setup.py as a module (its ``setup()`` call runs only as a script)."""
    spec = importlib.util.spec_from_file_location("dsv4_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SETUP = _load_setup()


def nvcc_path():
    return SETUP.find_nvcc(SETUP.find_cuda_home(os.environ, shutil.which("nvcc"))) or (
        NVCC if os.access(NVCC, os.X_OK) else None)


needs_nvcc = pytest.mark.skipif(nvcc_path() is None, reason="no nvcc on this machine")


@pytest.mark.parametrize("torch_cuda, nvcc, env, want", [
    ("13.0", "/usr/local/cuda/bin/nvcc", {}, True),
    ("12.8", "/opt/cuda/bin/nvcc", {"DSV4_USE_CPP": "1"}, True),
    ("13.0", "/usr/local/cuda/bin/nvcc", {"DSV4_USE_CPP": "0"}, False),
    (None, "/usr/local/cuda/bin/nvcc", {}, False),   # a CPU (or ROCm) torch: pure Python
    ("13.0", None, {}, False),                        # no nvcc: pure Python
    (None, None, {"DSV4_USE_CPP": " 0 "}, False),
])
def test_setup_builds_the_native_library_only_with_a_cuda_torch_and_nvcc(torch_cuda, nvcc, env, want):
    build, why = SETUP.native_build(torch_cuda, nvcc, env)
    assert build is want and why


@pytest.mark.parametrize("torch_cuda, nvcc, message", [
    (None, "/usr/local/cuda/bin/nvcc", "not a CUDA build"),
    ("13.0", None, "nvcc not found"),
])
def test_setup_with_the_native_library_required_fails_where_it_cannot_build(torch_cuda, nvcc, message):
    with pytest.raises(RuntimeError, match=f"DSV4_USE_CPP=1 but .*{message}"):
        SETUP.native_build(torch_cuda, nvcc, {"DSV4_USE_CPP": "1"})
    with pytest.raises(ValueError, match="DSV4_USE_CPP='yes'"):
        SETUP.native_build(torch_cuda, nvcc, {"DSV4_USE_CPP": "yes"})


def test_setup_builds_for_the_given_architectures_else_the_visible_gpus_else_sm90():
    assert SETUP.cuda_arch_list("8.0;9.0a", [(9, 0)]) == "8.0;9.0a"
    assert SETUP.cuda_arch_list(None, [(9, 0), (9, 0)]) == "9.0"
    assert SETUP.cuda_arch_list("", [(9, 0), (8, 6)]) == "8.6;9.0"
    assert SETUP.cuda_arch_list(None, []) == "9.0"


def toolkit(folder: Path) -> Path:
    """A stand-in CUDA toolkit: bin/nvcc (executable) and include/cuda_runtime.h."""
    (folder / "bin").mkdir(parents=True)
    (folder / "include").mkdir()
    (folder / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (folder / "bin" / "nvcc").chmod(0o755)
    (folder / "include" / "cuda_runtime.h").write_text("")
    return folder


def test_setup_finds_the_cuda_toolkit_behind_the_nvcc_on_path(tmp_path):
    cuda = toolkit(tmp_path / "cuda-13.0")
    assert SETUP.find_cuda_home({"CUDA_HOME": str(cuda)}, None) == str(cuda)
    assert SETUP.find_cuda_home({"CUDA_PATH": str(cuda)}, "/nonexistent/bin/nvcc") == str(cuda)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").symlink_to(cuda / "bin" / "nvcc")  # /usr/bin/nvcc -> the toolkit's
    assert SETUP.find_cuda_home({}, str(tmp_path / "bin" / "nvcc")) == str(cuda)
    # a wrapper script (not a toolkit's bin/): its parent has no CUDA headers, so not that
    wrapper = tmp_path / "local" / "bin" / "nvcc"
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text(f"#!/bin/sh\nexec {cuda}/bin/nvcc \"$@\"\n")
    wrapper.chmod(0o755)
    found = SETUP.find_cuda_home({"CUDA_HOME": str(tmp_path / "local")}, str(wrapper))
    assert found != str(tmp_path / "local") and found in (None, "/usr/local/cuda")
    assert SETUP.find_nvcc(None) is None and SETUP.find_nvcc(str(tmp_path / "nonexistent")) is None


def test_setup_on_this_torch_decides_as_its_pure_function_says():
    nvcc = SETUP.find_nvcc(SETUP.find_cuda_home(os.environ, shutil.which("nvcc")))
    build, _ = SETUP.native_build(torch.version.cuda, nvcc, {})
    if torch.version.cuda is None:
        assert not build  # a CPU torch: `pip install -e .` stays pure Python


def test_the_python_limits_mirror_the_kernel_header():
    header = (KERNELS / "topk_rows.h").read_text()
    assert re.search(r"constexpr int kTopkRowsMaxEntries = (\d+);", header).group(1) == str(topk_cuda.MAX_ENTRIES)
    assert re.search(r"constexpr int kTopkRowsMaxTopk = (\d+);", header).group(1) == str(topk_cuda.MAX_TOPK)
    kernel = (KERNELS / "topk_rows.cu").read_text()
    assert "kMaxTopk = kTopkRowsMaxTopk" in kernel
    assert "static_assert(kMaxItems * kThreads == kTopkRowsMaxEntries" in kernel


def test_the_schema_and_its_registration_are_in_cpp():
    """The op is defined in C++ (so a process without Python, the C++ runner, has it), on CUDA only."""
    binding = (KERNELS / "topk_rows_op.cpp").read_text()
    assert re.findall(r'm\.def\("([^"]+)"', binding) == [
        "topk_rows_cuda(Tensor scores, Tensor visible, int topk) -> Tensor"]
    assert "TORCH_LIBRARY_FRAGMENT(dsv4, m)" in binding and "TORCH_LIBRARY_IMPL(dsv4, CUDA, m)" in binding
    assert "torch/extension.h" not in binding and "pybind" not in binding  # no Python in the library


def test_no_library_means_the_triton_topk_and_a_reason(tmp_path):
    """``native.load``: no file (with or without the build's error), a CPU torch, a file that is no
    library: each a reason, never an exception."""
    paths = native.candidates(tmp_path)
    path, why = native.load(paths, "13.0")
    assert path is None and "without its native library" in why
    (tmp_path / "_C.build-error").write_text("CompileError: nvcc failed\nmore\n")
    path, why = native.load(paths, "13.0", tmp_path / "_C.build-error")
    assert path is None and "failed to build (CompileError: nvcc failed" in why
    paths[0].write_bytes(b"not an ELF file")
    path, why = native.load(paths, None)
    assert path is None and "not a CUDA build" in why
    path, why = native.load(paths, "13.0")
    assert path is None and "did not load" in why and str(paths[0]) in why


def test_a_package_load_error_naming_a_dsv4_op_says_the_library_is_missing():
    from dsv4_ops.aoti_generator import _native_hint

    assert _native_hint("Could not find schema for aten::foo.") == ""
    hint = _native_hint("Could not find schema for dsv4::topk_rows_cuda.")
    if native.library_path() is None:
        assert "native library, which is not loaded" in hint and native.unavailable_reason() in hint
    else:
        assert hint == ""


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA torch may have the library")
def test_importing_dsv4_ops_without_the_library_is_quiet_and_keeps_the_triton_topk():
    code = ("import json, torch, dsv4_ops\n"
            "from dsv4_ops import native\n"
            "from dsv4_ops.ops import topk_cuda\n"
            "print(json.dumps([native.library_path(), topk_cuda.available(), topk_cuda.unavailable_reason(),\n"
            "                  topk_cuda.applies((1, 1, 8192), torch.device('cuda'), 512),\n"
            "                  hasattr(torch.ops.dsv4, 'topk_rows_cuda')]))\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    path, available, why, applies, registered = json.loads(done.stdout.strip().splitlines()[-1])
    assert path is None and not available and not applies and not registered
    assert "native library" in why
    noise = [line for line in done.stderr.splitlines() if re.search(r"native|_C\b|topk", line, re.I)]
    assert not noise, noise


def test_route_never_takes_cpu_tensors_and_turns_off_for_tests():
    from routes import triton_topk

    assert not topk_cuda.applies((1, 1, 8192), torch.device("cpu"), 512)
    saved = topk_cuda._enabled
    with triton_topk():
        assert topk_cuda._enabled is False
        if topk_cuda.available():
            assert "turned off" in topk_cuda.unavailable_reason()
    assert topk_cuda._enabled is saved


@pytest.mark.parametrize("rows, N, topk, want", [
    (1, 8258, 512, True),      # the Flash slice's 32K pool at batch 1
    (64, 8192, 512, True),
    (128, 32768, 512, True),
    (64, 32768, 512, True),
    (1, 32768, 512, True),     # one long row: its candidate list
    (16, 32768, 512, True),
    (1, 16384, 512, True),
    (1, 32769, 512, False),    # past the kernel's row
    (1, 100, 2049, False),     # past its sort
    (0, 100, 512, False),
])
def test_which_rows_take_the_cuda_topk(rows, N, topk, want):
    assert topk_cuda.serves(rows, N, topk) is want
    assert topk_cuda.serves(rows, N, topk, max_n=32768, max_k=2048) is want


@needs_nvcc
def test_the_kernel_compiles_for_sm90_within_its_registers(tmp_path):
    """One kernel per register-row size (4 .. 64 scores a thread, 512 threads: at most 128
    registers), none spilling, nor the sorts they call. The list kernel (more than 16 scores a
    thread) keeps its candidates in a shared list, so that its row's registers need not live
    through the select."""
    cmd = [nvcc_path(), "-O3", "-std=c++17", "-c", "-gencode=arch=compute_90,code=sm_90", "-Xptxas", "-v",
           str(KERNELS / "topk_rows.cu"), "-o", str(tmp_path / "topk_rows.o")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    kernels = re.findall(r"Compiling entry function '\S*?topk_rows_(?:list_)?kernelILi(\d+)E\S*'.*?\n"
                         r".*?Function properties.*?\n\s*\d+ bytes stack frame, (\d+) bytes spill stores, (\d+) bytes "
                         r"spill loads\n.*?Used (\d+) registers", done.stderr)
    by_items = {int(items): (int(st), int(ld), int(regs)) for items, st, ld, regs in kernels}
    assert sorted(by_items) == [4, 8, 16, 32, 64], done.stderr
    for items, (stores, loads, regs) in by_items.items():
        assert 0 < regs <= 128, (items, regs)
        assert stores == loads == 0, (items, stores, loads)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", done.stderr)
    assert spills and all(s == l == "0" for s, l in spills), done.stderr  # the called sorts too


@needs_nvcc
def test_the_binding_compiles_against_torchs_headers(tmp_path):
    """``topk_rows_op.cpp`` against this torch's headers and CUDA's (a syntax check: a CPU torch
    has no CUDA libraries to link). A CPU torch's headers lack one generated CUDA header, stubbed."""
    cxx = shutil.which("c++") or shutil.which("g++")
    cuda_include = Path(nvcc_path()).resolve().parents[1] / "include"
    if cxx is None or not (cuda_include / "cuda_runtime.h").is_file():
        pytest.skip("no C++ compiler or no CUDA headers")
    include = Path(torch.utils.cmake_prefix_path).parents[1] / "include"
    stub = tmp_path / "stub"
    if not (include / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").is_file():
        (stub / "c10" / "cuda" / "impl").mkdir(parents=True)
        (stub / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").write_text(
            "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    cmd = [cxx, "-std=c++17", "-fsyntax-only", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}", f"-I{stub}", f"-I{cuda_include}",
           str(KERNELS / "topk_rows_op.cpp")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
