"""Eager host cost of one call of each ``torch.ops.dsv4`` op (#47): what an eager model pays per layer.

Every op runs on one decode token of ``DSV4Config.tiny()``'s widths (batch 1, 64 tokens of context),
so its compute is small and the time is the call's host cost: Python glue, the dispatcher, checks,
launch metadata, allocations and launches. Five entries per op:

- ``wrapper``: the public, checked function (``dsv4_ops.ops.<op>``, also ``dsv4_ops.<op>``);
- ``unchecked``: the same inside ``dsv4_ops.ops.value_checks(False)``: metadata checks only, no device read;
- ``direct``: ``dsv4_ops.ops.direct.dsv4.<op>``, what the model's layers call: in plain eager calls the op's
  body without the dispatcher's Python layers (``direct.py``);
- ``raw``: the registered op (``torch.ops.dsv4.<op>``), through the dispatcher;
- ``checks``: the wrapper with the op stubbed to return its output: what the wrapper adds.

Baseline rows give one plain PyTorch call on the same host (``torch.add``, ``F.linear``, ``torch.empty``). On
CUDA three more rows per op time its Triton launches alone: through Triton's JIT, as the body launches them; the
JIT's argument binding and specialisation alone; and through the compiled kernels' own launchers (what a launch
cache would pay; ``same_bits``: they wrote what the JIT launches wrote).

``route`` is the path the op takes for these inputs (static: device, dtypes, shapes). Calls run under
``torch.inference_mode()``, as ``Generator``'s and ``Engine``'s eager steps do (it skips the custom
ops' Python autograd and ADInplaceOrView layers); ``--grad-mode no_grad`` is what a model called
under ``torch.no_grad()`` (HF's ``generate`` after ``hf.enable``, eager) pays.

Host time: ``--calls`` calls back to back timed with ``time.perf_counter``, median over
``--repeats`` runs, after warm-up, and beside it the process's CPU time (``time.process_time``), which
other processes on a shared CPU disturb less. On CUDA the device is synchronised before each run and the
calls are few enough that the launch queue never fills, so the time is the CPU time of the Python
call; ``gpu_us`` is the device time of one call, timed with CUDA events while the host had queued
the calls behind a spin kernel (so the GPU does not wait for the host, unless a call syncs). On the
CPU everything, the reference compute included, is host time.

``--breakdown N`` profiles the N slowest direct calls with cProfile and splits their time by where it goes
(validation, host reads, the dispatcher, op-body checks, launch metadata, Triton's launcher,
allocations, aten compute); it also counts the host reads (``.item()``, ``.tolist()``,
``bool(tensor)``, ``int(tensor)``) of one call.

    python3 benchmarks/bench_op_overhead.py --device cpu --out op_overhead_cpu.json
    python3 benchmarks/bench_op_overhead.py --device cuda --out op_overhead_cuda.json
"""
from __future__ import annotations

import argparse
import cProfile
import contextlib
import json
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `benchmarks` and `dsv4_ops`

import torch  # noqa: E402

import dsv4_ops  # noqa: E402
from dsv4_ops import lowering  # noqa: E402
from dsv4_ops import ops as dsv4  # noqa: E402
from dsv4_ops.ops import attention_sm90, direct, topk_cuda  # noqa: E402
from dsv4_ops.ops.gemv import takes_kernel as gemv_takes_kernel  # noqa: E402
from dsv4_ops.ops.moe_gemv import takes_kernel as moe_takes_kernel  # noqa: E402
from dsv4_ops.lowering.aten.experts import grouped_mm_supported  # noqa: E402
from dsv4_ops.lowering.triton import indexer as ix  # noqa: E402

OPS = ("plan", "cache_write", "compress", "indexer_topk", "sparse_attention", "sinkhorn", "gemv", "moe_gemv")
CONTEXT = 64  # tokens already cached; the step's one token is at position CONTEXT - 1


