"""Speculative-step benchmark: time of one CUDA-graphed MTP speculative step (verify k+1 tokens,
accept, MTP extend, k-1 drafts) vs one plain CUDA-graphed decode step, for k = 1..4 at batch 1
and 16, on the bench config (benchmarks/bench_model.py) at a synthetic 4K context.

The step is a static graph: its cost does not depend on how many drafts are accepted. So
tokens/s under full acceptance = B (k+1) / t_step, and under random acceptance = B x measured
tokens-per-step / t_step, where tokens-per-step is counted from the replays' own ``count``
outputs (random MTP weights against a random main model: drafts almost never match).

Bytes floor of a step (weights + KV read once at 4.3 TB/s): a plain step reads the main model
once; a speculative step reads it once for the verify pass and the MTP block (+ the shared LM
head) k times, since the k draft forwards depend on each other. Their ratio bounds how close
to the plain step a speculative step can get on this config.

    python benchmarks/bench_spec.py --out spec.json
"""
from __future__ import annotations

import argparse
import json

import torch

from bench_model import HBM_BYTES_PER_S, bench_config, cuda_time_ms, decode_floor_bytes, param_bytes, synthetic_context
from dsv4_ops import Generator
from dsv4_ops.demo import random_model


def graphed(fn, *args):
    """Capture ``fn(*args)`` (after two warm-up calls on a side stream) as a CUDA graph ->
    ``(graph, outputs)``; the outputs are static buffers that each replay rewrites."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(2):
            fn(*args)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.no_grad():
        out = fn(*args)
    return g, out


def reset_spec(gen, B: int, ctx: int, ids, k: int) -> None:
    """Every row at length ``ctx`` with next token ``ids`` and placeholder drafts (rejected)."""
    gen.lengths.fill_(ctx)
    gen.spec.last_tok[:B].copy_(ids)
    gen.spec.drafts[:B].copy_(ids[:, None].expand(B, k))


def spec_floor_bytes(model, cfg, B: int, ctx: int, k: int) -> int:
    """Main model once (verify) + the MTP block and the shared LM head k times + its window."""
    mtp, head = param_bytes(model.mtp.parameters()), param_bytes([model.lm_head.weight])
    window = B * cfg.sliding_window * cfg.head_dim * model.dtype.itemsize
    return decode_floor_bytes(model, cfg, B, ctx) + k * (mtp + head + window)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=2,
                    help="main-model layers (2 = the bench config); deeper models shrink the MTP block's share")
    args = ap.parse_args()
    cfg = bench_config(args.layers)
    model = random_model(cfg, dtype=torch.bfloat16, device="cuda")
    ctx, res = args.context, {"device": torch.cuda.get_device_name(), "context": args.context, "layers": args.layers,
                              "rows": []}
    for B in args.batches:
        plain = Generator(model, max_batch_size=B, max_seq_len=ctx + 256, compile=False)
        synthetic_context(plain, B, ctx)
        ids = torch.randint(0, cfg.vocab_size, (B,), device="cuda")
        ones = torch.ones(B, dtype=torch.int32, device="cuda")
        step = torch.compile(plain._decode_step, fullgraph=True, dynamic=False)
        plain.lengths.fill_(ctx)
        g, _ = graphed(step, ids, ones)
        plain.lengths.fill_(ctx)
        t_plain = cuda_time_ms(g.replay, iters=50)
        plain_floor = decode_floor_bytes(model, cfg, B, ctx) / HBM_BYTES_PER_S * 1e3
        print(f"B={B}: plain decode step {t_plain:.3f} ms (bytes floor {plain_floor:.3f} ms)", flush=True)
        del g, plain
        for k in args.ks:
            gen = Generator(model, max_batch_size=B, max_seq_len=ctx + 512, compile=False, spec_steps=k)
            synthetic_context(gen, B, ctx)
            step = torch.compile(gen.spec.step, fullgraph=True, dynamic=False)
            reset_spec(gen, B, ctx, ids, k)
            g, (_, counts) = graphed(step, ones)  # counts: [B] tokens each row emitted in the latest replay
            reset_spec(gen, B, ctx, ids, k)  # replays advance lengths by count: 512 slots of headroom
            t = cuda_time_ms(g.replay, iters=50)
            reset_spec(gen, B, ctx, ids, k)
            emitted = torch.zeros((), dtype=torch.long, device="cuda")
            for _ in range(50):
                g.replay()
                emitted += counts.sum()
            per_step = emitted.item() / (50 * B)
            floor = spec_floor_bytes(model, cfg, B, ctx, k) / HBM_BYTES_PER_S * 1e3
            row = {"batch": B, "k": k, "plain_ms": t_plain, "spec_ms": t, "ratio": t / t_plain,
                   "plain_floor_ms": plain_floor, "spec_floor_ms": floor, "floor_ratio": floor / plain_floor,
                   "spec_floor_fraction": floor / t, "tokens_per_step_random": per_step,
                   "tok_s_full_acceptance": B * (k + 1) / t * 1e3, "tok_s_random_acceptance": B * per_step / t * 1e3,
                   "tok_s_plain": B / t_plain * 1e3}
            res["rows"].append(row)
            print(f"B={B} k={k}: spec step {t:.3f} ms = {t / t_plain:.2f}x plain (bytes floors: {floor:.3f} ms = "
                  f"{floor / plain_floor:.2f}x plain's, {floor / t:.0%} reached); tok/s: "
                  f"{row['tok_s_full_acceptance']:.0f} full acceptance, {row['tok_s_random_acceptance']:.0f} random "
                  f"({per_step:.2f} tokens/step), {row['tok_s_plain']:.0f} plain", flush=True)
            json.dump(res, open(args.out, "w"), indent=1)
            del g, gen


if __name__ == "__main__":
    main()
