"""How many CUDA graphs Inductor's cudagraph trees have replayed in this process.

``torch.compile(mode="reduce-overhead")`` decides per call whether to warm up (run eagerly),
record a graph, replay one, or fall back to the eager kernels (a "cudagraph skip"), and counts
none of this. A call that compiled nothing is therefore no evidence of a replay. The one place a
recorded graph is replayed is ``CUDAGraphNode.run`` (recording runs ``run_first_inputs``), so
:func:`install` wraps that method to count its calls in ``torch._dynamo.utils.counters["inductor"]``
under ``cudagraph_replays``. Read-only: the wrapper only counts, then calls the original. Nothing
is patched at import: the first generator that replays CUDA graphs installs it (``Generator``),
and so may a caller that wants the count (tests, benchmarks).
"""
from __future__ import annotations

import functools

import torch

__all__ = ["install", "replays", "KEY"]

KEY = "cudagraph_replays"


def install() -> bool:
    """Count replays from now on (idempotent). False on a torch without cudagraph trees, where
    nothing can be replayed."""
    try:
        from torch._inductor.cudagraph_trees import CUDAGraphNode
    except ImportError:
        return False
    run = CUDAGraphNode.run
    if getattr(run, "_dsv4_counts_replays", False):
        return True

    @functools.wraps(run)
    def counted_run(self, new_inputs):
        torch._dynamo.utils.counters["inductor"][KEY] += 1
        return run(self, new_inputs)

    counted_run._dsv4_counts_replays = True
    CUDAGraphNode.run = counted_run
    return True


def replays() -> int:
    """CUDA graphs replayed by Inductor's cudagraph trees since :func:`install` (process-wide,
    monotone unless someone clears dynamo's counters: take differences of calls close together)."""
    return torch._dynamo.utils.counters["inductor"][KEY]
