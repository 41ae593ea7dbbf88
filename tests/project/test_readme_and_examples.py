"""Every ```python snippet of the README runs as written, and every script in examples/ runs on
the tiny config, each in a fresh process (what a newcomer copies must work). The C++ example runs
the package the Python export example wrote and prints the same tokens; the CLI export it falls
back to is checked for the same model and limits."""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SNIPPETS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def run(cmd: list[str], cwd: Path, timeout: int = 900) -> str:
    out = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return out.stdout


def test_readme_has_the_snippets_a_newcomer_needs() -> None:
    assert len(SNIPPETS) == 7
    assert "dsv4_ops.hf.enable" in SNIPPETS[0]  # the HF path is the first thing a HF user sees
    for code in SNIPPETS:
        ast.parse(code)
        assert "print(" in code  # every snippet shows its result


@pytest.mark.parametrize("i", range(len(SNIPPETS)), ids=lambda i: f"snippet{i + 1}")
def test_readme_snippet_runs_as_written(i: int, tmp_path: Path) -> None:
    stdout = run([sys.executable, "-c", SNIPPETS[i]], cwd=tmp_path)
    assert stdout.strip(), "the snippet printed nothing"
    if i == 1:  # generate: two lists of 16 new tokens, then 0 recompiles and 0 graph breaks
        assert stdout.strip().endswith("0 0")
    if i == 2:  # serve: the second request starts from the first one's full page of system prompt
        stats = ast.literal_eval(stdout.strip().splitlines()[-1])
        assert stats == {"prefix_hit_tokens": 16, "pages_free": stats["pages_free"], "recompiles": 0}
    if i == 5:
        assert (tmp_path / "build" / "tiny.pt2").is_file()


def test_example_compile_your_model(tmp_path: Path) -> None:
    assert "OK" in run([sys.executable, str(ROOT / "examples" / "compile_your_model.py")], cwd=tmp_path)


def test_example_generate(tmp_path: Path) -> None:
    out = run([sys.executable, str(ROOT / "examples" / "generate.py")], cwd=tmp_path)
    assert "graph breaks 0, recompiles 0" in out and out.count("prompt of") == 2


def test_examples_export_then_run_from_cpp(tmp_path: Path) -> None:
    """export_and_load.py exports with the Python API; run_from_cpp.sh runs that package in C++ and
    prints the same tokens. (Given no package, the script exports with the CLI first: the CLI's
    part is the next test, without a second multi-minute compile of the same model.)"""
    pkg = tmp_path / "py.pt2"
    out = run([sys.executable, str(ROOT / "examples" / "export_and_load.py"), "--out", str(pkg)], cwd=tmp_path)
    tokens = re.search(r"AOTI tokens: (\[\[.*\]\])", out).group(1)
    if shutil.which("cmake") is None and not (ROOT / ".venv" / "bin" / "cmake").exists():
        pytest.skip("cmake is not installed: the C++ half of this example cannot be built")
    cpp = run(["bash", str(ROOT / "examples" / "run_from_cpp.sh"), str(pkg)], cwd=ROOT)
    rows = [line for line in cpp.strip().splitlines() if re.fullmatch(r"[\d,]+", line)]
    assert [[int(t) for t in r.split(",")] for r in rows] == ast.literal_eval(tokens)


def test_cli_export_exports_the_examples_model_with_the_scripts_limits(monkeypatch, tmp_path: Path) -> None:
    """What run_from_cpp.sh runs when it has no package: `python -m dsv4_ops export --config tiny ...`
    hands dsv4_ops.export the seed-0 tiny model of export_and_load.py and the script's limits."""
    import torch

    import dsv4_ops
    from dsv4_ops.__main__ import main

    script = (ROOT / "examples" / "run_from_cpp.sh").read_text()
    argv = re.search(r"-m dsv4_ops (export [^\n]*)", script).group(1).replace('"$PKG"', str(tmp_path / "cli.pt2"))
    calls = []
    monkeypatch.setattr(dsv4_ops, "export", lambda model, path, **kw: calls.append((model, path, kw)) or path)
    assert main(argv.split()) == 0
    (model, path, kw), = calls
    assert path == str(tmp_path / "cli.pt2")
    assert kw == dict(max_batch_size=2, max_seq_len=128, prefill_chunk=16)  # export_and_load.py's limits
    torch.manual_seed(0)
    want = dsv4_ops.DeepseekV4ForCausalLM(dsv4_ops.DSV4Config.tiny())  # export_and_load.py's model
    got = model.state_dict()
    assert got.keys() == want.state_dict().keys()
    assert all(torch.equal(got[k], v) for k, v in want.state_dict().items())
