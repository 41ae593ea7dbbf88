"""The one timer of every benchmark (DESIGN.md §6): median of many samples after warm-up.

Two kinds of rows:

- **Kernel rows** (``kernel_time``; ``bench_ops.py``, ``tools/sweep_kernels.py``): one op on prepared
  inputs. CUDA: ``triton.testing.do_bench_cudagraph`` -- the calls are captured into a CUDA
  graph and replayed, so the time is device time without the Python / dispatcher cost of an
  eager call (tens of us, which would swamp the few-us decode kernels); median of its replays.
  L2: one timed pass calls the op once on each of several independent input copies
  (``rotation_copies``), chosen so that a pass touches at least twice the L2 cache; every call
  then reads from HBM, as in a real decode step where the other layers' traffic evicts the
  cache in between. If capture fails (an op that syncs the host) or runs out of memory, the
  fallback is ``triton.testing.do_bench`` (one CUDA-event pair per call, L2 flushed before each;
  it can include launch overhead for tiny ops), marked ``method="do_bench"``.
- **Public-call rows** (``time_call``; ``bench_model.py``, ``bench_spec.py``, ``tools/profile_step.py``):
  what a user calls (``Generator.prefill`` / ``decode`` / ``generate``, ``AOTIGenerator``, HF).
  CUDA: one CUDA-event pair around each call, median over ``iters`` calls after ``warmup``
  calls. ``sync_each=False`` times the calls back to back, as a generation loop issues them (a
  call's time is then what it adds to the loop: device time, or host time when the host is
  slower); ``sync_each=True`` waits for each call before the next (each call timed alone:
  prefill). ``wall_ms`` is the host wall clock per call over the same loop.

CPU (smoke runs and tests): wall-clock median, ``method="cpu"``.
"""
from __future__ import annotations

import math
import statistics
import time
import warnings
from typing import Callable, NamedTuple, Sequence

import torch

L2_FALLBACK_BYTES = 50 * 2**20  # H100 / H200 L2, when the device does not report its size
MAX_COPIES = 128  # past this, a graph of one pass over the copies gets large for little gain


class Timing(NamedTuple):
    ms: float  # median time of one call
    method: str  # "cuda_graph" (do_bench_cudagraph), "do_bench", "cuda_events" or "cpu"
    samples: int  # how many samples the median is over
    wall_ms: float | None = None  # host wall clock per call over the timed loop (public calls)

    @property
    def us(self) -> float:
        return self.ms * 1e3


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- kernel rows ------------------------------------------------------------------------------
def kernel_time(calls: Sequence[Callable[[], object]], device: torch.device, target_ms: float = 100.0) -> Timing:
    """Median time of one call of ``calls`` (each the op on its own input copy); about
    ``target_ms`` of device time in samples (10 replays of ``target_ms / 10`` each on CUDA)."""
    if device.type != "cuda":
        return _cpu_calls(calls, target_ms)
    from triton.testing import do_bench, do_bench_cudagraph

    def one_pass() -> None:
        for f in calls:
            f()

    rep = max(target_ms / 10, 1.0)
    try:
        torch.cuda.empty_cache()  # the graph gets its own pool: do not also keep cached eager blocks
        times = do_bench_cudagraph(one_pass, rep=rep, return_mode="all")
        return Timing(statistics.median(times) / len(calls), "cuda_graph", len(times))
    except torch.cuda.OutOfMemoryError as e:
        why = f"out of memory ({str(e).splitlines()[0]})"
    except RuntimeError as e:  # e.g. an op that syncs the host cannot be captured
        why = f"{type(e).__name__}: {e}"
    warnings.warn(f"CUDA-graph timing failed ({why}); timing with triton.testing.do_bench instead")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    times = do_bench(calls[0], warmup=max(target_ms / 4, 1.0), rep=target_ms, return_mode="all")
    return Timing(statistics.median(times), "do_bench", len(times))


def _cpu_calls(calls: Sequence[Callable[[], object]], target_ms: float) -> Timing:
    for f in calls[:2]:
        f()
    times: list[float] = []
    deadline = time.perf_counter() + target_ms / 1e3
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 50):
        t = time.perf_counter()
        calls[len(times) % len(calls)]()
        times.append(time.perf_counter() - t)
    return Timing(statistics.median(times) * 1e3, "cpu", len(times))


# ---- public-call rows -------------------------------------------------------------------------
def time_call(fn: Callable[[], object], device: torch.device | str, warmup: int = 3, iters: int = 30,
              sync_each: bool = False) -> Timing:
    """Median time of ``fn()`` over ``iters`` calls after ``warmup`` calls (see the module
    docstring for ``sync_each``). ``device``: where ``fn``'s work runs."""
    if iters < 1:
        raise ValueError(f"time_call: iters must be >= 1, got {iters}")
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    _sync(device)
    if device.type != "cuda":
        times = []
        t0 = time.perf_counter()
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return Timing(statistics.median(times), "cpu", iters, (time.perf_counter() - t0) * 1e3 / iters)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    t0 = time.perf_counter()
    for a, b in events:
        a.record()
        fn()
        b.record()
        if sync_each:
            b.synchronize()
    torch.cuda.synchronize(device)
    wall = (time.perf_counter() - t0) * 1e3 / iters
    return Timing(statistics.median(a.elapsed_time(b) for a, b in events), "cuda_events", iters, wall)


def first_call_s(fn: Callable[[], object], device: torch.device | str) -> float:
    """Wall-clock seconds of one call until its work is done (a first call: compile / load)."""
    t0 = time.perf_counter()
    fn()
    _sync(torch.device(device))
    return time.perf_counter() - t0
