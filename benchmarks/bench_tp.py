"""Tensor/expert-parallel decode vs one GPU (issue #16), through the public path.

Every rank draws the same random model (``random_init_model``, one seed; the "Flash slice":
V4-Flash widths, 4 layers, all 256 experts, bf16, 68 GB with its MTP block) on its own GPU and
first runs it WHOLE, alone (no collectives): that is the single-GPU baseline, measured on every
rank at once (rank 0's numbers are reported). Then each rank shards the same model in place
(``dsv4_ops.parallel.shard_model``: half the heads / output groups, 128 experts per rank on 2
GPUs) and runs the same calls again, the collectives inside each step. Per batch size:

* greedy tokens: ``Generator.generate`` of random ``--context``-token prompts, ``--new-tokens``
  each; the sharded run must reproduce the single-GPU tokens (``tokens_equal``; else the first
  position where they part, ``first_difference``: bf16 all-reduces round partial sums in another
  order, so a near-tie can flip);
* decode step: ``Generator.decode`` back to back (CUDA events around each call, median of
  ``--iters`` after ``--warmup``, benchmarks/timing.py), compiled + CUDA graphs (the default);
  ``speedup`` = single-GPU ms / sharded ms;
* compile health of the sharded Generator: graph breaks, recompiles, CUDA-graph replays.

NCCL runs with NVLink multicast off (``NCCL_NVLS_ENABLE=0``, set by ``init_distributed``).

    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --out out/bench_tp.json
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --smoke --out /tmp/bench_tp.json   # tiny, fp32, gloo, CPU
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `benchmarks` and `dsv4_ops`

from benchmarks.random_weights import bench_model, flash_slice_config, random_init_model  # noqa: E402
from benchmarks.timing import first_call_s, time_call  # noqa: E402
from dsv4_ops import DSV4Config, Generator  # noqa: E402
from dsv4_ops.parallel import init_distributed, shard_model  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context", type=int, default=1024, help="prompt tokens per row before decode")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens compared per row")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--prefill-chunk", type=int, default=None, help="default: 512 at batch 1, 64 above")
    p.add_argument("--smoke", action="store_true", help="tiny config, fp32, on CPU with gloo (checks the script)")
    p.add_argument("--no-compile", action="store_true", help="eager Generators (smoke runs)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="process-group timeout")
    p.add_argument("--out", default=None, help="JSON results (written by rank 0)")
    return p.parse_args(argv)


def release(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(model, cfg: DSV4Config, batch: int, args, device: torch.device) -> dict:
    """Greedy tokens and the decode step time of one Generator at batch ``batch``."""
    chunk = args.prefill_chunk or (512 if batch == 1 else 64)
    max_seq_len = args.context + args.new_tokens + args.warmup + args.iters + 8
    gen = Generator(model, max_batch_size=batch, max_seq_len=max_seq_len, prefill_chunk=chunk,
                    compile=not args.no_compile)
    rng = torch.Generator().manual_seed(1000 + batch)  # the same prompts on every rank and in both runs
    prompts = torch.randint(0, cfg.vocab_size, (batch, args.context), generator=rng).tolist()
    first_s = first_call_s(lambda: gen.generate(prompts, max_new_tokens=2), device)  # compiles
    tokens = gen.generate(prompts, max_new_tokens=args.new_tokens)
    gen.prefill(prompts)
    ids = torch.tensor([row[0] for row in tokens], device=device)
    t = time_call(lambda: gen.decode(ids), device, warmup=args.warmup, iters=args.iters)
    s = gen.stats
    out = dict(batch=batch, context=args.context, decode_ms=t.ms, wall_ms=t.wall_ms, samples=t.samples,
               method=t.method, first_call_s=first_s, graph_breaks=s["graph_breaks"], recompiles=s["recompiles"],
               cuda_graph_replays=s["cuda_graph_replays"], tokens=tokens)
    gen = None  # drop the compiled steps and the KV pool before the next Generator
    release(device)
    return out


def first_difference(a: list[list[int]], b: list[list[int]]) -> int | None:
    """The first new-token index where any row of ``a`` and ``b`` differ (None: equal)."""
    diffs = [next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), None) for ra, rb in zip(a, b)]
    found = [d for d in diffs if d is not None]
    return min(found) if found else None


def main(argv=None) -> int:
    args = parse_args(argv)
    device = init_distributed("cpu" if args.smoke else None, timeout_s=args.timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    if args.smoke:
        cfg = DSV4Config.tiny()
        model = bench_model(cfg, dtype=torch.float32, device=device)
        args.context, args.iters, args.warmup = min(args.context, 40), min(args.iters, 5), 1
    else:
        if device.type != "cuda":
            raise SystemExit("bench_tp.py: no CUDA device; on CPU run --smoke")
        cfg = flash_slice_config()
        model = random_init_model(cfg, dtype=torch.bfloat16, device=device, seed=0)
    log(f"bench_tp: {world} ranks ({dist.get_backend()}, NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}), "
        f"{cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts ({cfg.n_routed_experts // world} per "
        f"rank), context {args.context}, batches {args.batches}")

    single = {}
    for b in args.batches:  # every rank alone, the whole model: the single-GPU baseline
        single[b] = run(model, cfg, b, args, device)
        log(f"  1 rank   B={b}: decode {single[b]['decode_ms']:.3f} ms (first call {single[b]['first_call_s']:.0f} s)")
    shard_model(model)
    release(device)
    rows = []
    for b in args.batches:
        tp = run(model, cfg, b, args, device)
        ref = single[b]
        everyone = [None] * world
        dist.all_gather_object(everyone, tp["tokens"])  # every rank must emit the same tokens
        diff = first_difference(tp["tokens"], ref["tokens"])
        row = dict(batch=b, context=args.context, single_ms=ref["decode_ms"], tp_ms=tp["decode_ms"],
                   speedup=ref["decode_ms"] / tp["decode_ms"], tokens_equal=diff is None, first_difference=diff,
                   ranks_agree=all(t == everyone[0] for t in everyone), new_tokens=args.new_tokens,
                   **{f"tp_{k}": tp[k] for k in ("wall_ms", "samples", "method", "first_call_s", "graph_breaks",
                                                   "recompiles", "cuda_graph_replays")},
                   single_wall_ms=ref["wall_ms"])
        rows.append(row)
        log(f"  {world} ranks B={b}: decode {row['tp_ms']:.3f} ms = {row['speedup']:.2f}x, tokens equal "
            f"{row['tokens_equal']} (ranks agree {row['ranks_agree']}), graph breaks {row['tp_graph_breaks']}, "
            f"recompiles {row['tp_recompiles']}, CUDA-graph replays {row['tp_cuda_graph_replays']}")
    if rank == 0 and args.out:
        meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), torch=torch.__version__,
                    world=world, backend=dist.get_backend(), config="tiny" if args.smoke else "flash-slice",
                    device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"), args=vars(args))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        log(f"wrote {args.out}")
    ok = all(r["tokens_equal"] and r["ranks_agree"] and r["tp_recompiles"] == 0 for r in rows)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
