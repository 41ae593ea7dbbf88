"""One progress line for long work (compiling, exporting): what runs, an estimate, and a
heartbeat every ``every`` seconds so a slow machine never looks hung."""
from __future__ import annotations

import sys
import threading
import time


class Progress:
    """``with Progress("compiling decode", estimate_s=60): ...`` prints the label with its
    estimate, then ``... 30 s`` heartbeats, then ``done in X s``."""

    def __init__(self, label: str, estimate_s: float | None = None, every: float = 15.0, stream=None) -> None:
        self.label, self.estimate_s, self.every = label, estimate_s, every
        self.stream = stream or sys.stderr
        self._stop = threading.Event()

    def _print(self, msg: str) -> None:
        print(msg, file=self.stream, flush=True)

    def __enter__(self) -> "Progress":
        self.t0 = time.perf_counter()
        hint = f" (about {self.estimate_s:.0f} s)" if self.estimate_s else ""
        self._print(f"  {self.label}{hint} ...")
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._print(f"    ... {self.label}: {time.perf_counter() - self.t0:.0f} s")

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.elapsed = time.perf_counter() - self.t0
        if exc[0] is None:
            self._print(f"  {self.label}: done in {self.elapsed:.1f} s")
