"""How many CUDA graphs Inductor's cudagraph trees have replayed (and recorded) in this process.

``torch.compile(mode="reduce-overhead")`` decides per call whether to warm up (run eagerly),
record a graph, replay one, or fall back to the eager kernels (a "cudagraph skip"), and counts
none of this. A call that compiled nothing is therefore no evidence of a replay. The one place a
recorded graph is replayed is ``CUDAGraphNode.run`` (recording runs ``run_first_inputs``), so
:func:`install` wraps that method to count its calls in ``torch._dynamo.utils.counters["inductor"]``
under ``cudagraph_replays``, and ``CUDAGraphTreeManager.record_function`` (every recording) under
``cudagraph_recordings``: a recording after warm-up is a stall a serving loop must not have.
Read-only: the wrappers only count, then call the originals. Nothing is patched at import: the
first generator that replays CUDA graphs installs them (``Generator``), and so may a caller that
wants the counts (tests, benchmarks).
"""
from __future__ import annotations

import functools

import torch

__all__ = ["install", "replays", "recordings", "KEY", "RECORDINGS_KEY"]

KEY = "cudagraph_replays"
RECORDINGS_KEY = "cudagraph_recordings"


def _counting(method, key: str):
    if getattr(method, "_dsv4_counts", False):
        return method

    @functools.wraps(method)
    def counted(self, *args, **kwargs):
        torch._dynamo.utils.counters["inductor"][key] += 1
        return method(self, *args, **kwargs)

    counted._dsv4_counts = True
    return counted


def install() -> bool:
    """Count replays and recordings from now on (idempotent). False on a torch without cudagraph
    trees, where nothing can be replayed."""
    try:
        from torch._inductor.cudagraph_trees import CUDAGraphNode, CUDAGraphTreeManager
    except ImportError:
        return False
    CUDAGraphNode.run = _counting(CUDAGraphNode.run, KEY)
    CUDAGraphTreeManager.record_function = _counting(CUDAGraphTreeManager.record_function, RECORDINGS_KEY)
    return True


def replays() -> int:
    """CUDA graphs replayed by Inductor's cudagraph trees since :func:`install` (process-wide,
    monotone unless someone clears dynamo's counters: take differences of calls close together)."""
    return torch._dynamo.utils.counters["inductor"][KEY]


def recordings() -> int:
    """CUDA graphs recorded by Inductor's cudagraph trees since :func:`install` (as :func:`replays`)."""
    return torch._dynamo.utils.counters["inductor"][RECORDINGS_KEY]
