"""Command-line behaviour of the C++ runner build/dsv4_run (csrc/runner) that needs no model.

Builds the runner once per module with ``make runner`` (CMake + the venv's libtorch; ~10 s from
scratch on 2 cores, ~2 s when up to date). The end-to-end run against an exported package lives
elsewhere. Exit codes: 2 = bad command line, 1 = the package cannot be loaded or run.
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


def run(runner, *args):
    r = subprocess.run([str(runner), *map(str, args)], capture_output=True, text=True, timeout=120)
    assert r.returncode >= 0, f"dsv4_run died by signal {-r.returncode}: {r.stderr[-2000:]}"
    return r


def test_help(runner):
    r = run(runner, "--help")
    assert r.returncode == 0 and r.stderr == ""
    for word in ("usage: dsv4_run", "--prompt", "--max-new-tokens", "--quiet", "--no-cuda-graph", "LD_PRELOAD"):
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