def op_inputs(op: str, B: int, dtype: torch.dtype, device: torch.device) -> tuple:
    """The arguments of one decode-token call of ``op`` at ``DSV4Config.tiny()``'s widths:
    random values, valid indices (the wrapper's checks pass)."""
    cfg = dsv4_ops.DSV4Config.tiny()
    H, D, W, m, mh = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window, cfg.csa_ratio, cfg.hca_ratio
    HI, DI, K, half = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, cfg.rope_head_dim // 2
    t, nc = CONTEXT - 1, CONTEXT // m
    i32 = dict(dtype=torch.int32, device=device)

    def randn(*shape, dt=dtype):
        return torch.randn(shape, dtype=dt, device=device)

    def distinct(n: int, k: int) -> torch.Tensor:  # [B, 1, k] distinct indices in [0, n)
        return torch.rand(B, n, device=device).argsort(-1)[:, :k].to(torch.int32)[:, None]

    if op == "plan":
        return (torch.full((B,), t, **i32), torch.ones(B, **i32), 1, 1, W, W, False, m, 2 * m, mh, mh)
    if op == "cache_write":
        return randn(B, W, D), randn(B, 1, D), torch.full((B, 1), t % W, **i32)
    if op == "compress":  # CSA: the token closes block nc - 1
        f32 = torch.float32
        angle = torch.rand(CONTEXT, half, device=device) * 6.283185307179586
        return (randn(B, 2 * m, 2 * D, dt=f32), randn(B, 2 * m, 2 * D, dt=f32), randn(B, 1, 2 * D, dt=f32),
                randn(B, 1, 2 * D, dt=f32), torch.full((B,), t, **i32), torch.full((B, 1), nc - 1, **i32),
                1 + 0.1 * randn(D), angle.cos(), angle.sin(), randn(B, nc, D), m, True, 1e-6)
    if op == "indexer_topk":
        return randn(B, 1, HI, DI), randn(B, 1, HI, dt=torch.float32), randn(B, nc, DI), \
            torch.full((B, 1), nc, **i32), K
    if op == "sparse_attention":  # CSA layer: the window ring + the indexer's picks
        return (randn(B, 1, H, D), randn(B, W, D), distinct(W, W), randn(B, nc, D), distinct(nc, K),
                torch.zeros(B, 1, **i32), randn(H, dt=torch.float32), D**-0.5)
    if op == "sinkhorn":
        hc = cfg.hc_mult
        return (torch.rand(B, 1, hc, hc, device=device) * 3).softmax(-1) + 1e-6, cfg.hc_sinkhorn_iters, cfg.hc_eps
    if op == "gemv":  # a decode token through one dense projection
        return randn(B, 1, cfg.hidden_size), randn(1, 2 * cfg.hidden_size, cfg.hidden_size)
    if op == "moe_gemv":
        E, k, I = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
        idx = torch.rand(B, E, device=device).argsort(-1)[:, :k]
        return (randn(B, cfg.hidden_size), idx, randn(B, k, dt=torch.float32).softmax(-1),
                randn(E, 2 * I, cfg.hidden_size), randn(E, cfg.hidden_size, I), 10.0)
    raise ValueError(f"unknown op {op!r}; choose from {OPS}")


def route(op: str, args: tuple) -> str:
    """The path ``op`` takes for ``args`` (the ops' own static route rules)."""
    device = next(a for a in args if isinstance(a, torch.Tensor)).device
    if op == "gemv":
        return "triton gemv" if gemv_takes_kernel(*args) else ("F.linear" if args[1].shape[0] == 1 else "einsum")
    if op == "moe_gemv":
        x, indices, _, w13, w2, _ = args
        if moe_takes_kernel(x, w13, indices.numel()):
            return "triton gemv"
        return "grouped_mm" if grouped_mm_supported(x, w13, w2) else "blocked bmm"
    if not lowering.use_triton(device.type):
        return "reference (aten)"
    if op == "sparse_attention" and attention_sm90.applies(*args[:6]):
        return "gluon sm90"
    if op == "indexer_topk":
        q, _, keys, visible, topk = args
        B, S = visible.shape
        N = ix.entries(keys)
        if ix.token_group(B, S, N) == S and topk_cuda.applies((B, S, N), q.device, topk):
            return "triton scores + cuda top-k"
    return "triton"


