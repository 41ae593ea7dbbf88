"""Where a CUDA-graphed step's time goes: the kernels of one replay, grouped by name.

Builds the bench config (benchmarks/bench_model.py), compiles a decode step (and, with
``--spec k``, a speculative step), captures it as a CUDA graph at a synthetic context and
profiles replays with torch.profiler. Prints, per step: kernel count, summed kernel time, the
replay's wall time (so the gap between kernels shows), and the top kernels by time.

    python benchmarks/profile_step.py --batch 1 --context 4096 [--spec 3] [--out prof.json]
"""
from __future__ import annotations

import argparse
import collections
import json

import torch
from torch.profiler import ProfilerActivity, profile

from bench_model import bench_config, cuda_time_ms, synthetic_context
from bench_spec import graphed, reset_spec
from dsv4_ops import Generator
from dsv4_ops.demo import random_model


def kernel_table(graph: torch.cuda.CUDAGraph, reps: int = 10) -> dict:
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in ev.name and "Memset" not in ev.name:
            by_name[ev.name].append(ev.device_time_total)
    rows = [{"name": n, "per_step": len(t) / reps, "us_per_step": sum(t) / reps} for n, t in by_name.items()]
    rows.sort(key=lambda r: -r["us_per_step"])
    return {"kernels_per_step": sum(r["per_step"] for r in rows),
            "kernel_us_per_step": sum(r["us_per_step"] for r in rows), "rows": rows}


def report(label: str, graph, log) -> dict:
    t = cuda_time_ms(graph.replay, iters=50)
    tab = kernel_table(graph)
    tab["replay_ms"] = t
    log(f"{label}: replay {t * 1e3:.0f} us, {tab['kernels_per_step']:.0f} kernels, "
        f"kernel time {tab['kernel_us_per_step']:.0f} us")
    for r in tab["rows"][:25]:
        log(f"   {r['us_per_step']:8.1f} us  x{r['per_step']:<4.0f} {r['name'][:110]}")
    return tab


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--spec", type=int, default=0, help="also profile the speculative step with k drafts")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    log = lambda m: print(m, flush=True)  # noqa: E731
    cfg = bench_config()
    model = random_model(cfg, dtype=torch.bfloat16, device="cuda")
    B, ctx = args.batch, args.context
    res = {}
    gen = Generator(model, max_batch_size=B, max_seq_len=ctx + 512, compile=False, spec_steps=args.spec)
    synthetic_context(gen, B, ctx)
    ids = torch.randint(0, cfg.vocab_size, (B,), device="cuda")
    ones = torch.ones(B, dtype=torch.int32, device="cuda")
    gen.lengths.fill_(ctx)
    g, _ = graphed(torch.compile(gen._decode_step, fullgraph=True, dynamic=False), ids, ones)
    gen.lengths.fill_(ctx)
    res["decode"] = report(f"decode B={B} ctx={ctx}", g, log)
    del g
    if args.spec:
        reset_spec(gen, B, ctx, ids, args.spec)
        g, _ = graphed(torch.compile(gen.spec.step, fullgraph=True, dynamic=False), ones)
        gen.lengths.fill_(ctx)
        res["spec"] = report(f"spec k={args.spec} B={B} ctx={ctx}", g, log)
    if args.out:
        json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
