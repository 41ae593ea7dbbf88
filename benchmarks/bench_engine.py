"""The serving engine (``dsv4_ops.serve.Engine``) against the static ``Generator`` on the same model,
through the public calls (issue #44's GPU numbers):

* **decode step at batch 1**: ``engine.generate([prompt], n)`` and ``Generator.generate`` for two
  values of ``n``; the step is the time difference over the step-count difference (prefill and
  fixed costs cancel, as in bench_spec.py);
* **prefix hit vs cold TTFT**: a ``--system``-token shared system prompt + a question of each ``--question`` length, the
  time from ``add_request`` to the first token, once cold (``prefix_cache=False``) and once after
  another request published the prefix;
* **throughput at ``--concurrency`` requests of mixed lengths** (``--requests`` of them, prompts and
  ``max_new_tokens`` drawn uniformly): the engine with every request queued at once vs the
  ``Generator`` running the same requests in static batches of ``--concurrency`` (each batch waits
  for its longest member);
* **capacity**: the positions the paged pool holds in the memory today's per-row pool takes for
  ``--concurrency`` x ``--max-seq-len``, and the longest request beside ``--concurrency`` - 1 requests
  of an eighth of ``--max-seq-len`` (the per-row pool: ``--max-seq-len``);
* CUDA-graph replays, recompiles and graph breaks after warm-up (the engine's ``stats``).

    python3 benchmarks/bench_engine.py --config flash-slice --out out/bench_engine.json   # GPU (gpu_check.sh serve runs it)
    python3 benchmarks/bench_engine.py --smoke --out /tmp/engine.json                       # tiny config, eager, CPU
"""
from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `benchmarks` and `dsv4_ops`

from benchmarks.bench_model import bench_config  # noqa: E402
from benchmarks.random_weights import CONFIGS, bench_setup  # noqa: E402
from dsv4_ops import Generator  # noqa: E402
from dsv4_ops.serve import Engine  # noqa: E402
from dsv4_ops.serve.pool import PagedKVPool  # noqa: E402


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def decode_step_ms(run, steps_of, device, n_short: int, n_long: int) -> float:
    run(n_short)  # warm-up: compiles and records
    run(n_long)
    s0 = steps_of()
    t_short = _timed(lambda: run(n_short), device)
    s1 = steps_of()
    t_long = _timed(lambda: run(n_long), device)
    s2 = steps_of()
    return 1e3 * (t_long - t_short) / max(1, (s2 - s1) - (s1 - s0))


def ttft_s(eng: Engine, prompt: list[int], device) -> tuple[float, int]:
    _sync(device)
    t0 = time.perf_counter()
    rid = eng.add_request(prompt, max_new_tokens=2)
    first, cached = None, 0
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid and o.new_token_ids and first is None:
                _sync(device)
                first, cached = time.perf_counter() - t0, o.cached_tokens
    return first, cached


PARTS = ("decode", "prefix", "throughput", "capacity")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", choices=CONFIGS, default="flash-slice")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="tiny config, eager, small sizes (CPU)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bf16", "fp8"))
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=None,
                    help="throughput: requests (default 8 x concurrency: with 2 x, the last one admitted decides "
                         "the engine's time, as the longest one decides each static batch's)")
    ap.add_argument("--max-seq-len", type=int, default=8192)
    ap.add_argument("--system", type=int, default=4096, help="shared system-prompt tokens")
    ap.add_argument("--question", type=int, nargs="+", default=[32, 128],
                    help="new prompt tokens after the shared system prompt (several: one TTFT pair each)")
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="the engine's prefill chunk (default: the Engine's, whole pages up to 2048 tokens)")
    ap.add_argument("--admit-wait", type=int, nargs="+", default=[0],
                    help="throughput: the engine's admit_wait (iterations a freed slot waits for others to share a "
                         "prefill step; 0: admit at once, the default); several values: one engine run each, "
                         "against one static run")
    ap.add_argument("--admit-order", nargs="+", default=["arrival"], choices=("arrival", "longest_output"),
                    help="throughput: the engine's admit_order (several: one engine run each, times each admit-wait)")
    ap.add_argument("--parts", nargs="+", default=PARTS, choices=PARTS,
                    help="which measurements (default all; throughput compiles every batch bucket: minutes)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if min(args.question) < 1:
        ap.error(f"--question: each length must be >= 1 token, got {args.question}")
    device, cfg, model = bench_setup(args, "bench_engine.py", bench_config)
    if args.smoke:
        args.concurrency, args.max_seq_len, args.system, args.page_size, args.question = 4, 256, 64, 32, [8, 32]
        args.requests = args.requests or 8
    compile_ = not args.smoke
    rng = random.Random(0)
    common = dict(max_seq_len=args.max_seq_len, compile=compile_, kv_cache_dtype=args.kv_cache_dtype)
    eng_kw = dict(common, page_size=args.page_size, prefill_chunk=args.prefill_chunk)
    result = dict(script="benchmarks/bench_engine.py", date=datetime.datetime.now().isoformat(timespec="seconds"),
                  device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  torch=torch.__version__, config=args.config if not args.smoke else "tiny", args=vars(args))

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def save(part: str, value: dict) -> None:  # after every part (throughput: every run), so a cut run keeps them
        result[part] = value
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))

    if "decode" in args.parts:
        save("decode_b1", _decode_b1(model, cfg, rng, args, common, eng_kw, device))
    if "prefix" in args.parts:
        save("prefix", _prefix(model, cfg, rng, args, eng_kw, device))
    if "throughput" in args.parts:
        save("throughput", _throughput(model, cfg, rng, args, common, eng_kw, device,
                                       lambda part: save("throughput", part)))
    if "capacity" in args.parts:
        save("capacity", _capacity(model, args, eng_kw))
    return 0