# ---- timing ---------------------------------------------------------------------------------
def host_us(call: Callable[[], object], device: torch.device, calls: int, repeats: int) -> dict:
    """Host µs per call over ``repeats`` runs of ``calls`` back-to-back calls: the wall clock's
    median (``host_us``) and best run (``host_us_best``), and the median CPU time of this process
    (``cpu_us``), which other processes on a shared CPU disturb much less than the wall clock."""
    for _ in range(max(5, calls // 10)):
        call()
    wall, cpu = [], []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # an empty launch queue: the run measures the host alone
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(calls):
            call()
        wall.append((time.perf_counter() - t0) / calls * 1e6)
        cpu.append((time.process_time() - c0) / calls * 1e6)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return dict(host_us=statistics.median(wall), host_us_best=min(wall), cpu_us=statistics.median(cpu))


@contextlib.contextmanager
def op_stubbed(op: str, output):
    """The op the wrapper calls (``direct.dsv4.<op>``) returns ``output`` without running: the wrapper's own
    cost remains."""
    real = getattr(direct.dsv4, op)
    setattr(direct.dsv4, op, lambda *args: output)
    try:
        yield
    finally:
        setattr(direct.dsv4, op, real)


def gpu_us(call: Callable[[], object], device: torch.device, calls: int, repeats: int) -> float:
    """Device µs per call: the calls are queued behind a spin kernel, so the GPU runs them back to
    back whatever the host costs. A call that reads a value back (a wrapper's value checks) waits
    for the device each time, so the GPU idles while the host works: its number is then about the
    host and device time added, what such a call costs in a loop."""
    runs = []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(2e6))  # ~1 ms at 2 GHz: longer than queuing the calls below takes
        start.record()
        for _ in range(calls):
            call()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(runs)


# ---- the Triton launches alone ----------------------------------------------------------------
class Launch(NamedTuple):
    kernel: object  # the @triton.jit function
    grid: tuple
    args: tuple
    meta: dict
    compiled: object  # the CompiledKernel the JIT launch ran


@contextlib.contextmanager
def recording_launches(launches: list):
    """Every ``wrap_triton(kernel)[grid](*args, **meta)`` of the op bodies runs as usual and is recorded."""
    modules = [m for name, m in list(sys.modules.items())
               if name.startswith("dsv4_ops.ops.") and hasattr(m, "wrap_triton")]
    real = torch.library.wrap_triton

    class Recording:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **meta):
                compiled = self.kernel[grid](*args, **meta)
                launches.append(Launch(self.kernel, tuple(grid), args, meta, compiled))
                return compiled
            return launch

    for m in modules:
        m.wrap_triton = Recording
    try:
        yield launches
    finally:
        for m in modules:
            m.wrap_triton = real


def compiled_launcher(launch: Launch) -> Callable[[], None]:
    """The launch through its compiled kernel's launcher, skipping Triton's JIT dispatch (argument binding,
    specialisation, cache key, knobs): every parameter in order, constexprs included, as ``JITFunction.run`` passes
    them."""
    k, names = launch.compiled, [p.name for p in launch.kernel.params]
    bound = {**dict(zip(names, launch.args)), **{n: v for n, v in launch.meta.items() if n in names}}
    values = [bound[n] if n in bound else p.default for n, p in zip(names, launch.kernel.params)]
    g = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
    run, function, packed = k.run, k.function, k.packed_metadata

    def call() -> None:
        run(g[0], g[1], g[2], torch.cuda.current_stream().cuda_stream, function, packed, None, None, None, *values)
    return call


def launch_rows(op: str, inputs: tuple, device: torch.device, args) -> list[dict]:
    """What the op's Triton launches cost alone: replayed through Triton's JIT (``kernel[grid](...)``, what the body
    does) and through the compiled kernels' launchers. Both replays start from the same sentinel in every tensor the
    launches may write (those the body allocated and the op's mutated inputs) and must leave the same bits."""
    launches: list[Launch] = []
    with recording_launches(launches):
        getattr(direct.dsv4, op)(*inputs)
    launches = [la for la in launches if hasattr(la.compiled, "packed_metadata")]
    if not launches:
        return []
    jit = [lambda la=la: la.kernel[la.grid](*la.args, **la.meta) for la in launches]
    fast = [compiled_launcher(la) for la in launches]
    read_only = {t.untyped_storage().data_ptr() for i, t in enumerate(inputs)
                 if isinstance(t, torch.Tensor) and i not in getattr(direct.dsv4, op).mutated}
    written = {id(t): t for la in launches for t in la.args
               if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in read_only}

    def replayed(calls) -> list[torch.Tensor]:
        for t in written.values():
            t.fill_(float("nan") if t.is_floating_point() else 77)
        for call in calls:
            call()
        return [t.clone() for t in written.values()]

    same = all(torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, equal_nan=True))
               for a, b in zip(replayed(jit), replayed(fast)))
    # the JIT's argument binding and specialisation alone (a launch cache keyed like the JIT would still pay it)
    binders = [la.kernel.device_caches[torch.cuda.current_device()][4] for la in launches]
    bind = [lambda b=b, la=la: b(*la.args, **la.meta) for b, la in zip(binders, launches)]
    rows = []
    for entry, calls in (("triton jit", jit), ("jit binder", bind), ("compiled launcher", fast)):
        def replay(calls=calls):
            for c in calls:
                c()
        rows.append(dict(op=op, entry=entry, route=f"{len(launches)} launch(es), {'same' if same else 'OTHER'} bits",
                         **host_us(replay, device, args.calls, args.repeats), same_bits=same))
    return rows


