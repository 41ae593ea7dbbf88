"""dsv4_ops' OpenAI-compatible server on a random-weight model (the bench config or the Flash slice),
for ``bench_serve.py`` on a GPU that has no checkpoint (what vLLM's ``--load-format dummy`` is for).

Prompts are token ids (``bench_serve.py`` sends ids); the stand-in tokenizer spells id ``i`` as
``t<i>`` and has no EOS, so every request runs to its ``max_tokens``. Before it serves, the engine
runs ``--max-running`` requests of mixed lengths (every decode bucket compiles and records), and its
decode step at batch 1 is timed the way ``bench_engine.py`` times it: that step is what the server's
TPOT at concurrency 1 is judged against. It prints ``engine decode step b1 x CTX: X ms`` and writes
it to ``--step-out``.

    python3 benchmarks/serve_random.py --config flash-slice --port 8000 --step-out step.json &
    python3 benchmarks/bench_serve.py --url http://127.0.0.1:8000 --model flash-slice --concurrency 1 8 64 --out r.json
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `benchmarks` and `dsv4_ops`

from benchmarks.bench_engine import decode_step_ms  # noqa: E402
from benchmarks.bench_model import bench_config  # noqa: E402
from benchmarks.random_weights import CONFIGS, bench_setup  # noqa: E402
from dsv4_ops.serve import Engine  # noqa: E402
from dsv4_ops.serve.engine_thread import EngineThread  # noqa: E402
from dsv4_ops.serve.server import create_app, serve_forever  # noqa: E402
from dsv4_ops.text import Tokenizer  # noqa: E402


def id_tokenizer(vocab_size: int) -> Tokenizer:
    """A word-level tokenizer over ``t0 .. t<vocab-1>`` with no special tokens."""
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    backend = Backend(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = WhitespaceSplit()
    return Tokenizer(backend, bos_token=None, eos_token=None, pad_token=None, source="the id tokenizer")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", choices=CONFIGS, default="flash-slice")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="tiny config, eager (CPU)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--max-seq-len", type=int, default=8192)
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--prefill-chunk", type=int, default=None, help="the engine's (default: whole pages up to 2048 tokens)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bf16", "fp8"))
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--step-context", type=int, default=1024, help="prompt tokens of the timed batch-1 decode step")
    ap.add_argument("--step-out", default=None, help="write the timed decode step here (JSON)")
    return ap.parse_args(argv)


def build(args: argparse.Namespace):
    """``(app, worker, name)``: the model drawn, the engine started on its thread (which warms it up
    and times its step before ``worker.ready``), the app."""
    device, cfg, model = bench_setup(args, "serve_random.py", bench_config)
    if args.smoke:
        args.max_seq_len, args.page_size, args.step_context = min(args.max_seq_len, 256), 64, 32
    eng = Engine(model, max_running=args.max_running, max_seq_len=args.max_seq_len, page_size=args.page_size,
                 prefix_cache=not args.no_prefix_cache, compile=not args.smoke, kv_cache_dtype=args.kv_cache_dtype,
                 prefill_chunk=args.prefill_chunk)
    rng = random.Random(0)
    name = "tiny" if args.smoke else args.config
    prompt = [rng.randrange(cfg.vocab_size) for _ in range(args.step_context)]
    n_short, n_long = (4, 12) if args.smoke else (16, 144)

    def warmup(eng: Engine) -> None:  # on the engine's thread, which owns its compiled steps and CUDA graphs
        # every step shape the benchmark's greedy requests take compiles and records (no top-k / top-p shapes)
        print(f"warm-up: {eng.warm_up(filtered=False)}", flush=True)
        ms = decode_step_ms(lambda n: eng.generate([prompt], max_new_tokens=n), lambda: eng.stats["decode_steps"],
                            device, n_short, n_long)
        print(f"engine decode step b1 x {len(prompt)}: {ms:.3f} ms", flush=True)
        if args.step_out:
            Path(args.step_out).write_text(json.dumps(dict(config=name, context=len(prompt), engine_step_ms=ms,
                                                           prefix_cache=not args.no_prefix_cache, stats=eng.stats)))

    worker = EngineThread(eng).start(warmup)
    return create_app(worker, id_tokenizer(cfg.vocab_size), name, []), worker, name


def main(argv=None) -> int:
    args = parse_args(argv)
    app, worker, _ = build(args)
    try:
        serve_forever(app, "127.0.0.1", args.port)
    finally:
        worker.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
