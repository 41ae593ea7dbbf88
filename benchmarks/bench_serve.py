"""A serving benchmark against any OpenAI-compatible ``/v1/completions`` endpoint (ours:
``python -m dsv4_ops serve``), with the metrics of ``vllm bench serve`` and SGLang's ``bench_serving``:

* TTFT: request sent -> first streamed token; TPOT: (end-to-end - TTFT) / (output tokens - 1);
  ITL: the gaps between streamed chunks; E2E: request sent -> last chunk; p50 / p99 of each;
* request throughput (requests / s) and output-token throughput (tokens / s) over the run.

Load: ``--concurrency C`` (at most C requests in flight) and/or ``--rate R`` (Poisson arrivals, R
requests / s; ``inf`` = all at once). Workloads: ``random`` (prompt and output lengths uniform in
``--input-len`` / ``--output-len`` ranges, token-id prompts) and ``shared-prefix`` (a
``--prefix-len``-token system prompt shared by every request + a random suffix). Output lengths are
exact: ``ignore_eos`` is not an OpenAI field, so prompts are token ids and the count of streamed
tokens comes from ``usage``.

    python -m dsv4_ops serve --model DIR --port 8000 &
    python3 benchmarks/bench_serve.py --url http://127.0.0.1:8000 --model NAME --concurrency 1 8 64 --out r.json
    python3 benchmarks/bench_serve.py --url ... --workload shared-prefix --prefix-len 4096 --concurrency 8 --out s.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import httpx2 as httpx  # the async HTTP client the openai package is built on


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def workload(args, rng: random.Random) -> list[tuple[list[int], int]]:
    lo, hi = args.input_len
    prefix = [rng.randrange(args.vocab) for _ in range(args.prefix_len)] if args.workload == "shared-prefix" else []
    return [(prefix + [rng.randrange(args.vocab) for _ in range(rng.randint(lo, hi))],
             rng.randint(*args.output_len)) for _ in range(args.num_requests)]


async def one(client: httpx.AsyncClient, args, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": args.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps, usage = [], None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}", "body": (await r.aread()).decode()[:200]}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:  # the server's error event ends a stream that had started
                    return {"error": "an error event", "body": json.dumps(chunk["error"])[:200]}
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    stamps.append(time.perf_counter())
    except httpx.HTTPError as e:  # a connection the server dropped is a failed request, not a failed run
        return {"error": type(e).__name__, "body": str(e)[:200]}
    end = time.perf_counter()
    out = usage["completion_tokens"] if usage else len(stamps)
    ttft = (stamps[0] if stamps else end) - t0
    return {"ttft": ttft, "e2e": end - t0, "tpot": (end - t0 - ttft) / (out - 1) if out > 1 else None,
            "itl": [b - a for a, b in zip(stamps, stamps[1:])], "output_tokens": out,
            "cached_tokens": (usage or {}).get("prompt_tokens_details", {}).get("cached_tokens", 0)}


async def run_load(args, reqs, concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(1)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout) as client:
        async def guarded(p, n):
            async with sem:
                return await one(client, args, p, n)

        t0, tasks = time.perf_counter(), []
        for p, n in reqs:
            tasks.append(asyncio.create_task(guarded(p, n)))
            if args.rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    if len(ok) < len(results):
        bad = next(r for r in results if "error" in r)
        print(f"concurrency {concurrency}: {len(results) - len(ok)} requests failed, the first with {bad['error']}: "
              f"{bad['body']}")
    row = {"concurrency": concurrency, "rate": args.rate, "requests": len(reqs), "failed": len(results) - len(ok),
           "duration_s": wall, "request_throughput": len(ok) / wall,
           "output_throughput": sum(r["output_tokens"] for r in ok) / wall,
           "mean_cached_tokens": statistics.fmean(r["cached_tokens"] for r in ok) if ok else 0.0}
    for name, xs in (("ttft", [r["ttft"] for r in ok]), ("tpot", [r["tpot"] for r in ok if r["tpot"] is not None]),
                     ("itl", [x for r in ok for x in r["itl"]]), ("e2e", [r["e2e"] for r in ok])):
        for q in (50, 99):
            row[f"{name}_p{q}_ms"] = 1e3 * percentile(xs, q)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", required=True)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--workload", choices=("random", "shared-prefix"), default="random")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--input-len", type=int, nargs=2, default=(64, 1024), metavar=("LO", "HI"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 256), metavar=("LO", "HI"))
    ap.add_argument("--prefix-len", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=1000, help="prompt token ids are drawn below this")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--rate", type=float, default=float("inf"), help="Poisson arrivals per second (inf: at once)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    rows = []
    for i, c in enumerate(args.concurrency):
        # each level its own prompts: a server with a prefix cache would otherwise serve a level from the last one's
        row = asyncio.run(run_load(args, workload(args, random.Random(i)), c))
        rows.append(row)
        print(f"concurrency {c}: {row['request_throughput']:.2f} req/s, {row['output_throughput']:.0f} tok/s, TTFT p50 "
              f"{row['ttft_p50_ms']:.1f} ms p99 {row['ttft_p99_ms']:.1f} ms, TPOT p50 {row['tpot_p50_ms']:.2f} ms, "
              f"ITL p99 {row['itl_p99_ms']:.2f} ms, failed {row['failed']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"script": "benchmarks/bench_serve.py", "args": vars(args), "rows": rows},
                                         indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
