"""The longest context that fits on the GPU for each KV-cache dtype, found by allocating it.

For each ``--kv-cache-dtype`` (default ``bf16 fp8``) and batch size: bisect the largest
``max_seq_len`` (a multiple of ``--step``) for which ``Generator(model, max_batch_size=B,
max_seq_len=L, kv_cache_dtype=...)`` allocates its pool AND runs (a prefill of ``--fill`` tokens
per row -- default a 4K-token prompt; ``--fill full`` prefills the whole context, slow -- then a
few decode steps), catching ``torch.cuda.OutOfMemoryError``. Reports the context, the pool's
bytes and the fp8 / bf16 ratio (issue 15's target: >= 1.7x).

    python3 benchmarks/kv_capacity.py --out out/kv_capacity.json                # bench config, B=1
    python3 benchmarks/kv_capacity.py --batches 64 --config flash-slice --fill 64 --step 131072 --out out/kv.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_model import bench_config  # noqa: E402
from benchmarks.random_weights import CONFIGS, bench_setup  # noqa: E402
from dsv4_ops import Generator  # noqa: E402


def fits(model, batch: int, ctx: int, kv: str, fill: int | None, chunk: int,
         decode_steps: int = 4) -> tuple[bool, int, int]:
    """Allocate and run a ``ctx``-token pool; ``(ok, pool bytes, peak bytes allocated)``."""
    gen = None
    torch.cuda.reset_peak_memory_stats()
    try:
        # a short prefill chunk: the indexer's scores [B, chunk, ctx / m] grow with the pool, and
        # they (not the cache) would set the limit at a long chunk
        gen = Generator(model, max_batch_size=batch, max_seq_len=ctx, compile=False, prefill_chunk=chunk,
                        kv_cache_dtype=kv)
        n = ctx - decode_steps if fill is None else min(fill, ctx - decode_steps)
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, model.config.vocab_size, (batch, max(n, 1)), generator=g).tolist()
        logits = gen.prefill(prompts)
        for _ in range(decode_steps):
            logits = gen.decode(logits.argmax(-1))
        torch.cuda.synchronize()
        return True, model.cache_nbytes(), torch.cuda.max_memory_allocated()
    except torch.cuda.OutOfMemoryError:
        return False, 0, 0
    finally:
        del gen
        model.clear_caches()
        torch.cuda.empty_cache()


def longest(model, batch: int, kv: str, step: int, fill: int | None, chunk: int, log) -> dict:
    lo, hi = 0, step
    while True:  # grow until it no longer fits
        ok, *_ = fits(model, batch, hi, kv, fill, chunk)
        log(f"  {kv} B={batch} ctx={hi}: {'fits' if ok else 'OOM'}")
        if not ok:
            break
        lo, hi = hi, hi * 2
    while hi - lo > step:  # bisect on multiples of step
        mid = (lo + hi) // 2 // step * step
        ok, *_ = fits(model, batch, mid, kv, fill, chunk)
        log(f"  {kv} B={batch} ctx={mid}: {'fits' if ok else 'OOM'}")
        lo, hi = (mid, hi) if ok else (lo, mid)
    _, nbytes, peak = fits(model, batch, lo, kv, fill, chunk) if lo else (False, 0, 0)
    log(f"  {kv} B={batch}: longest {lo} tokens, pool {nbytes / 2**30:.1f} GiB, peak allocated {peak / 2**30:.1f} GiB")
    return dict(kv_cache_dtype=kv, batch=batch, max_context=lo, pool_bytes=nbytes, peak_allocated_bytes=peak,
                weight_bytes=sum(p.nbytes for p in model.parameters()))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["bf16", "fp8"], choices=["auto", "bf16", "fp8"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1])
    ap.add_argument("--step", type=int, default=65536, help="context granularity of the search")
    ap.add_argument("--fill", default="4096", help="prompt tokens per row, or 'full' (the whole context)")
    ap.add_argument("--prefill-chunk", type=int, default=64, help="prefill chunk (tokens per row per step)")
    ap.add_argument("--config", choices=CONFIGS, default="bench")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kv_capacity: needs a CUDA GPU (it finds what fits in GPU memory)")
    _, cfg, model = bench_setup(args, "kv_capacity", bench_config)
    fill = None if args.fill == "full" else int(args.fill)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    rows = [longest(model, B, kv, args.step, fill, args.prefill_chunk, log) for B in args.batches for kv in args.kv_cache_dtype]
    for B in args.batches:
        by = {r["kv_cache_dtype"]: r for r in rows if r["batch"] == B}
        if "bf16" in by and "fp8" in by and by["bf16"]["max_context"]:
            log(f"B={B}: bf16 {by['bf16']['max_context']} tokens, fp8 {by['fp8']['max_context']} tokens "
                f"({by['fp8']['max_context'] / by['bf16']['max_context']:.2f}x)")
    out = dict(config=args.config, device=torch.cuda.get_device_name(), rows=rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
