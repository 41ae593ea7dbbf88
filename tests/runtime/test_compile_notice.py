"""A compiled step's first call of a new shape that runs long (it compiles) says so on stderr while it runs, with a
heartbeat, and once it is done; a short first call, a second call, an eager step, a call inside the caller's own
progress line and ``COMPILE_NOTICE_S = None`` say nothing. Counted with a stream that records writes; no clock is
asserted (the long call waits for the notice)."""
from __future__ import annotations

import io
import sys
import threading

import torch

from dsv4_ops import compiled_steps
from dsv4_ops.compiled_steps import CompiledSteps
from dsv4_ops.progress import Progress


class RecordingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.wrote = threading.Event()

    def write(self, s: str) -> int:
        n = super().write(s)
        self.wrote.set()
        return n


def recording_stderr(monkeypatch) -> RecordingStream:
    """sys.stderr, recorded; set in the test's body (pytest's capture sets sys.stderr again after fixtures)."""
    stream = RecordingStream()
    monkeypatch.setattr(sys, "stderr", stream)
    return stream


def steps(compiled: bool = True) -> CompiledSteps:
    stats = dict(graph_breaks=0, recompiles=0, compile_time_s=0.0, cuda_graph_replays=0, cuda_graph_recordings=0)
    return CompiledSteps(stats, compiled, cuda_graphs=False, device=torch.device("cpu"))


def test_a_first_call_that_runs_past_the_notice_time_says_what_compiles_and_when_it_is_done(monkeypatch):
    stderr = recording_stderr(monkeypatch)
    monkeypatch.setattr(compiled_steps, "COMPILE_NOTICE_S", 0.01)
    calls = steps()

    def compiling(x):  # runs until the notice is out, as a compile outlasts it
        assert stderr.wrote.wait(60)
        return x + 1

    assert torch.equal(calls.run(("decode", 4), compiling, torch.ones(2)), torch.full((2,), 2.0))
    lines = stderr.getvalue().splitlines()
    assert "dsv4_ops: compiling the decode / 4 step (the first call of this shape), running for" in lines[0]
    assert "done in" in lines[-1]
    said = stderr.getvalue()
    calls.run(("decode", 4), lambda x: x + 1, torch.ones(2))  # the same shape again: nothing
    assert stderr.getvalue() == said


def test_a_short_first_call_an_eager_step_and_a_disabled_notice_say_nothing(monkeypatch):
    stderr = recording_stderr(monkeypatch)
    monkeypatch.setattr(compiled_steps, "COMPILE_NOTICE_S", 3600.0)
    steps().run(("prefill", 1, 64), lambda x: x + 1, torch.ones(2))
    monkeypatch.setattr(compiled_steps, "COMPILE_NOTICE_S", 0.0)  # 0: at once, were the notice on
    steps(compiled=False).run(("decode", 1), lambda x: x + 1, torch.ones(2))
    monkeypatch.setattr(compiled_steps, "COMPILE_NOTICE_S", None)
    steps().run(("decode", 2), lambda x: x + 1, torch.ones(2))
    assert stderr.getvalue() == ""
    monkeypatch.setattr(compiled_steps, "COMPILE_NOTICE_S", 0.0)  # the same call does speak when the notice is on
    steps().run(("decode", 2), lambda x: x + 1, torch.ones(2))
    assert "compiling the decode / 2 step" in stderr.getvalue()


def test_a_first_call_inside_the_callers_own_progress_line_leaves_the_saying_to_it(monkeypatch):
    stderr = recording_stderr(monkeypatch)
    monkeypatch.setattr(compiled_steps, "COMPILE_NOTICE_S", 0.0)
    with Progress("demo: compiling the steps (first call)"):
        steps().run(("decode", 8), lambda x: x + 1, torch.ones(2))
    assert "demo: compiling" in stderr.getvalue() and "compiling the decode / 8 step" not in stderr.getvalue()
    assert not Progress.running()
    steps().run(("decode", 8), lambda x: x + 1, torch.ones(2))  # outside it, the same first call speaks
    assert "compiling the decode / 8 step" in stderr.getvalue()
