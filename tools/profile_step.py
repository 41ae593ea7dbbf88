"""Where a step's time goes: the kernels of the public calls, grouped by name (torch.profiler).

Builds the bench config (benchmarks/bench_model.py; ``--config flash-slice``: the Flash slice) and a ``Generator`` (compile=True, CUDA
graphs). Plain decode: prefill ``--batch`` prompts of ``--context`` tokens, warm up, then profile
``--reps`` ``gen.decode(ids)`` calls: kernels per call. With ``--spec k``: a
``Generator(spec_steps=k)``, and the profiles of ``generate`` at two lengths are subtracted, so
the prefill's kernels cancel and what is left, divided by the step difference, is one
speculative step. With ``--engine``: the serving ``Engine``'s decode iterations (``step()`` after
the prompts' prefill, ``--batch`` requests), kernels and host per iteration. With ``--parts prefill``: one
``gen.prefill(prompts)`` of the ``--batch`` x ``--context`` prompt (``--prefill-chunk``, default the chunk buckets), where
time to first token goes. Prints per step: kernel count, summed kernel time, the step's time
(benchmarks/timing.py) -- the gap to the kernel sum is launch / host time -- and the top kernels.

    python3 tools/profile_step.py --batch 1 --context 4096 [--spec 3 | --engine] [--config flash-slice] [--out f.json]
    python3 tools/profile_step.py --config flash-slice --parts prefill [--prefill-chunk 2048]
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `benchmarks` and `dsv4_ops`

from benchmarks.bench_model import bench_config  # noqa: E402
from benchmarks.bench_spec import step_cost  # noqa: E402
from benchmarks.timing import time_call  # noqa: E402
from dsv4_ops import Generator  # noqa: E402
from dsv4_ops.serve import Engine  # noqa: E402
from benchmarks.random_weights import CONFIGS, bench_setup  # noqa: E402


def kernels(fn) -> dict[str, list[float]]:
    """``{kernel name: [device us, ...]}`` of one ``fn()`` call (memcpy / memset left out)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in ev.name and "Memset" not in ev.name:
            by_name[ev.name].append(ev.device_time_total)
    return by_name


def table(by_name: dict[str, tuple[float, float]], step_ms: float, label: str, log) -> dict:
    """``by_name``: ``{name: (launches per step, us per step)}`` -> the printed, JSON-able table."""
    rows = [dict(name=n, per_step=c, us_per_step=us) for n, (c, us) in by_name.items() if c > 0.01 or us > 0.01]
    rows.sort(key=lambda r: -r["us_per_step"])
    tab = dict(step_ms=step_ms, kernels_per_step=sum(r["per_step"] for r in rows),
               kernel_us_per_step=sum(r["us_per_step"] for r in rows), rows=rows)
    log(f"{label}: step {step_ms * 1e3:.0f} us, {tab['kernels_per_step']:.0f} kernels, "
        f"kernel time {tab['kernel_us_per_step']:.0f} us")
    for r in rows[:40]:
        log(f"   {r['us_per_step']:8.1f} us  x{r['per_step']:<4.0f} {r['name'][:110]}")
    return tab


def host_profile(fn, reps: int, log, top: int = 25) -> list[dict]:
    """Where the host spends a public call (cProfile over ``fn()``, ``reps`` calls): the ``top``
    functions by own time, per call. The call's time minus its kernels' is host work the GPU waits
    for, since ``decode`` synchronises."""
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    fn()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, name), (_, calls, own, cum, _) in stats.stats.items():
        rows.append(dict(where=f"{Path(file).name}:{line}:{name}", calls_per_call=calls / reps,
                         own_us=own / reps * 1e6, cum_us=cum / reps * 1e6))
    rows.sort(key=lambda r: -r["own_us"])
    log(f"host, per call (cProfile, {reps} calls; profiling slows Python down): own us / cumulative us / calls")
    for r in rows[:top]:
        log(f"   {r['own_us']:8.1f} {r['cum_us']:9.1f} {r['calls_per_call']:7.1f}  {r['where'][:100]}")
    return rows[:200]


