"""One progress line for long work (compiling, exporting): what runs, an estimate, and a
heartbeat every ``every`` seconds so a slow machine never looks hung. With ``quiet_s``, work that
ends sooner says nothing (a first call that may or may not compile). A line inside another one's
work on the same thread is the outer line's business: :meth:`Progress.running` tells."""
from __future__ import annotations

import sys
import threading
import time


_open = threading.local()  # the Progress blocks a thread is inside


class Progress:
    """``with Progress("compiling decode", estimate_s=60): ...`` prints the label with its
    estimate, then ``... 30 s`` heartbeats, then ``done in X s``. ``quiet_s``: the label only once the
    work has run that long (then heartbeats and ``done`` as above); ``spoke`` says whether it printed."""

    def __init__(self, label: str, estimate_s: float | None = None, every: float = 15.0, stream=None,
                 quiet_s: float = 0.0) -> None:
        self.label, self.estimate_s, self.every, self.quiet_s = label, estimate_s, every, quiet_s
        self.stream = stream or sys.stderr
        self._stop = threading.Event()
        self.spoke = False

    @staticmethod
    def running() -> bool:
        """Whether this thread is inside a ``with Progress(...)`` block."""
        return getattr(_open, "depth", 0) > 0

    def _print(self, msg: str) -> None:
        print(msg, file=self.stream, flush=True)

    def __enter__(self) -> "Progress":
        self.t0 = time.perf_counter()
        _open.depth = getattr(_open, "depth", 0) + 1
        if not self.quiet_s:
            self._announce()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _announce(self) -> None:
        hint = f" (about {self.estimate_s:.0f} s)" if self.estimate_s else ""
        ran = f", running for {time.perf_counter() - self.t0:.0f} s" if self.quiet_s else ""
        self._print(f"  {self.label}{hint}{ran} ...")
        self.spoke = True

    def _run(self) -> None:
        if self.quiet_s:
            if self._stop.wait(self.quiet_s):
                return
            self._announce()
        while not self._stop.wait(self.every):
            self._print(f"    ... {self.label}: {time.perf_counter() - self.t0:.0f} s")

    def __exit__(self, *exc) -> None:
        _open.depth -= 1
        self._stop.set()
        self._thread.join()
        self.elapsed = time.perf_counter() - self.t0
        if exc[0] is None and self.spoke:
            self._print(f"  {self.label}: done in {self.elapsed:.1f} s")
