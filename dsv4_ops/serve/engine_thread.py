"""The engine on its own thread, for an asyncio frontend: the engine is not thread-safe, so every
call to it happens on this thread; the frontend sends commands through a queue and gets each
request's outputs on an asyncio queue of its own.

One thread is enough: a step is GPU (or, on CPU, torch-threaded) work that releases the GIL, and
the frontend only tokenises, detokenises and writes bytes (serving_design.md §7.5 puts the engine
in a second process; a thread keeps one model in one process, which a CPU test and a user's
notebook both need).
"""
from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from concurrent.futures import Future

from .engine import Engine, RequestOutput

__all__ = ["EngineThread", "Overloaded"]


def own_cudagraph_trees() -> None:
    """Give the calling thread its own CUDA-graph trees state. torch before 2.13 sets that state up
    only on the thread that imported ``torch._inductor.cudagraph_trees`` and asserts on any other
    (pytorch#123177), so the engine thread, which compiles, records and replays every step, could
    not record a graph; newer torch does this itself on first use."""
    try:
        from torch._inductor import cudagraph_trees as trees
    except ImportError:
        return
    if not hasattr(trees.local, "tree_manager_containers"):
        trees.local.tree_manager_containers = {}
        trees.local.tree_manager_locks = collections.defaultdict(threading.Lock)


class Overloaded(RuntimeError):
    """More requests than the engine runs plus the waiting queue holds."""


class EngineThread:
    """Runs ``engine.step()`` while it has work. ``max_waiting`` bounds the requests that wait for
    a slot; past it ``submit`` raises :class:`Overloaded`."""

    def __init__(self, engine: Engine, max_waiting: int = 256) -> None:
        self.engine, self.max_waiting = engine, max_waiting
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._open = 0  # submitted and not finished
        self._open_lock = threading.Lock()
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dsv4-engine", daemon=True)

    def start(self, warmup=None) -> "EngineThread":
        """Start the loop; ``warmup(engine)`` runs on the thread first (compiles, records graphs),
        and ``ready`` is set after it. Warm up here rather than on the caller's thread, so that
        every compiled step, and every CUDA graph, belongs to the thread that runs them."""
        self._warmup = warmup
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout)

    # ------------------------------------------------------------------ frontend side
    async def submit(self, prompt_ids: list[int], **kw) -> tuple[int, asyncio.Queue]:
        """Queue a request -> ``(request id, queue of RequestOutput)``. The engine's checks run
        on its thread; a ValueError comes back here."""
        with self._open_lock:
            if self._open >= self.engine.max_running + self.max_waiting:
                raise Overloaded(f"{self._open} requests open (max_running {self.engine.max_running} + max_waiting "
                                 f"{self.max_waiting})")
            self._open += 1
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        done: Future = Future()
        self._inbox.put(("add", prompt_ids, kw, loop, out, done))
        return await asyncio.wrap_future(done), out

    def abort(self, rid: int) -> None:
        self._inbox.put(("abort", rid))

    @property
    def open_requests(self) -> int:
        return self._open

    # ------------------------------------------------------------------ engine side
    def _loop(self) -> None:
        try:
            own_cudagraph_trees()
            if self._warmup is not None:
                self._warmup(self.engine)
            self.ready.set()
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    for o in self.engine.step():
                        self._deliver(o)
        except BaseException as e:  # noqa: BLE001  (reported by /health; the frontend answers 503)
            self.error = e
            self.ready.clear()
            for loop, q in self._sinks.values():
                loop.call_soon_threadsafe(q.put_nowait, e)
            raise

    def _drain(self, block: bool) -> None:
        while True:
            try:
                cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if cmd[0] == "add":
                _, prompt_ids, kw, loop, out, done = cmd
                try:
                    rid = self.engine.add_request(prompt_ids, **kw)
                except ValueError as e:
                    self._closed()
                    done.set_exception(e)
                    continue
                self._sinks[rid] = (loop, out)
                done.set_result(rid)
            elif cmd[0] == "abort" and cmd[1] in self._sinks:
                try:
                    self.engine.abort(cmd[1])
                except ValueError:
                    pass  # finished in the meantime

    def _closed(self) -> None:
        with self._open_lock:
            self._open -= 1

    def _deliver(self, o: RequestOutput) -> None:
        sink = self._sinks.get(o.request_id)
        if sink is None:
            return
        loop, q = sink
        if o.finished:
            del self._sinks[o.request_id]
            self._closed()
        loop.call_soon_threadsafe(q.put_nowait, (o, time.perf_counter()))
