"""Command-line behaviour of the C++ runner build/dsv4_run (csrc/runner) that needs no model.

Builds the runner once per module with ``make runner`` (CMake + the venv's libtorch; ~10 s from
scratch on 2 cores, ~2 s when up to date). The end-to-end run against an exported package lives
elsewhere (tests/export/test_export_cuda.py, with dsv4_ops' native library). Exit codes: 2 = bad
command line, 1 = the package (or a --library) cannot be loaded or run.
"""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "build" / "dsv4_run"
LIBSTDCXX = "/usr/lib/x86_64-linux-gnu/libstdc++.so.6"


def _make_runner():
    return subprocess.run(["make", "-C", str(ROOT), "runner", f"RUNNER_PY={sys.executable}"], capture_output=True,
                          text=True, timeout=900)


@pytest.fixture(scope="module")
def runner():
    if shutil.which("make") is None:
        pytest.skip("make not installed: cannot build csrc/runner")
    if shutil.which("cmake") is None and not (ROOT / ".venv" / "bin" / "cmake").exists():
        pytest.skip("cmake not installed (neither on PATH nor in .venv): cannot build csrc/runner")
    r = _make_runner()
    assert r.returncode == 0, f"make runner failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    assert RUNNER.is_file() and os.access(RUNNER, os.X_OK)
    return RUNNER


