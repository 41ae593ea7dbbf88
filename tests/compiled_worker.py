"""Run a test file's ``_worker`` in a subprocess that compiles Triton kernels for real.

conftest sets ``TRITON_INTERPRET=1`` for the test process (kernels run on the CPU there);
interpreted kernels cannot be cross-compiled, wrapped or copied the way Inductor does, so those
tests run their worker (``python <test file> <args>``) without it and read back one JSON line.
The worker finds the helper modules of ``tests/`` (this folder) on its ``PYTHONPATH``, wherever
below ``tests/`` its file lives."""
import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def run_worker(test_file: str, *args: str, timeout: int = 600):
    """The last stdout line of ``python test_file *args`` (no ``TRITON_INTERPRET``), as JSON."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, test_file, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
