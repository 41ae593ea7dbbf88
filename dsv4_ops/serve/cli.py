"""``python -m dsv4_ops serve``: the OpenAI-compatible server on a checkpoint (or the bundled tiny model).

    python -m dsv4_ops serve --config tiny --port 8000
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "tiny", "prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0}'
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_arguments", "build", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", metavar="DIR", help="checkpoint directory (config.json, safetensors, tokenizer.json)")
    which.add_argument("--config", choices=["tiny"], help="'tiny': the bundled trained tiny model")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the directory's "
                                                             "name, or 'tiny')")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every request")
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--max-seq-len", type=int, default=None, help="default: min(4096, the model's context)")
    p.add_argument("--max-waiting", type=int, default=256, help="requests that may wait for a slot; past it, 503")
    p.add_argument("--page-size", type=int, default=None, help="default 256 (64 on the tiny config)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens a request computes per step: a divisor of the page size or a multiple of it "
                        "(prefix hits on chunk ends and prompts' last page boundaries); default: the whole pages "
                        "that fit in 2048 tokens (speculative: one page, at most 256)")
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--kv-memory-gb", type=float, default=None)
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--admit-wait", type=int, default=0,
                   help="iterations a freed slot may wait for others, so that new prompts share a prefill step")
    p.add_argument("--admit-order", default="arrival", choices=["arrival", "longest_output"],
                   help="which waiting request takes a free slot first (longest_output: the most tokens to generate)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp8"])
    p.add_argument("--spec-steps", type=int, default=0, help="MTP draft tokens per decode step (0: plain decode)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the steps (default: on for cuda, off for cpu)")


def build(args):
    """``(app, worker, name)``: the model loaded, the engine started on its thread, the app."""
    import torch

    from ..hf import load_pretrained
    from ..text import load_tokenizer
    from ..text.generate_cli import UsageError, checkpoint_dir, eos_ids, model_limit
    from .engine import Engine
    from .engine_thread import EngineThread
    from .server import create_app

    path = checkpoint_dir(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: this torch sees no CUDA device")
    tokenizer = load_tokenizer(path)
    model = load_pretrained(path, device=device)
    limit = model_limit(path, tokenizer)
    max_seq_len = args.max_seq_len or min(4096, limit)
    if max_seq_len > limit:
        raise UsageError(f"--max-seq-len {max_seq_len} > the model's context {limit}")
    page_size = args.page_size or (256 if model.config.hca_ratio >= 128 else 64)
    compile = (device == "cuda") if args.compile is None else args.compile
    try:
        engine = Engine(model, max_running=args.max_running, max_seq_len=max_seq_len, num_pages=args.num_pages,
                        kv_memory_gb=args.kv_memory_gb, page_size=page_size, prefix_cache=not args.no_prefix_cache,
                        spec_steps=args.spec_steps, compile=compile, kv_cache_dtype=args.kv_cache_dtype,
                        prefill_chunk=args.prefill_chunk, admit_wait=args.admit_wait,
                        admit_order=args.admit_order)
    except ValueError as e:
        raise UsageError(str(e)) from None
    eos = eos_ids(path, tokenizer)

    def warmup(eng) -> None:  # every step shape: no request waits for a compile once /health says ok
        print(f"warm-up: {eng.warm_up()}", file=sys.stderr, flush=True)

    # an eager engine has no graphs to compile or record: it serves at once
    worker = EngineThread(engine, max_waiting=args.max_waiting).start(warmup if compile else None)
    name = args.served_model_name or ("tiny" if args.config else Path(path).name)
    return create_app(worker, tokenizer, name, eos, args.api_key), worker, name


def run(args) -> int:
    from ..text.generate_cli import UsageError
    from .server import serve_forever

    try:
        app, worker, name = build(args)
    except UsageError as e:
        print(f"python -m dsv4_ops serve: error: {e}", file=sys.stderr)
        return 2
    print(f"serving {name!r} on http://{args.host}:{args.port}/v1 (health: /health, metrics: /metrics)",
          file=sys.stderr)
    try:
        serve_forever(app, args.host, args.port)
    finally:
        worker.stop()
    return 0
