"""Device time of one call: median of CUDA-event samples after warm-up (DESIGN.md §6).

CUDA: the calls are captured into a CUDA graph and the graph is replayed. Replays measure
device time only -- the Python / dispatcher cost of an eager call (tens of us) would otherwise
swamp the few-us decode kernels -- and each CUDA-event sample spans several back-to-back
replays of many calls, so graph-launch latency is amortised to a negligible share. The calls
cycle over independent copies of the inputs (``rotation_copies``) so that the data they touch
exceeds the L2 cache twice over: every call then reads from HBM, as in a real decode step, where
the other layers' traffic evicts the cache in between. If capture fails, the fallback is one
CUDA-event pair per call with an L2 flush before each (like ``triton.testing.do_bench``); that
can include dispatch overhead for tiny ops and is marked ``method="cuda_events"``.

CPU (smoke runs only): wall-clock median.
"""
from __future__ import annotations

import math
import statistics
import time
import warnings
from typing import Callable, NamedTuple

import torch

L2_FALLBACK_BYTES = 50 * 2**20  # H100 / H200 L2, when the device does not report its size
MAX_COPIES = 128  # past this, a graph of one pass over the copies gets large for little gain
SAMPLE_MS = 10.0  # device time one CUDA-event sample should span


class Timing(NamedTuple):
    us: float  # median time of one call
    method: str  # "cuda_graph", "cuda_events" or "cpu"
    calls: int  # calls per sample (replays x calls per graph)
    samples: int


def l2_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        return int(size) or L2_FALLBACK_BYTES
    return L2_FALLBACK_BYTES


def rotation_copies(touched: int, alloc: int, l2: int, budget: int, max_copies: int = MAX_COPIES) -> int:
    """Input copies to cycle through so that one pass touches ``>= 2 * l2`` bytes (then no call
    finds its data in L2), at most ``max_copies`` and at most ``budget`` bytes of copies; >= 1."""
    want = math.ceil(2 * l2 / max(touched, 1))
    return max(1, min(want, max_copies, budget // max(alloc, 1)))


def time_calls(calls: list[Callable[[], object]], device: torch.device, target_ms: float = 100.0) -> Timing:
    """Median time of one call of ``calls`` (each is one input copy), about ``target_ms`` of samples."""
    if device.type != "cuda":
        return _cpu(calls, target_ms)
    try:
        return _cuda_graph(calls, target_ms)
    except torch.cuda.OutOfMemoryError:
        raise
    except RuntimeError as e:  # e.g. an op that syncs the host cannot be captured
        warnings.warn(f"CUDA-graph timing failed ({type(e).__name__}: {e}); timing eager calls instead")
        torch.cuda.synchronize()
        return _cuda_events(calls, target_ms, l2_bytes(device))


def _event_ms(fn: Callable[[], object], repeat: int = 1) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(repeat):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def _cuda_graph(calls, target_ms: float, min_graph_ms: float = 2.0, max_graph_calls: int = 512) -> Timing:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (Triton JIT, library handles) off the capture stream
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    # eager estimate (over-estimates tiny ops: it includes dispatch) -> calls per graph
    est = statistics.median(_event_ms(calls[0]) for _ in range(3))
    n = max(len(calls), min(math.ceil(min_graph_ms / max(est, 1e-3)), max_graph_calls))
    torch.cuda.empty_cache()  # the graph gets its own pool: do not also keep the eager calls' blocks
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            calls[i % len(calls)]()
    graph.replay()
    replay_ms = _event_ms(graph.replay)
    reps = max(1, math.ceil(SAMPLE_MS / max(replay_ms, 1e-3)))  # back-to-back replays per sample
    samples = min(20, max(5, math.ceil(target_ms / max(reps * replay_ms, 1e-3))))
    times = [_event_ms(graph.replay, reps) for _ in range(samples)]
    del graph
    return Timing(statistics.median(times) * 1e3 / (reps * n), "cuda_graph", reps * n, samples)


def _cuda_events(calls, target_ms: float, l2: int) -> Timing:
    flush = torch.empty(2 * l2, dtype=torch.int8, device="cuda")
    for f in calls:
        f()
    torch.cuda.synchronize()
    est = statistics.median(_event_ms(calls[0]) for _ in range(3))
    n = min(200, max(10, math.ceil(target_ms / max(est, 1e-3))))
    pairs = []
    for i in range(n):
        flush.zero_()  # evicts L2; the GPU is busy with it while the CPU enqueues the call
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        calls[i % len(calls)]()
        b.record()
        pairs.append((a, b))
    torch.cuda.synchronize()
    return Timing(statistics.median(a.elapsed_time(b) for a, b in pairs) * 1e3, "cuda_events", 1, n)


def _cpu(calls, target_ms: float) -> Timing:
    for f in calls[:2]:
        f()
    times: list[float] = []
    deadline = time.perf_counter() + target_ms / 1e3
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 50):
        t = time.perf_counter()
        calls[len(times) % len(calls)]()
        times.append(time.perf_counter() - t)
    return Timing(statistics.median(times) * 1e6, "cpu", 1, len(times))
