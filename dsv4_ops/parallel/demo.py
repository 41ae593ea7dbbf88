"""Greedy generation on a tensor/expert-parallel DeepSeek-V4, one process per rank.

    torchrun --nproc-per-node 2 -m dsv4_ops.parallel.demo                   # tiny config: gloo on CPU, NCCL on GPUs
    torchrun --nproc-per-node 2 -m dsv4_ops.parallel.demo --device cpu --no-compile --spec-steps 2
    torchrun --nproc-per-node 2 -m dsv4_ops.parallel.demo --checkpoint PATH # a checkpoint: each rank loads its shard

Every rank runs the same ``Generator`` calls on the same prompts (its shard of the model, the
collectives inside the step); rank 0 prints. With the tiny config (random weights, the same on
every rank) each rank also runs the unsharded model and checks that the tokens agree.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
import torch.distributed as dist

from ..config import DSV4Config
from ..generator import Generator
from ..model.model import DeepseekV4ForCausalLM
from .load import load_pretrained
from .process_group import init_distributed
from .shard import shard_model

PROMPTS = [[1, 2, 3], list(range(5, 45))]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m dsv4_ops.parallel.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cpu (gloo) or cuda (NCCL); default: cuda when available")
    p.add_argument("--checkpoint", default=None, help="a checkpoint directory (default: the tiny config, random)")
    p.add_argument("--dtype", default=None, help="weights dtype for --checkpoint, e.g. bfloat16")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--spec-steps", type=int, default=0, help="MTP draft tokens per step (0: plain decoding)")
    p.add_argument("--no-compile", action="store_true", help="eager (no torch.compile): starts in seconds")
    p.add_argument("--timeout-s", type=float, default=600.0, help="process-group timeout (a lost rank -> error)")
    return p.parse_args(argv)


def build(args, device: torch.device):
    """(this rank's shard, the unsharded model or None)."""
    if args.checkpoint:
        dtype = getattr(torch, args.dtype) if args.dtype else None
        return load_pretrained(args.checkpoint, dtype=dtype, device=device), None
    torch.manual_seed(0)  # the same random weights on every rank
    full = DeepseekV4ForCausalLM(DSV4Config.tiny(num_hidden_layers=3), device=device).eval()
    return shard_model(copy.deepcopy(full)), full


def main(argv=None) -> int:
    args = parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        print("dsv4_ops.parallel.demo runs one process per rank: torchrun --nproc-per-node 2 -m "
              "dsv4_ops.parallel.demo", file=sys.stderr)
        return 2
    device = init_distributed(args.device, timeout_s=args.timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    model, full = build(args, device)
    cfg = model.config
    say(f"dsv4_ops.parallel demo: {world} ranks ({dist.get_backend()}), {cfg.num_hidden_layers} layers, "
        f"{cfg.num_attention_heads // world} heads and {cfg.n_routed_experts // world} experts per rank, "
        f"device {device}, compile={not args.no_compile}, spec_steps={args.spec_steps}")
    kw = dict(max_batch_size=len(PROMPTS), max_seq_len=128, prefill_chunk=16, spec_steps=args.spec_steps)
    gen = Generator(model, compile=not args.no_compile, **kw)
    t0 = time.perf_counter()
    out = gen.generate(PROMPTS, max_new_tokens=args.max_new_tokens)
    wall = time.perf_counter() - t0
    s = gen.stats
    say(f"  {len(PROMPTS)} prompts x {args.max_new_tokens} new tokens in {wall:.1f} s (first call compiles; "
        f"compile {s['compile_time_s']:.1f} s), graph breaks {s['graph_breaks']}, recompiles {s['recompiles']}")
    say(f"  first prompt's tokens: {out[0][:16]}")
    ok = s["graph_breaks"] == 0 and s["recompiles"] == 0
    if full is not None:
        want = Generator(full, compile=False, **kw).generate(PROMPTS, max_new_tokens=args.max_new_tokens)
        same = torch.tensor(int(out == want), device=device)
        dist.all_reduce(same, op=dist.ReduceOp.MIN)  # every rank's tokens must equal the unsharded model's
        ok = ok and bool(same)
        say(f"  tokens == single-process model on every rank: {bool(same)}")
    say("  OK" if ok else "  MISMATCH")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