def engine_decode(model, prompts: list[list[int]], reps: int, log) -> dict:
    """The Engine's decode iterations: its prompts prefilled first, then ``reps`` ``step()`` calls
    timed, profiled (kernels) and profiled again (host), each on fresh requests."""
    ctx = len(prompts[0])
    eng = Engine(model, max_running=len(prompts), max_seq_len=ctx + 4 * reps + 64, prefix_cache=False)

    def decoding() -> None:  # the running requests done, fresh ones stepped to their first token: later steps decode
        while eng.has_unfinished():
            eng.step()
        ids = {eng.add_request(p, max_new_tokens=reps + 2) for p in prompts}
        started: set[int] = set()
        while started != ids:
            started |= {o.request_id for o in eng.step() if o.new_token_ids}

    eng.generate(prompts, max_new_tokens=4)  # compiles and records every step this uses
    decoding()
    for _ in range(2):
        eng.step()
    torch.cuda.synchronize()
    t0, s0 = time.perf_counter(), eng.stats["decode_steps"]
    for _ in range(reps - 2):
        eng.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) * 1e3 / (eng.stats["decode_steps"] - s0)
    decoding()
    s0 = eng.stats["decode_steps"]
    got = kernels(lambda: [eng.step() for _ in range(reps)])
    n = eng.stats["decode_steps"] - s0
    tab = table({k: (len(v) / n, sum(v) / n) for k, v in got.items()}, step_ms,
                f"engine step() B={len(prompts)} ctx={ctx}", log)
    decoding()
    tab["host"] = host_profile(lambda: [eng.step() for _ in range(reps)], reps, log)
    return tab


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10, help="decode calls profiled")
    ap.add_argument("--spec", type=int, default=0, help="also profile the speculative step with k drafts")
    ap.add_argument("--new-tokens", type=int, nargs=2, default=[8, 40], metavar=("N_SHORT", "N_LONG"))
    ap.add_argument("--engine", action="store_true", help="also profile the serving Engine's decode iterations")
    ap.add_argument("--config", choices=CONFIGS, default="bench")
    ap.add_argument("--parts", nargs="+", choices=("decode", "prefill"), default=["decode"],
                    help="prefill: also one prefill call's kernels and host time")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="the Generator's prefill_chunk (default: buckets)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.device, args.smoke, args.layers = "cuda", False, 2
    log = lambda m: print(m, flush=True)  # noqa: E731
    _, cfg, model = bench_setup(args, "profile_step.py", bench_config)
    B, ctx = args.batch, args.context
    prompts = torch.randint(0, cfg.vocab_size, (B, ctx)).tolist()
    res = {}
    gen = Generator(model, max_batch_size=B, max_seq_len=ctx + 256, compile=True, prefill_chunk=args.prefill_chunk)
    gen.prefill(prompts)  # compiles the prefill chunks
    if "prefill" in args.parts:
        t = time_call(lambda: gen.prefill(prompts), "cuda", warmup=1, iters=3, sync_each=True)
        got = kernels(lambda: gen.prefill(prompts))
        res["prefill"] = table({n: (len(v), sum(v)) for n, v in got.items()}, t.ms,
                               f"prefill B={B} x {ctx} (chunk {args.prefill_chunk or 'buckets'})", log)
        res["prefill"]["host"] = host_profile(lambda: gen.prefill(prompts), 1, log)
    if "decode" in args.parts:
        ids = torch.randint(0, cfg.vocab_size, (B,), device="cuda")
        t = time_call(lambda: gen.decode(ids), "cuda", warmup=5, iters=50)

        def decode_reps() -> None:
            for _ in range(args.reps):
                gen.decode(ids)

        got = kernels(decode_reps)
        per = {n: (len(v) / args.reps, sum(v) / args.reps) for n, v in got.items()}
        res["decode"] = table(per, t.ms, f"decode B={B} ctx={ctx}", log)
        res["decode"]["host"] = host_profile(decode_reps, args.reps, log)
    del gen
    if args.spec:
        n_short, n_long = args.new_tokens
        gen = Generator(model, max_batch_size=B, max_seq_len=ctx + n_long + 16, spec_steps=args.spec, compile=True)
        cost = step_cost(gen, prompts, n_short, n_long, "cuda", samples=3)
        steps = []
        profiles = []
        for n in (n_short, n_long):
            before = gen.stats["decode_steps"]
            profiles.append(kernels(lambda: gen.generate(prompts, max_new_tokens=n)))
            steps.append(gen.stats["decode_steps"] - before)
        d = steps[1] - steps[0]
        short, long = profiles
        per = {n: ((len(long.get(n, [])) - len(short.get(n, []))) / d,
                   (sum(long.get(n, [])) - sum(short.get(n, []))) / d) for n in set(short) | set(long)}
        res["spec"] = table(per, cost["step_ms"], f"spec k={args.spec} B={B} ctx={ctx} (generate {n_long} - {n_short})",
                            log)
        res["spec"]["cost"] = cost
    if args.engine:
        res["engine"] = engine_decode(model, prompts, args.reps, log)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
