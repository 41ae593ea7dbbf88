"""HF transformers ``generate`` on the bench config: unpatched (eager) vs ``dsv4_ops.hf.enable``
(eager, and HF's own compiled decode), next to our ``Generator`` on the same weights.

What is timed is what an HF user calls: ``model.generate(ids, attention_mask=..., max_new_tokens=N)``
on a batch of random prompts (CUDA-synchronised wall clock). The decode step time is
``(t(N) - t(1)) / (N - 1)`` -- a generate of N new tokens minus one of 1 new token (prefill and
the first token), so it counts HF's whole per-token loop: logits processors, stopping checks,
mask building and the forward. ``min_new_tokens=N`` keeps a random model from stopping early.
The Generator row is ``Generator.decode`` with CUDA graphs (benchmarks/bench_model.py's timer).

``--parts stalls`` (#47): after ``hf.enable`` and one warm-up generate (batch 1, a 1000-token prompt, 64 new
tokens), the first call of a new prompt length (1024) and of a larger ``max_new_tokens`` (512), both within the
pool's bucket, against the same call's steady state, with what each first call added: dynamo graphs, Triton
compiles (Triton's compilation listener) and CUDA-graph recordings. Target: none, and each first call <= 1.2x.

    python benchmarks/bench_hf.py --out out/bench_hf.json                                   # GPU box
    python benchmarks/bench_hf.py --config flash-slice --parts stalls --out out/hf_stalls.json
    python benchmarks/bench_hf.py --smoke                                                   # tiny config, any device
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dsv4_ops  # noqa: E402
from benchmarks.bench_model import bench_config  # noqa: E402
from benchmarks.random_weights import flash_slice_config, spread_hash_tables  # noqa: E402
from benchmarks.timing import time_call  # noqa: E402
from dsv4_ops import DSV4Config, Generator, cudagraph_replays  # noqa: E402
from dsv4_ops.checkpoint import building_in  # noqa: E402


def hf_model(cfg: DSV4Config, dtype, device):
    """A transformers DeepseekV4ForCausalLM with HF's own init (timings do not depend on values
    except through routing, so the hash layers get random expert ids: ``spread_hash_tables``);
    experts on HF's default implementation for the device."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(0)
    hcfg = cfg.to_hf()
    with building_in(dtype, device):  # built in ``dtype``: the Flash slice in fp32 first would not fit one GPU
        hf = DeepseekV4ForCausalLM(hcfg).to(dtype).eval()
    with torch.no_grad():  # HF leaves these empty / zero; give them sane values
        for name, p in hf.named_parameters():
            if name.endswith(("sinks", "position_bias")):
                p.normal_(0, 0.5)
    spread_hash_tables(hf, hcfg.n_routed_experts)
    return hf


def generate_s(hf, ids, mask, n: int) -> float:
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    sync()
    return time.perf_counter() - t0


def bench_generate(hf, label: str, batch: int, prompt: int, n: int, device, log, repeats: int = 3) -> dict:
    g = torch.Generator().manual_seed(100 + batch)
    ids = torch.randint(1, hf.config.vocab_size, (batch, prompt), generator=g).to(device)
    mask = torch.ones_like(ids)
    first = generate_s(hf, ids, mask, n)  # warm-up (compiles where HF compiles)
    one = min(generate_s(hf, ids, mask, 1) for _ in range(repeats))
    full = min(generate_s(hf, ids, mask, n) for _ in range(repeats))
    step_ms = (full - one) / (n - 1) * 1e3
    row = dict(engine=label, batch=batch, prompt=prompt, new_tokens=n, step_ms=step_ms,
               tokens_per_s=batch / step_ms * 1e3, generate_s=full, first_generate_s=first)
    log(f"  {label:<22} B={batch:<3} decode {step_ms:8.3f} ms/step = {row['tokens_per_s']:9.0f} tok/s "
        f"(generate {n} tokens: {full:.2f} s; first call {first:.1f} s)")
    return row


def bench_generator(hf, batch: int, prompt: int, n: int, device, log) -> dict:
    model = dsv4_ops.from_hf(hf)
    gen = Generator(model, max_batch_size=batch, max_seq_len=prompt + n + 64, cuda_graphs=device.type == "cuda")
    g = torch.Generator().manual_seed(100 + batch)
    gen.prefill(torch.randint(1, hf.config.vocab_size, (batch, prompt), generator=g).tolist())
    ids = torch.randint(1, hf.config.vocab_size, (batch,), generator=g).to(device)
    t = time_call(lambda: gen.decode(ids), device, warmup=5, iters=min(n, 50))
    row = dict(engine="dsv4_ops Generator", batch=batch, prompt=prompt, step_ms=t.ms,
               tokens_per_s=batch / t.ms * 1e3, method=t.method)
    log(f"  {'dsv4_ops Generator':<22} B={batch:<3} decode {t.ms:8.3f} ms/step = {row['tokens_per_s']:9.0f} tok/s")
    del gen, model
    return row


def profile_host(hf, args, device, log) -> None:
    """Host-side cost of HF's compiled generate loop per decode step, by function (cProfile)."""
    import cProfile
    import io
    import pstats

    dsv4_ops.hf.enable(hf)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, hf.config.vocab_size, (1, args.prompt), generator=g).to(device)
    mask = torch.ones_like(ids)
    generate_s(hf, ids, mask, args.new_tokens)  # warm-up: compile + graphs
    prof = cProfile.Profile()
    prof.enable()
    generate_s(hf, ids, mask, args.new_tokens)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(40)
    log(f"cProfile of one compiled generate ({args.new_tokens} tokens, batch 1):\n{out.getvalue()}")
    dsv4_ops.hf.disable(hf)
    torch._dynamo.reset()


