"""Calling compiled steps and counting what the calls cost: the graphs each ``(kind, bucket)`` key
compiled, graph breaks, CUDA-graph replays and compile time. ``Generator`` and the serving
``Engine`` run every step through :class:`CompiledSteps`."""
from __future__ import annotations

import time

import torch

from .cudagraph_replays import recordings, replays
from .progress import Progress

__all__ = ["CompiledSteps", "compile_step", "compile_options", "batch_buckets", "RECOMPILE_LIMIT"]

# every (step kind, bucket) is its own graph of the same code, and dynamo falls back to eager past
# `recompile_limit` graphs per code object (default 8): the calls raise it while they run and leave the
# process's setting alone
RECOMPILE_LIMIT = 64
# a compiled step's first call of a shape that runs longer than this many seconds (it compiles: 10-30 s a
# step on the Flash slice) says so on stderr, with a heartbeat, so a first decode never looks hung; None: silent
COMPILE_NOTICE_S: float | None = 5.0


def batch_buckets(n: int) -> list[int]:
    """The batch sizes steps are compiled for: 1, 2, 4, ... below ``n``, then ``n``."""
    out, b = [], 1
    while b < n:
        out.append(b)
        b *= 2
    return out + [n]


def compile_options(cuda_graphs: bool, pdl: bool = False) -> dict:
    """Inductor options of the compiled steps: ``mode="reduce-overhead"`` is ``triton.cudagraphs``
    (``torch._inductor.list_mode_options``), spelled as an option so that ``triton.enable_pdl`` can
    join it (``torch.compile`` takes a mode or options, not both)."""
    options = {"triton.cudagraphs": cuda_graphs}
    if pdl:
        options["triton.enable_pdl"] = True
    return options


def compile_step(fn, cuda_graphs: bool, pdl: bool = False):
    return torch.compile(fn, fullgraph=True, dynamic=False, options=compile_options(cuda_graphs, pdl))


class CompiledSteps:
    """Runs step functions and adds to ``stats`` (a dict with ``graph_breaks``, ``recompiles``,
    ``compile_time_s``, ``cuda_graph_replays``, ``cuda_graph_recordings``). ``graphs[key]`` counts
    the graphs compiled per key; ``recompiles`` is every graph past a key's first; ``keys`` is every key run so far (compiled
    or not: the shapes a warm-up has covered)."""

    def __init__(self, stats: dict, compiled: bool, cuda_graphs: bool, device: torch.device) -> None:
        self.stats, self.compiled, self.cuda_graphs, self.device = stats, compiled, cuda_graphs, device
        self.graphs: dict[tuple, int] = {}
        self.keys: set[tuple] = set()

    def run(self, key: tuple, fn, *args, **kwargs):
        # a caller's own progress line (the demo's) already covers the compile
        first = self.compiled and key not in self.keys and COMPILE_NOTICE_S is not None and not Progress.running()
        self.keys.add(key)
        counters = torch._dynamo.utils.counters
        graphs_before = counters["stats"]["unique_graphs"]
        breaks_before = sum(counters["graph_break"].values())
        replays_before, recordings_before = replays(), recordings()
        t0 = time.perf_counter()
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        config = torch._dynamo.config
        limit = config.recompile_limit  # set and restored directly: config.patch costs ~20 us a call
        config.recompile_limit = max(limit, RECOMPILE_LIMIT)
        try:
            # eager steps in inference mode: each op call then skips the dispatcher's autograd and
            # view-tracking layers (Python for custom ops: about half an eager op's host cost)
            with torch.no_grad() if self.compiled else torch.inference_mode():
                if first:  # only a shape's first call pays for the notice's thread
                    with Progress(f"dsv4_ops: compiling the {' / '.join(map(str, key))} step (the first call of "
                                  "this shape)", quiet_s=COMPILE_NOTICE_S):
                        out = fn(*args, **kwargs)
                else:
                    out = fn(*args, **kwargs)
        finally:
            config.recompile_limit = limit
        new_graphs = counters["stats"]["unique_graphs"] - graphs_before
        self.stats["graph_breaks"] += sum(counters["graph_break"].values()) - breaks_before
        if self.compiled and new_graphs:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.stats["compile_time_s"] += time.perf_counter() - t0
            self.graphs[key] = self.graphs.get(key, 0) + new_graphs
            self.stats["recompiles"] = sum(max(0, g - 1) for g in self.graphs.values())
        if self.cuda_graphs:
            # count the graphs the call really replayed (not warm-ups, recordings or cudagraph skips)
            self.stats["cuda_graph_replays"] += replays() - replays_before
            self.stats["cuda_graph_recordings"] += recordings() - recordings_before
        if self.cuda_graphs or not self.compiled:
            # graph outputs are overwritten by the next replay; an inference-mode output could not be
            # updated in place by the caller: both hand back copies
            out = tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()
        return out