def run(runner, *args, env=None):
    r = subprocess.run([str(runner), *map(str, args)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode >= 0, f"dsv4_run died by signal {-r.returncode}: {r.stderr[-2000:]}"
    return r


def test_help(runner):
    r = run(runner, "--help")
    assert r.returncode == 0 and r.stderr == ""
    for word in ("usage: dsv4_run", "--prompt", "--max-new-tokens", "--quiet", "--no-cuda-graph", "--library",
                 "DSV4_OPS_LIBRARY", "LD_PRELOAD"):
        assert word in r.stdout
    assert run(runner, "-h").stdout == r.stdout


def test_make_runner_is_idempotent(runner):
    before = runner.stat().st_mtime_ns
    r = _make_runner()
    assert r.returncode == 0, r.stderr
    assert runner.stat().st_mtime_ns == before, "make runner relinked although nothing changed"


@pytest.mark.parametrize("args, needle", [
    ([], "MODEL.pt2"),
    (["m.pt2"], "--prompt"),
    (["m.pt2", "--prompt", "1", "--bogus"], "--bogus"),
    (["m.pt2", "--prompt", "1", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["m.pt2", "--prompt", "1", "--max-new-tokens", "abc"], "--max-new-tokens"),
    (["m.pt2", "--prompt", "1", "--max-new-tokens"], "--max-new-tokens"),
    (["m.pt2", "--prompt", ""], "empty prompt"),
    (["m.pt2", "--prompt=", "--max-new-tokens", "2"], "empty prompt"),
    (["m.pt2", "--prompt", "1,,2"], "--prompt #1"),
    (["m.pt2", "--prompt", "1", "--prompt", "3,x"], "--prompt #2"),
    (["m.pt2", "--prompt", "1", "--quiet=yes"], "--quiet"),
    (["a.pt2", "b.pt2", "--prompt", "1"], "b.pt2"),
    (["m.pt2", "--prompt", "1", "--library"], "--library"),
    (["m.pt2", "--prompt", "1", "--library="], "--library"),
])
def test_bad_command_line_is_usage_error(runner, args, needle):
    # Checked before the (nonexistent) package is touched.
    r = run(runner, *args)
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    assert "dsv4_run: error:" in r.stderr and needle in r.stderr


def test_missing_file(runner, tmp_path):
    path = tmp_path / "nope.pt2"
    r = run(runner, path, "--prompt", "1,2,3")
    assert r.returncode == 1 and r.stdout == ""
    assert str(path) in r.stderr


@pytest.mark.parametrize("kind", ["random", "directory", "empty_zip", "truncated_zip"])
def test_corrupt_package(runner, tmp_path, kind):
    path = tmp_path / "x.pt2"
    if kind == "random":
        path.write_bytes(os.urandom(4096))
    elif kind == "directory":
        path.mkdir()
    else:  # a real zip archive, so the AOTI loader itself has to report the problem
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("x/data/aotinductor/other/readme.txt", "not a model " * 400)
        if kind == "truncated_zip":
            path.write_bytes(path.read_bytes()[:2000])
    r = run(runner, path, "--prompt", "1", "--max-new-tokens", "2")
    assert r.returncode == 1, r.stderr
    assert r.stdout == ""
    assert "dsv4_run: error:" in r.stderr and str(path) in r.stderr
    if kind == "empty_zip":
        assert "prefill" in r.stderr


def test_a_library_that_does_not_load_is_an_error(runner, tmp_path):
    """``--library`` (and ``$DSV4_OPS_LIBRARY``) load before the package: one that does not load
    ends the run with the path and the loader's reason, whatever the package."""
    lib = tmp_path / "no_such_lib.so"
    r = run(runner, tmp_path / "m.pt2", "--prompt", "1", "--library", lib)
    assert r.returncode == 1 and r.stdout == ""
    assert f"--library {lib}: cannot load the library" in r.stderr, r.stderr
    r = run(runner, tmp_path / "m.pt2", "--prompt", "1", env={**os.environ, "DSV4_OPS_LIBRARY": str(lib)})
    assert r.returncode == 1 and r.stdout == ""
    assert f"DSV4_OPS_LIBRARY {lib}: cannot load the library" in r.stderr, r.stderr


def test_a_library_that_loads_comes_before_the_package(runner, tmp_path):
    """A library that loads (here an empty one) is reported, and the run goes on to the package."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a library")
    src, lib = tmp_path / "empty.c", tmp_path / "libempty.so"
    src.write_text("int dsv4_runner_test_symbol(void) { return 0; }\n")
    done = subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    model = tmp_path / "missing.pt2"
    r = run(runner, model, "--prompt", "1", "--library", lib)
    assert r.returncode == 1 and r.stdout == ""
    assert f"loaded {lib} (--library)" in r.stderr and f"{model}: cannot open model package" in r.stderr, r.stderr


# Builds a CPU op in the dsv4 namespace, exports a one-op "prefill" program that calls it (a C++ op
# without a C shim: AOTInductor's proxy executor calls it), and prints the library's path. Runs in
# its own process, so that the probe op never joins this one's torch.ops.dsv4.
_PROBE_PACKAGE = r'''
import os, sys
import torch
from torch.utils import cpp_extension
from torch._inductor.package import package_aoti

out = sys.argv[1]
src = os.path.join(out, "probe.cpp")
with open(src, "w") as f:
    f.write("""
#include <ATen/ATen.h>
#include <torch/library.h>
at::Tensor runner_probe(const at::Tensor& x, int64_t k) { return (x * k).contiguous(); }
TORCH_LIBRARY_FRAGMENT(dsv4, m) { m.def("runner_probe(Tensor x, int k) -> Tensor"); }
TORCH_LIBRARY_IMPL(dsv4, CPU, m) { m.impl("runner_probe", &runner_probe); }
""")
# --as-needed: no libtorch_python (whose Python symbols a process without Python cannot resolve)
lib = cpp_extension.load(name="dsv4_runner_probe", sources=[src], is_python_module=False, build_directory=out,
                         extra_ldflags=["-Wl,--as-needed"])
torch.ops.load_library(lib)
torch.library.register_fake("dsv4::runner_probe")(lambda x, k: torch.empty_like(x))


class Probe(torch.nn.Module):
    def forward(self, x):
        return torch.ops.dsv4.runner_probe(x + 1, 3) + 1


ep = torch.export.export(Probe(), (torch.randn(2, 4),))
work = os.path.join(out, "work")
os.makedirs(work)
files = torch._inductor.aot_compile(ep.module(), ep.example_inputs[0], ep.example_inputs[1],
                                    options={"aot_inductor.package": True, "aot_inductor.output_path": work})
package_aoti(os.path.join(out, "probe.pt2"), {"prefill": files})
print(lib)
'''


def test_a_package_calling_a_cpp_dsv4_op_loads_once_its_library_is_given(runner, tmp_path):
    """What CUDA packages do with the CUDA top-k, on CPU: a package whose program calls a C++ op of
    the dsv4 namespace (through AOTInductor's proxy executor) does not load without the library
    that registers the op, and the error says so and how to pass it; with ``--library`` it loads
    (and this probe package then fails only for its missing dsv4.* metadata)."""
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available() or shutil.which("c++") is None:
        pytest.skip("ninja and a C++ compiler build the probe op")
    made = subprocess.run([sys.executable, "-c", _PROBE_PACKAGE, str(tmp_path)], capture_output=True, text=True,
                          timeout=900)
    assert made.returncode == 0, made.stderr[-3000:]
    lib = made.stdout.strip().splitlines()[-1]
    package = tmp_path / "probe.pt2"
    env = {k: v for k, v in os.environ.items() if k != "DSV4_OPS_LIBRARY"}
    if os.path.exists(LIBSTDCXX):  # torch 2.11 (GPU box): loading a .pt2 may segfault in std::regex without it
        env["LD_PRELOAD"] = LIBSTDCXX
    r = run(runner, package, "--prompt", "1", env=env)
    assert r.returncode == 1 and r.stdout == ""
    assert "cannot load model 'prefill'" in r.stderr and "the package calls dsv4::runner_probe" in r.stderr, r.stderr
    assert "--library PATH" in r.stderr and "DSV4_OPS_LIBRARY" in r.stderr
    r = run(runner, package, "--prompt", "1", "--library", lib, env=env)
    assert r.returncode == 1 and r.stdout == ""
    assert f"loaded {lib} (--library)" in r.stderr and "has no dsv4.* metadata" in r.stderr, r.stderr