def bench_stalls(hf, prompt: int, n: int, device, log) -> list[dict]:
    """After one warm-up generate of ``prompt`` + ``n`` tokens with ``hf.enable``: the first call of each new
    shape within the pool's bucket (a longer prompt, 8x the new tokens) vs its steady state (best of 2), and what
    the first call compiled or recorded."""
    import triton
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(7)
    ids_of = lambda P: torch.randint(1, hf.config.vocab_size, (1, P), generator=g).to(device)  # noqa: E731
    compiled: list[str] = []
    dsv4_ops.hf.enable(hf)
    cudagraph_replays.install()
    rows = []
    try:
        ids = ids_of(prompt)
        for _ in range(2):  # warm-up: compiles, then records its CUDA graphs
            generate_s(hf, ids, torch.ones_like(ids), n)
        triton.knobs.compilation.listener = lambda src, **kw: compiled.append(getattr(src, "name", str(src)))
        for case, P, N in (("warm shape", prompt, n), ("new prompt length", prompt + 24, n),
                           ("more new tokens", prompt, 8 * n)):
            ids = ids_of(P)
            before = (counters["stats"]["unique_graphs"], len(compiled), cudagraph_replays.recordings())
            first = generate_s(hf, ids, torch.ones_like(ids), N)
            added = (counters["stats"]["unique_graphs"] - before[0], len(compiled) - before[1],
                     cudagraph_replays.recordings() - before[2])
            steady = min(generate_s(hf, ids, torch.ones_like(ids), N) for _ in range(2))
            rows.append(dict(case=case, prompt=P, new_tokens=N, first_s=first, steady_s=steady, ratio=first / steady,
                             dynamo_graphs=added[0], triton_compiles=added[1], cuda_graph_recordings=added[2]))
            log(f"  {case:<18} prompt {P}, {N} new: first {first:.3f} s, steady {steady:.3f} s ({first / steady:.2f}x); "
                f"added {added[0]} dynamo graphs, {added[1]} Triton compiles, {added[2]} CUDA-graph recordings")
    finally:
        triton.knobs.compilation.listener = None
        dsv4_ops.hf.disable(hf)
        torch._dynamo.reset()
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--config", choices=("bench", "flash-slice"), default="bench")
    ap.add_argument("--parts", nargs="+", choices=("steps", "stalls"), default=["steps"],
                    help="steps: the decode step of every path; stalls: first calls of new shapes after warm-up")
    ap.add_argument("--smoke", action="store_true", help="tiny config in fp32 (CPU ok)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="after the rows: cProfile of one compiled generate at batch 1 (where the host time goes)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("bench_hf.py: no CUDA device; on CPU run --smoke")
    cfg = DSV4Config.tiny() if args.smoke else flash_slice_config() if args.config == "flash-slice" else bench_config(2)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.smoke:
        args.prompt, args.new_tokens, args.batches = 24, 8, [1, 2]
    log = lambda s: print(s, flush=True)  # noqa: E731
    config = "tiny" if args.smoke else args.config
    log(f"bench_hf: {config} config, {dtype}, {device}; prompt {args.prompt}, "
        f"{args.new_tokens} new tokens")
    hf = hf_model(cfg, dtype, device)
    rows, stalls = [], []
    if "stalls" in args.parts:
        log("stalls: first calls of new shapes after one warm-up, hf.enable (compiled on CUDA)")
        stalls = bench_stalls(hf, 40 if args.smoke else 1000, 8 if args.smoke else 64, device, log)
    for batch in args.batches if "steps" in args.parts else []:
        log(f"batch {batch}")
        rows.append(bench_generate(hf, "HF eager (unpatched)", batch, args.prompt, args.new_tokens, device, log))
        dsv4_ops.hf.enable(hf)
        hf.generation_config.disable_compile = True
        rows.append(bench_generate(hf, "enabled, eager", batch, args.prompt, args.new_tokens, device, log))
        hf.generation_config.disable_compile = False
        if device.type == "cuda":  # HF compiles the decode step on CUDA (CompileConfig(fullgraph=True))
            rows.append(bench_generate(hf, "enabled, compiled", batch, args.prompt, args.new_tokens, device, log))
        dsv4_ops.hf.disable(hf)
        torch._dynamo.reset()
        rows.append(bench_generator(hf, batch, args.prompt, args.new_tokens, device, log))
        torch._dynamo.reset()
    if args.profile:
        profile_host(hf, args, device, log)
    result = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  torch=torch.__version__, config="bench (2 layers)" if config == "bench" else config, rows=rows,
                  stalls=stalls)
    for batch in args.batches:
        by = {r["engine"]: r["step_ms"] for r in rows if r["batch"] == batch}
        if "enabled, compiled" in by:
            log(f"B={batch}: enabled+compiled is {by['HF eager (unpatched)'] / by['enabled, compiled']:.1f}x "
                f"unpatched HF eager, {by['enabled, compiled'] / by['dsv4_ops Generator']:.2f}x the Generator step")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