def _decode_b1(model, cfg, rng, args, common, eng_kw, device) -> dict:
    """The decode step at batch 1 (a 4K-token prompt on the GPU), Generator vs Engine."""
    prompt = [rng.randrange(cfg.vocab_size) for _ in range(min(4096, args.max_seq_len // 2))]
    n_short, n_long = (4, 12) if args.smoke else (16, 144)
    gen = Generator(model, max_batch_size=1, prefill_chunk=min(args.page_size, 2048), **common)
    g_ms = decode_step_ms(lambda n: gen.generate([prompt], max_new_tokens=n), lambda: gen.stats["decode_steps"],
                          device, n_short, n_long)
    eng = Engine(model, max_running=1, prefix_cache=False, **eng_kw)
    e_ms = decode_step_ms(lambda n: eng.generate([prompt], max_new_tokens=n), lambda: eng.stats["decode_steps"],
                          device, n_short, n_long)
    print(f"decode b1 x {len(prompt)}: Generator {g_ms:.3f} ms  Engine {e_ms:.3f} ms  ({e_ms / g_ms:.2f}x)")
    return dict(context=len(prompt), generator_ms=g_ms, engine_ms=e_ms, ratio=e_ms / g_ms)


def _prefix(model, cfg, rng, args, eng_kw, device) -> dict:
    """A shared system prompt + a question of each ``--question`` length: TTFT cold vs with a prefix hit.
    The fields of the last length stand at the top level; ``runs`` holds each length's."""
    system = [rng.randrange(cfg.vocab_size) for _ in range(args.system)]
    eng = Engine(model, max_running=2, **eng_kw)
    cold_eng = Engine(model, max_running=2, prefix_cache=False, **eng_kw)
    runs = []
    for n in args.question:
        q = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for _ in range(3)]
        # two warm-ups each: a compiled step's first call compiles, its second records its CUDA graph (the first
        # length's first call also publishes the prefix)
        ttft_s(eng, system + q[0], device)
        ttft_s(eng, system + q[1], device)
        recordings = eng.stats["cuda_graph_recordings"]
        hit, cached = ttft_s(eng, system + q[2], device)
        recordings = eng.stats["cuda_graph_recordings"] - recordings
        for question in q:
            cold, _ = ttft_s(cold_eng, system + question, device)
        print(f"TTFT, {args.system}-token system prompt + {n}: cold {cold * 1e3:.1f} ms  hit {hit * 1e3:.1f} ms "
              f"({cached} cached, {hit / cold:.2f}x; CUDA-graph recordings in the hit: {recordings})")
        runs.append(dict(question_tokens=n, cold_ttft_s=cold, hit_ttft_s=hit, cached_tokens=cached, ratio=hit / cold,
                         hit_recordings=recordings))
    return dict(system_tokens=args.system, **runs[-1], runs=runs)


def _throughput(model, cfg, rng, args, common, eng_kw, device, save) -> dict:
    """N concurrent requests of mixed lengths, the engine vs static Generator batches of N. ``save(part)``
    writes what is measured so far: a run cut short (a GPU session's time ends) keeps every finished run."""
    N = args.concurrency
    hi = args.max_seq_len // 4
    reqs = [([rng.randrange(cfg.vocab_size) for _ in range(rng.randint(16, hi))], rng.randint(8, hi // 4))
            for _ in range(args.requests or 8 * N)]
    tokens = sum(n for _, n in reqs)
    out = dict(requests=len(reqs), concurrency=N, new_tokens=tokens, engine_runs=[])
    # the static baseline first: it compiles a few shapes, the engine every batch bucket (minutes)
    gen = Generator(model, max_batch_size=N, **common)  # its defaults: chunk buckets
    run_static = lambda: [gen.generate([p for p, _ in reqs[i:i + N]], [n for _, n in reqs[i:i + N]])  # noqa: E731
                          for i in range(0, len(reqs), N)]
    run_static()
    run_static()
    gen_compile_before = gen.stats["compile_time_s"]
    t_gen = _timed(run_static, device)
    # compile time inside a timed run: 0 when the warm-ups covered every shape (else not steady state)
    gen_timed_compile = gen.stats["compile_time_s"] - gen_compile_before
    print(f"static Generator, batches of {N}: {len(reqs)} requests in {t_gen:.2f} s ({tokens / t_gen:.0f} tok/s)",
          flush=True)
    out.update(generator_s=t_gen, generator_tok_s=tokens / t_gen)
    save(out)
    # one engine for every admission setting (they change no compiled step): random prompts share no prefix, and
    # without the cache the same requests run the same steps again, so a run before each timed one compiles and
    # records the shapes it takes (the first setting runs twice: with CUDA graphs a shape records on its second call)
    eng = Engine(model, max_running=N, **dict(eng_kw, prefix_cache=False))
    settings = [dict(admit_order=o, admit_wait=w) for o in args.admit_order for w in args.admit_wait]
    for i, admission in enumerate(settings):
        r = _engine_throughput(eng, reqs, admission, device, warm_runs=2 if i == 0 else 1)
        r["ratio"] = t_gen / r["engine_s"]
        r["timed_compile_s"]["generator"] = gen_timed_compile
        s = r.pop("stats")
        print(f"engine, {_named(r)}: {len(reqs)} requests at concurrency {N} in {r['engine_s']:.2f} s "
              f"({tokens / r['engine_s']:.0f} tok/s, {r['ratio']:.2f}x the static Generator), "
              + ", ".join(f"{k} {v}" for k, v in r["timed"].items())
              + f"; recompiles {s['recompiles']}, graph breaks {s['graph_breaks']}, compile in the timed run: engine "
              f"{r['timed_compile_s']['engine']:.1f} s, Generator {gen_timed_compile:.1f} s", flush=True)
        out["engine_runs"].append(r)
        if i == 0:  # the top-level fields: the first engine run's
            out.update(engine_s=r["engine_s"], engine_tok_s=tokens / r["engine_s"], ratio=r["ratio"],
                       timed_compile_s=r["timed_compile_s"], timed=r["timed"], stats=s)
        save(out)
    return out


def _named(run: dict) -> str:
    return f"admit_wait {run['admit_wait']}, admit_order {run['admit_order']}"


def _engine_throughput(eng: Engine, reqs, admission: dict, device, warm_runs: int) -> dict:
    """One timed run of every request queued at once, after ``warm_runs`` untimed ones, with ``admission``
    (admit_wait, admit_order)."""
    eng.admit_wait, eng.admit_order = admission["admit_wait"], admission["admit_order"]
    run_engine = lambda: eng.generate([p for p, _ in reqs], [n for _, n in reqs])  # noqa: E731
    for _ in range(warm_runs):
        run_engine()
    counted = ("finished", "cuda_graph_recordings", "cuda_graph_replays", "decode_steps", "prefill_steps", "slot_moves",
               "admissions_deferred")
    before = {k: eng.stats[k] for k in ("compile_time_s", *counted)}
    t_eng = _timed(run_engine, device)
    s = eng.stats
    return dict(admission, engine_s=t_eng, timed={k: s[k] - before[k] for k in counted},
                timed_compile_s=dict(engine=s["compile_time_s"] - before["compile_time_s"]), stats=dict(s))


def _capacity(model, args, eng_kw) -> dict:
    """The per-row pool's bytes for N x max_seq_len, spent on pages instead."""
    N = args.concurrency
    per_row = model.setup_caches(N, args.max_seq_len, kv_cache_dtype=args.kv_cache_dtype) and model.cache_nbytes()
    model.clear_caches()
    page = PagedKVPool.page_bytes(model, args.page_size, args.kv_cache_dtype)
    rings = Engine(model, max_running=N, num_pages=2, **dict(eng_kw, compile=False)).pool.nbytes()["rings"]
    ring = rings * N // (N + 1)  # without the dummy slot
    pages = (per_row - ring) // page
    # a mixed load: N - 1 requests of an eighth of max_seq_len leave the rest of the pages to one long request
    short = max(1, args.max_seq_len // 8)
    longest = (pages - (N - 1) * -(-short // args.page_size)) * args.page_size
    print(f"capacity: the per-row pool of {N} x {args.max_seq_len} ({per_row / 2**30:.2f} GiB) holds "
          f"{pages * args.page_size} paged positions: {pages * args.page_size // N} per request on average, "
          f"any mix of lengths; beside {N - 1} requests of {short} tokens, one of {longest} (per-row pool: "
          f"{args.max_seq_len})")
    return dict(per_row_pool_bytes=per_row, page_bytes=page, ring_bytes=ring, pages=int(pages),
                tokens_total=int(pages * args.page_size), mean_tokens_per_request=int(pages * args.page_size // N),
                mixed=dict(short_requests=N - 1, short_tokens=short, longest_tokens=int(longest),
                           per_row_longest_tokens=args.max_seq_len))


if __name__ == "__main__":
    raise SystemExit(main())