# ---- where the host time goes -----------------------------------------------------------------
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__")


@contextlib.contextmanager
def counting_host_reads(counts: dict):
    """Count the calls of ``Tensor.item`` / ``.tolist`` / ``bool()`` / ``int()`` / ``float()``."""
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(name, fn):
        def wrapper(self, *args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return fn(self, *args, **kwargs)
        return wrapper

    for name, fn in saved.items():
        setattr(torch.Tensor, name, counted(name, fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


ALLOCATIONS = ("empty", "empty_like", "new_empty", "zeros", "zeros_like", "new_zeros", "full", "full_like",
               "new_full", "ones", "ones_like", "empty_strided")


# the custom op's Python layers: autograd / ADInplaceOrView / backend kernels, the redispatches,
# the dynamo-disable wrapper around the kernel, default filling
DISPATCH_FILES = ("/torch/_ops.py", "/torch/_library/", "/torch/_dynamo/", "/torch/utils/_python_dispatch.py",
                  "/torch/autograd/", "/torch/_subclasses/")


def category(file: str, func: str) -> str:
    """Which part of a call a profiled function's own time belongs to."""
    file = file.replace("\\", "/")
    if file == "~":  # a builtin: an aten op, a host read, an allocation or plain Python
        name = func.split("'")[1] if "'" in func else func
        name = name.rsplit(".", 1)[-1]
        if name in HOST_READS or name == "nonzero":
            return "host reads (.item/.tolist/bool)"
        if name in ALLOCATIONS:
            return "tensor allocation"
        if "torch" in func:
            return "aten ops (compute, views, checks)"
        return "python builtins"
    if "/dsv4_ops/ops/validate.py" in file:
        return "validation"
    if "/dsv4_ops/ops/" in file:
        # public wrappers are named like the op; the triton_op bodies start with "_", as does _backend.py
        return "op body (triton_op)" if func.startswith("_") or file.endswith("/_backend.py") else "validation"
    if "/dsv4_ops/reference/" in file:
        return "reference (Python glue)"
    if "/lowering/" in file:
        return "launch metadata"
    if "/triton/" in file:
        return "triton launcher"
    if "/torch/__init__.py" in file:  # torch._check and friends, in the op bodies
        return "op body (triton_op)"
    if any(part in file for part in DISPATCH_FILES):
        return "dispatcher (custom op)"
    if "/torch/" in file:
        return "torch Python (einsum, F.*, Tensor methods)"
    return "other Python"


def breakdown(call: Callable[[], object], calls: int) -> dict:
    """cProfile of ``calls`` calls: µs per call by :func:`category`, and the host reads of one call."""
    for _ in range(10):
        call()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    parts: dict[str, float] = {}
    for (file, _, func), (_, _, tottime, _, _) in pstats.Stats(prof).stats.items():
        key = category(file, func)
        parts[key] = parts.get(key, 0.0) + tottime * 1e6 / calls
    counts: dict[str, int] = {}
    with counting_host_reads(counts):
        call()
    return dict(us_by_part=dict(sorted(parts.items(), key=lambda kv: -kv[1])), host_reads_per_call=counts)


def baselines(dtype: torch.dtype, device: torch.device, args) -> list[dict]:
    """What one plain PyTorch call costs on this host, for scale: an elementwise aten op, ``F.linear``
    at the gemv row's widths, and an allocation."""
    x, w = torch.randn(1, 256, dtype=dtype, device=device), torch.randn(512, 256, dtype=dtype, device=device)
    calls = {"torch.add": lambda: torch.add(x, x), "F.linear": lambda: torch.nn.functional.linear(x, w),
             "torch.empty": lambda: torch.empty(256, dtype=dtype, device=device)}
    return [dict(op=name, entry="baseline", route="aten", **host_us(call, device, args.calls, args.repeats))
            for name, call in calls.items()]


# ---- the table --------------------------------------------------------------------------------
def run(args) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for op in args.ops:
        inputs = op_inputs(op, args.batch, dtype, device)
        wrapper, raw = getattr(dsv4, op), getattr(torch.ops.dsv4, op)
        # wrapper: the public call; unchecked: the same with its value checks off; direct: what the model's layers
        # call; raw: the op through the dispatcher; checks: the wrapper's own cost (its checks and glue), with the op
        # stubbed to return its output
        none = contextlib.nullcontext()
        entries = {"wrapper": (wrapper, none), "unchecked": (wrapper, dsv4.value_checks(False)),
                   "direct": (getattr(direct.dsv4, op), none), "raw": (raw, none),
                   "checks": (wrapper, op_stubbed(op, raw(*inputs)))}
        for entry, (fn, context) in entries.items():
            def call(fn=fn, inputs=inputs):
                return fn(*inputs)
            with context:
                row = dict(op=op, entry=entry, route=route(op, inputs), **host_us(call, device, args.calls,
                                                                                  args.repeats))
                if device.type == "cuda" and entry in ("wrapper", "unchecked", "direct"):
                    row["gpu_us"] = gpu_us(call, device, args.calls, args.repeats)
            rows.append(row)
            print(f"{op:17s} {entry:9s} {row['route']:28s} {row['host_us']:9.1f} us (CPU time {row['cpu_us']:.1f})",
                  file=sys.stderr)
        if device.type == "cuda":
            rows += launch_rows(op, inputs, device, args)
    rows += baselines(dtype, device, args)
    # the direct call is what an eager model pays per layer; the wrapper's surplus is its checks (their own rows)
    for row in sorted((r for r in rows if r["entry"] == "direct"), key=lambda r: -r["host_us"])[: args.breakdown]:
        inputs = op_inputs(row["op"], args.batch, dtype, device)
        fn = getattr(direct.dsv4, row["op"])
        row["breakdown"] = breakdown(lambda: fn(*inputs), args.calls)
    return dict(device=str(device), device_name=torch.cuda.get_device_name(device) if device.type == "cuda"
                else platform.processor() or platform.machine(),
                torch=torch.__version__, backend=lowering.BACKEND, dtype=str(dtype).removeprefix("torch."),
                batch=args.batch, context=CONTEXT, calls=args.calls, repeats=args.repeats,
                cpu_threads=torch.get_num_threads(), rows=rows)


def table(result: dict) -> str:
    gpu = result["device"].startswith("cuda")
    head = "| op | entry | route | host µs / call | best run | CPU time µs / call |" + (" GPU µs / call |" * gpu)
    lines = [f"Eager host cost per call: {result['device']} ({result['device_name']}), torch {result['torch']}, "
             f"{result['dtype']}, batch {result['batch']}, tiny widths, {result['grad_mode']}; "
             f"median of {result['repeats']} x {result['calls']} calls", "",
             head, "|---|---|---|---:|---:|---:|" + "---:|" * gpu]
    for r in result["rows"]:
        lines.append(f"| {r['op']} | {r['entry']} | {r['route']} | {r['host_us']:.1f} | {r['host_us_best']:.1f} | "
                     f"{r['cpu_us']:.1f} |" + (f" {r['gpu_us']:.1f} |" if "gpu_us" in r else " – |" * gpu))
    for r in result["rows"]:
        if "breakdown" not in r:
            continue
        b = r["breakdown"]
        reads = ", ".join(f"{k} x{v}" for k, v in b["host_reads_per_call"].items()) or "none"
        lines += ["", f"Where the host time of `{r['op']}` ({r['entry']}) goes (cProfile, own time, µs / call; "
                      f"the profiler inflates each Python call); host reads per call: {reads}", "",
                  "| part | µs / call |", "|---|---:|"]
        lines += [f"| {part} | {us:.1f} |" for part, us in b["us_by_part"].items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="activations (default: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--threads", type=int, default=1,
                   help="torch's intra-op threads (0: torch's default). Tiny ops gain nothing from them, and on a "
                        "shared CPU their spin-waits swamp the timings")
    p.add_argument("--grad-mode", default="inference_mode", choices=("no_grad", "inference_mode", "enabled"))
    p.add_argument("--calls", type=int, default=200, help="calls per timed run")
    p.add_argument("--repeats", type=int, default=7, help="timed runs; the median is reported")
    p.add_argument("--breakdown", type=int, default=3, help="profile the N slowest rows (0: none)")
    p.add_argument("--out", default=None, help="write the JSON here")
    args = p.parse_args(argv)
    # inference_mode: what Generator's eager steps run under; no_grad also runs the custom ops' Python
    # autograd and ADInplaceOrView layers
    grad_mode = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "enabled": torch.enable_grad}
    with grad_mode[args.grad_mode]():
        result = run(args)
    result["grad_mode"] = args.grad_mode
    print(table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
