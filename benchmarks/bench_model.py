"""Model-level benchmark through the public path (DESIGN.md §6): what a user calls.

    gen = dsv4_ops.Generator(model, max_batch_size=B, max_seq_len=N, compile=True)   # CUDA graphs on
    gen.prefill(prompts)                       # list[list[int]]
    gen.decode(next_ids)                       # LongTensor[B] on the device

Per batch size B (one Generator each): prefill tokens/s (several samples of the same prompts,
each call timed alone), then for each context: ``prefill`` B prompts of that many random tokens
(the real cache, once; its wall time is in the row), then ``decode`` timed back to back (CUDA
events around each public call, median of ``--iters`` after ``--warmup``; the first call
compiles). ``--modes`` picks the Generator flavours (``graphs`` = the default compile=True,
``compiled`` = compile=True, cuda_graphs=False, ``eager`` = compile=False); ``--compare-at``
adds eager and compiled at a few points. HF transformers' ``DeepseekV4ForCausalLM`` (eager;
under torch.compile it recompiles every step) is timed the same way after a chunked prefill.
``--aoti`` times the AOTInductor path instead: ``dsv4_ops.export(model, path, max_batch_size=B,
max_seq_len=N, prefill_chunk=C)`` then ``dsv4_ops.AOTIGenerator(path)``, same prefill / decode.

Bytes floor of a decode step (4.3 TB/s; ``floor_parts``): each weight the step must read once --
the routed experts its B tokens are expected to pick (not all experts), the embedding rows it
gathers, no MTP block -- plus each row's KV read once (window, CSA top-k entries + every visible
indexer key, every visible HCA entry).

Each decode row also has the floor of the routing the step actually did (``routed_floor_*``,
``experts_routed``: unique (layer, expert) pairs of one eager probe of the same step, see
``routed_floor_parts``).

Config: the "bench config" (V4-Flash widths, 2 layers: HCA + CSA, 8 experts top-2; bf16, random
weights), or ``--config flash-slice`` (V4-Flash widths and layer mix in miniature: 2 sliding
hash-MoE layers + CSA + HCA, 256 experts top-6 + 1 shared, vocab 129280, 1 MTP block; 68 GB bf16,
drawn on the GPU in seconds; no HF points by default: HF would build it in fp32 first). The default grid -- graphs at batch 1, 8, 64 x context 4K, 32K, eager and compiled at
1 x 4K, HF at 1 x 4K, 1 x 32K, 8 x 4K -- takes about 4-5 minutes on an H200 with cold compile
caches (6 graphs compiles of ~20 s, 2.4M prefill tokens at batch 64, HF <= 60 s).

    python3 benchmarks/bench_model.py --out out/bench_model.json              # GPU box (tools/gpu_check.sh model)
    python3 benchmarks/bench_model.py --aoti --batches 1 8 --out out/aoti.json # AOTI (tools/gpu_check.sh aoti)
    python3 benchmarks/bench_model.py --smoke --out /tmp/bench_model.json     # tiny config, eager, CPU: seconds
    python3 benchmarks/bench_model.py --config flash-slice --out out/flash_slice.json   # the Flash slice
    python3 benchmarks/bench_model.py --kv-cache-dtype bf16 fp8 --modes graphs --out out/fp8.json   # FP8 vs bf16
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `benchmarks` and `dsv4_ops`

from benchmarks.kernel_bench.roofline import HBM_BYTES_PER_S  # noqa: E402
from benchmarks.timing import first_call_s, time_call  # noqa: E402
from dsv4_ops import DSV4Config, Generator  # noqa: E402
from dsv4_ops.checkpoint import building_in  # noqa: E402
from dsv4_ops.reference import fp8_cache  # noqa: E402
from benchmarks.random_weights import CONFIGS, bench_setup, spread_hash_tables  # noqa: E402

# graphs: the Generator's default (compiled, CUDA graphs); graphs-pdl: the same with Inductor's PDL
# (Generator(pdl=True)), the comparison of BENCHMARKS.md session 18
MODES = {"graphs": dict(compile=True), "graphs-pdl": dict(compile=True, pdl=True),
         "compiled": dict(compile=True, cuda_graphs=False), "eager": dict(compile=False)}
DECODE_SLACK = 256  # max_seq_len headroom past the longest context: warm-up + timed decode calls
TIMING = ("CUDA events around each public call (decode: back to back, as a generation loop; prefill: each call "
          "alone), median after warm-up; CPU: wall clock")


def bench_config(layers: int = 2) -> DSV4Config:
    """V4-Flash widths with 2 layers (HCA, CSA), 8 experts top-2 x 2048, vocab 8192; ``layers``
    repeats the (HCA, CSA) pair pattern for deeper variants (the issue's bench config is 2)."""
    types = ["heavily_compressed_attention", "compressed_sparse_attention"] * (layers // 2 + 1)
    return DSV4Config(
        vocab_size=8192, hidden_size=4096, num_hidden_layers=layers, num_attention_heads=64, head_dim=512,
        rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128,
        layer_types=types[:layers], csa_ratio=4, hca_ratio=128,
        index_n_heads=64, index_head_dim=128, index_topk=512, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, moe_intermediate_size=2048, mlp_layer_types=["moe"] * layers,
    )  # fmt: skip


# ---- bytes floor ------------------------------------------------------------------------------
def routed_experts(n_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts that ``tokens`` tokens route to, each picking ``top_k``
    of ``n_experts`` uniformly: ``E * (1 - (1 - k/E)^T)`` (``k`` for one token, -> ``E``)."""
    if n_experts <= 0 or tokens <= 0:
        return 0.0
    return n_experts * (1 - (1 - top_k / n_experts) ** tokens)


def is_routed_expert(name: str) -> bool:
    """HF names: ``...mlp.experts.gate_up_proj`` / ``down_proj`` (not ``mlp.shared_experts.*``)."""
    return ".experts." in f".{name}"


def weight_read_bytes(named_params, cfg: DSV4Config, tokens: int) -> tuple[int, float, float]:
    """``(dense bytes, routed-expert bytes, experts read per layer)`` that ``tokens`` tokens read."""
    named_params = list(named_params)
    dense = sum(p.nbytes for n, p in named_params if not is_routed_expert(n))
    all_experts = sum(p.nbytes for n, p in named_params if is_routed_expert(n))
    read = routed_experts(cfg.n_routed_experts, cfg.num_experts_per_tok, tokens)
    return dense, all_experts * read / max(cfg.n_routed_experts, 1), read


def kv_bytes_per_row(cfg: DSV4Config, ctx: int, elem: int, kv_cache_dtype: str = "auto") -> int:
    """KV one row's step reads at context ``ctx``: every layer its window; CSA its top-k
    compressed entries and every visible indexer key; HCA every visible compressed entry.
    An entry is ``head_dim * elem`` bytes (indexer key ``index_head_dim * elem``), or with
    ``kv_cache_dtype="fp8"`` its FP8 layout's bytes, scales included (584 and 132 at V4 widths)."""
    if kv_cache_dtype == "fp8":
        entry = fp8_cache.KVLayout(cfg.head_dim, cfg.rope_head_dim).entry_bytes
        key = fp8_cache.IndexerLayout(cfg.index_head_dim).entry_bytes
    else:
        elem = 2 if kv_cache_dtype == "bf16" else elem
        entry, key = cfg.head_dim * elem, cfg.index_head_dim * elem
    kv = 0
    for t in cfg.layer_types:
        kv += min(cfg.sliding_window, ctx) * entry
        if t == "compressed_sparse_attention":
            n = ctx // cfg.csa_ratio
            kv += min(cfg.index_topk, n) * entry + n * key
        elif t == "heavily_compressed_attention":
            kv += (ctx // cfg.hca_ratio) * entry
    return kv


def floor_parts(model, cfg: DSV4Config, batch: int, ctx: int, tokens_per_row: int = 1,
                kv_cache_dtype: str = "auto") -> dict:
    """Bytes a step of ``tokens_per_row`` tokens per row must read at least (main model only):
    ``weights`` (every non-expert weight once, the LM head included), ``experts`` (the routed
    experts' expected share), ``embed`` (the gathered rows), ``kv`` (in ``kv_cache_dtype``);
    ``total``; ``floor_ms``."""
    embed = model.model.embed_tokens.weight
    main = [(n, p) for n, p in model.named_parameters() if not n.startswith("mtp.") and p is not embed]
    tokens = batch * tokens_per_row
    dense, experts, read = weight_read_bytes(main, cfg, tokens)
    parts = dict(weights=dense, experts=experts, experts_read=read,
                 embed=tokens * embed.shape[-1] * embed.element_size(),
                 kv=batch * kv_bytes_per_row(cfg, ctx, model.dtype.itemsize, kv_cache_dtype))
    parts["total"] = int(round(parts["weights"] + parts["experts"] + parts["embed"] + parts["kv"]))
    parts["floor_ms"] = parts["total"] / HBM_BYTES_PER_S * 1e3
    return parts


def decode_floor_bytes(model, cfg: DSV4Config, batch: int, ctx: int) -> int:
    return floor_parts(model, cfg, batch, ctx)["total"]


class RoutingRecorder:
    """``with RoutingRecorder(model) as rec: <eager calls>`` -> ``rec.pairs``: the (layer, expert)
    pairs the main model's routers picked, as a set (a hash row naming an expert twice, or two
    tokens sharing one, read it once). Python hooks: compiled graphs and CUDA-graph replays skip
    them, so record an eager run of the same step."""

    def __init__(self, model) -> None:
        self.routers = [layer.mlp.gate for layer in model.model.layers]
        self.pairs: set[tuple[int, int]] = set()

    def __enter__(self) -> "RoutingRecorder":
        def hook(layer: int):
            def record(module, args, out) -> None:
                self.pairs.update((layer, e) for e in out[1].unique().tolist())  # out: (weights, indices)
            return record

        self.pairs = set()
        self._handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(self.routers)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()


def probe_decode_routing(model, ids: torch.Tensor, lengths: torch.Tensor) -> set[tuple[int, int]]:
    """The (layer, expert) pairs of one eager cached decode step of ``ids [B]`` on rows at
    ``lengths [B]`` (e.g. a Generator's ``lengths[:B]`` after its timed steps). The lengths are
    not advanced; the step writes its KV at each row's next position, which the next real step
    rewrites (the pool is addressed by position, DESIGN rule 3)."""
    n_new = torch.ones_like(lengths)
    with RoutingRecorder(model) as rec, torch.no_grad():
        model(ids.reshape(-1, 1), lengths.clone(), n_new, last_only=True)
    return rec.pairs


def routed_floor_parts(model, cfg: DSV4Config, pairs, batch: int, ctx: int, tokens_per_row: int = 1,
                       kv_cache_dtype: str = "auto") -> dict:
    """Bytes a step must read given the routing it did (main model; no MTP):

        total = W_dense + sum over routed (l, e) of |gate_up_proj[l][e]| + |down_proj[l][e]|
                + B*S * |embedding row| + B * KV(ctx)

    ``W_dense``: every main-model parameter but the routed experts and the embedding table, once
    (attention, shared experts, routers, norms, mHC, LM head). ``pairs``: the unique (layer,
    expert) pairs the step's B*S tokens routed to (``probe_decode_routing`` / ``RoutingRecorder``).
    ``KV(ctx)``: ``kv_bytes_per_row`` (window, CSA top-k entries + every visible indexer key, every
    visible HCA entry; FP8 entry bytes with ``kv_cache_dtype="fp8"``). -> ``weights``, ``experts``, ``experts_routed``, ``embed``, ``kv``,
    ``total``, ``floor_ms`` (at 4.3 TB/s)."""
    embed = model.model.embed_tokens.weight
    main = [(n, p) for n, p in model.named_parameters() if not n.startswith("mtp.") and p is not embed]
    dense = sum(p.nbytes for n, p in main if not is_routed_expert(n))
    per_expert = [(e.gate_up_proj.nbytes + e.down_proj.nbytes) // e.gate_up_proj.shape[0]
                  for e in (layer.mlp.experts for layer in model.model.layers)]
    parts = dict(weights=dense, experts=sum(per_expert[layer] for layer, _ in pairs), experts_routed=len(pairs),
                 embed=batch * tokens_per_row * embed.shape[-1] * embed.element_size(),
                 kv=batch * kv_bytes_per_row(cfg, ctx, model.dtype.itemsize, kv_cache_dtype))
    parts["total"] = parts["weights"] + parts["experts"] + parts["embed"] + parts["kv"]
    parts["floor_ms"] = parts["total"] / HBM_BYTES_PER_S * 1e3
    return parts


# ---- engines ----------------------------------------------------------------------------------
def aoti_api():
    """``(dsv4_ops.export, dsv4_ops.AOTIGenerator)``, or SystemExit naming what is missing."""
    import dsv4_ops

    missing = [n for n in ("export", "AOTIGenerator") if not hasattr(dsv4_ops, n)]
    if missing:
        raise SystemExit(f"bench_model --aoti: dsv4_ops.{' and dsv4_ops.'.join(missing)} not in this checkout")
    return dsv4_ops.export, dsv4_ops.AOTIGenerator


def make_engine(model, mode: str, batch: int, max_seq_len: int, chunk: int, workdir: Path | None,
                kv_cache_dtype: str = "auto") -> tuple:
    """``(engine, setup dict)``: a ``Generator`` in ``mode``, or for ``"aoti"`` an exported and
    loaded ``AOTIGenerator`` (the setup dict has ``export_s`` and ``load_s``); the KV pool in
    ``kv_cache_dtype`` (``"auto"`` = the model's dtype, ``"bf16"``, ``"fp8"``)."""
    if mode != "aoti":
        return Generator(model, max_batch_size=batch, max_seq_len=max_seq_len, prefill_chunk=chunk,
                         kv_cache_dtype=kv_cache_dtype, **MODES[mode]), {}
    export, AOTIGenerator = aoti_api()
    scratch = workdir is None  # a temp dir, removed once the engine is released
    path = Path(workdir or tempfile.mkdtemp(prefix="dsv4_bench_aoti_")) / f"bench_b{batch}.pt2"
    t0 = time.perf_counter()
    kv = {} if kv_cache_dtype == "auto" else dict(kv_cache_dtype=kv_cache_dtype)  # "auto": the export default
    export(model, str(path), max_batch_size=batch, max_seq_len=max_seq_len, prefill_chunk=chunk, **kv)
    export_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine = AOTIGenerator(str(path))
    return engine, dict(export_s=export_s, load_s=time.perf_counter() - t0, package=None if scratch else str(path),
                        _scratch=str(path.parent) if scratch else None)


def release(device: torch.device) -> None:
    """Between engines: drop compiled code and CUDA-graph pools, as a fresh process would."""
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_engine(model, cfg, mode: str, batch: int, contexts: list[int], args, log,
                 kv_cache_dtype: str = "auto") -> tuple[list[dict], dict]:
    """One engine at batch ``batch`` (KV pool in ``kv_cache_dtype``): its prefill row and one
    decode row per context, each tagged with the cache dtype."""
    dev = model.device
    prompt_len = args.prefill_len if batch == 1 else max(args.prefill_len // 4, 1)
    chunk = (512 if batch == 1 else 64) if args.prefill_chunk is None else args.prefill_chunk or None
    max_seq_len = max(contexts + [prompt_len]) + DECODE_SLACK
    rng = torch.Generator().manual_seed(1000 + batch)

    def prompts(n: int) -> list[list[int]]:
        return torch.randint(0, cfg.vocab_size, (batch, n), generator=rng).tolist()

    engine, setup = make_engine(model, mode, batch, max_seq_len, chunk, args.aoti_dir, kv_cache_dtype)
    setup = dict(setup, kv_cache_dtype=kv_cache_dtype) if setup else setup
    log(f"  KV cache: {kv_cache_dtype}, {model.cache_nbytes() / 2**30:.2f} GiB")
    scratch = setup.pop("_scratch", None)
    if setup:
        log(f"  {mode} B={batch}: export {setup['export_s']:.0f} s, load {setup['load_s']:.1f} s")
    p = prompts(prompt_len)
    first = first_call_s(lambda: engine.prefill(p), dev)  # compiles (Generator) / first run (AOTI)
    t = time_call(lambda: engine.prefill(p), dev, warmup=1, iters=args.prefill_samples, sync_each=True)
    prefill = dict(mode=mode, batch=batch, prompt=prompt_len, chunk=chunk, ms=t.ms, samples=t.samples,
                   method=t.method, tokens_per_s=batch * prompt_len / t.ms * 1e3, first_call_s=first, **setup)
    log(f"  {mode} prefill B={batch} x {prompt_len} (chunk {chunk or 'buckets'}): {prefill['tokens_per_s']:.0f} tok/s "
        f"({t.ms:.1f} ms, median of {t.samples}; first call {first:.1f} s)")
    prefills = [prefill]
    for other_chunk in args.extra_prefill_chunks if mode != "aoti" else ():
        other = Generator(model, max_batch_size=batch, max_seq_len=max_seq_len, prefill_chunk=other_chunk or None,
                          kv_cache_dtype=kv_cache_dtype, **MODES[mode])  # 0: the default chunk buckets
        first = first_call_s(lambda: other.prefill(p), dev)
        t = time_call(lambda: other.prefill(p), dev, warmup=1, iters=args.prefill_samples, sync_each=True)
        prefills.append(dict(prefill, chunk=other_chunk, ms=t.ms, samples=t.samples, method=t.method,
                             tokens_per_s=batch * prompt_len / t.ms * 1e3, first_call_s=first))
        name = other_chunk or "buckets"
        log(f"  {mode} prefill B={batch} x {prompt_len} (chunk {name}): {prefills[-1]['tokens_per_s']:.0f} "
            f"tok/s ({t.ms:.1f} ms, median of {t.samples}; first call {first:.1f} s)")
        del other
    rows = []
    for ctx in contexts:
        p = prompts(ctx)
        ctx_prefill = first_call_s(lambda: engine.prefill(p), dev)
        ids = torch.randint(0, cfg.vocab_size, (batch,), generator=rng).to(dev)
        first = first_call_s(lambda: engine.decode(ids), dev)  # the first decode compiles
        t = time_call(lambda: engine.decode(ids), dev, warmup=args.warmup, iters=args.iters)
        floor = floor_parts(model, cfg, batch, ctx, kv_cache_dtype=kv_cache_dtype)
        row = dict(mode=mode, batch=batch, context=ctx, ms=t.ms, wall_ms=t.wall_ms, samples=t.samples,
                   warmup=args.warmup, method=t.method, floor_ms=floor["floor_ms"], floor_bytes=floor["total"],
                   experts_read=floor["experts_read"], floor_fraction=floor["floor_ms"] / t.ms,
                   first_call_s=first, context_prefill_s=ctx_prefill)
        if isinstance(engine, Generator):  # the model holds the caches: probe the routing of the same step eagerly
            routed = routed_floor_parts(model, cfg, probe_decode_routing(model, ids, engine.lengths[:batch]),
                                        batch, ctx, kv_cache_dtype=kv_cache_dtype)
            row.update(experts_routed=routed["experts_routed"], routed_floor_bytes=routed["total"],
                       routed_floor_ms=routed["floor_ms"], routed_floor_fraction=routed["floor_ms"] / t.ms)
        rows.append(row)
        log(f"  {mode} decode B={batch} ctx={ctx}: {t.ms:.3f} ms (median of {t.samples}; wall {t.wall_ms:.3f} ms/"
            f"call), floor {row['floor_ms']:.4g} ms = {row['floor_fraction']:.0%}; first call {first:.1f} s, "
            f"context prefill {ctx_prefill:.1f} s")
    del engine
    release(dev)
    if scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    return rows, prefills


def bench_hf(cfg, batch: int, ctx: int, dtype, device, args, log, chunk: int) -> dict:
    """HF transformers eager decode step after a chunked prefill (same config, random weights)."""
    from transformers import DeepseekV4ForCausalLM as HF

    torch.manual_seed(0)
    hcfg = cfg.to_hf(attn_implementation="eager")
    hcfg._experts_implementation = "eager"
    with building_in(dtype, device):  # built in the bench dtype: an fp32 Flash slice would not fit the GPU
        hf = HF(hcfg).to(dtype=dtype).eval()
    spread_hash_tables(hf, hcfg.n_routed_experts)
    ids = torch.randint(0, cfg.vocab_size, (batch, ctx), device=device)
    t0 = time.perf_counter()
    state = {}

    def run(x) -> None:
        out = hf(input_ids=x, cache=state.get("cache"), use_cache=True)
        state["cache"] = getattr(out, "cache", None) or out.past_key_values

    with torch.no_grad():
        for j in range(0, ctx, chunk):
            run(ids[:, j: j + chunk])
        prefill_s = time.perf_counter() - t0
        tok = ids[:, -1:]
        t = time_call(lambda: run(tok), device, warmup=2, iters=args.hf_iters)
    res = dict(batch=batch, context=ctx, ms=t.ms, samples=t.samples, method=t.method, prefill_s=prefill_s)
    log(f"  HF eager decode B={batch} ctx={ctx}: {t.ms:.2f} ms (median of {t.samples}; prefill {prefill_s:.0f} s)")
    del hf, state
    release(torch.device(device))
    return res


def point(s: str) -> tuple[int, int]:
    """``"8x4096"`` -> ``(8, 4096)``."""
    b, _, c = s.lower().partition("x")
    return int(b), int(c)


def summary(results: dict) -> list[str]:
    """One markdown table: every decode row next to HF at the same point."""
    hf = {(r["batch"], r["context"]): r.get("ms") for r in results["hf"]}
    lines = ["| mode | batch | context | ms | floor ms | floor reached | routed floor ms (experts) | HF eager ms | vs HF "
             "| KV cache |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results["decode"]:
        h = hf.get((r["batch"], r["context"]))
        hf_ms, vs = ("–", "–") if h is None else (f"{h:.2f}", f"{h / r['ms']:.1f}×")
        routed = f"{r['routed_floor_ms']:.3f} ({r['experts_routed']})" if "routed_floor_ms" in r else "–"
        lines.append(f"| {r['mode']} | {r['batch']} | {r['context']} | {r['ms']:.3f} | {r['floor_ms']:.3f} | "
                     f"{r['floor_fraction']:.0%} | {routed} | {hf_ms} | {vs} | {r.get('kv_cache_dtype', 'auto')} |")
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON results (rewritten after every row)")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default: 1 8 64 (smoke: 1 2)")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="default: 4096 32768 (smoke: 40)")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=None,
                    help="Generator flavours over the whole grid (default: graphs; smoke: eager)")
    ap.add_argument("--compare-at", nargs="*", default=None, metavar="BxCTX",
                    help="points where --compare-modes are also timed (default: 1x4096; smoke: none)")
    ap.add_argument("--compare-modes", nargs="+", choices=list(MODES), default=["eager", "compiled"])
    ap.add_argument("--hf-points", nargs="*", default=None, metavar="BxCTX",
                    help="HF transformers eager points (default: 1x4096 1x32768 8x4096; smoke: none)")
    ap.add_argument("--hf-budget-s", type=float, default=60.0, help="start no further HF point after this much HF time")
    ap.add_argument("--hf-iters", type=int, default=6)
    ap.add_argument("--prefill-len", type=int, default=None,
                    help="prefill prompt tokens at batch 1 (a quarter of it per row at batch > 1; default 4096)")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="default: 512 at batch 1, else 64; 0: the library's default, chunk buckets")
    ap.add_argument("--extra-prefill-chunks", type=int, nargs="*", default=[],
                    help="also time the prefill with these chunk sizes (a Generator each; 0 = the default, "
                         "chunk buckets; e.g. 0 64)")
    ap.add_argument("--prefill-samples", type=int, default=None, help="timed prefill calls (default 5; smoke 2)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="decode calls after the first (compiling) one, untimed (default 5; smoke 1)")
    ap.add_argument("--iters", type=int, default=None, help="timed decode calls (default 50; smoke 3)")
    ap.add_argument("--aoti", action="store_true",
                    help="time dsv4_ops.export + dsv4_ops.AOTIGenerator instead of the Generator (no HF)")
    ap.add_argument("--aoti-dir", type=Path, default=None, help="where the .pt2 packages go (default: a temp dir)")
    ap.add_argument("--config", choices=CONFIGS, default="bench",
                    help="bench: the historical 2-layer 8-expert config; flash-slice: V4-Flash in miniature")
    ap.add_argument("--layers", type=int, default=2, help="main-model layers of the bench config")
    ap.add_argument("--smoke", action="store_true", help="tiny config, fp32, eager, small grid: a seconds-long check")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu (needs --smoke)")
    ap.add_argument("--kv-cache-dtype", nargs="+", choices=["auto", "bf16", "fp8"], default=["auto"],
                    help="KV pool dtype(s) to time (each one its own engines and rows; fp8 = FlashMLA's V4 layout; "
                         "not with --smoke, whose tiny config has 48 nope dims)")
    args = ap.parse_args(argv)
    smoke = args.smoke
    defaults = dict(batches=[1, 2] if smoke else [1, 8, 64], contexts=[40] if smoke else [4096, 32768],
                    modes=["eager"] if smoke else ["graphs"], compare_at=[] if smoke else ["1x4096"],
                    hf_points=[] if smoke or args.config == "flash-slice" else ["1x4096", "1x32768", "8x4096"],
                    prefill_len=24 if smoke else 4096,
                    prefill_samples=2 if smoke else 5, warmup=1 if smoke else 5, iters=3 if smoke else 50)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if smoke:
        args.prefill_chunk = args.prefill_chunk or 16
    if args.aoti:
        args.modes, args.compare_at, args.hf_points = ["aoti"], [], []
    return args


def main(argv=None, log=None) -> dict:
    args = parse_args(argv)
    log = log or (lambda msg: print(msg, flush=True))
    device, cfg, model = bench_setup(args, "bench_model", bench_config)
    dtype = model.dtype
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    meta = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                torch=torch.__version__, triton=triton_version, cuda=torch.version.cuda,
                date=datetime.datetime.now().isoformat(timespec="seconds"), argv=sys.argv[1:] if argv is None else argv,
                engine="aoti" if args.aoti else "generator", config="tiny" if args.smoke else args.config,
                config_fields=dataclasses.asdict(cfg), dtype=str(dtype).removeprefix("torch."),
                hbm_bytes_per_s=HBM_BYTES_PER_S, timing=TIMING, decode_warmup=args.warmup, decode_iters=args.iters,
                prefill_samples=args.prefill_samples)
    results = dict(meta=meta, decode=[], prefill=[], hf=[])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out.write_text(json.dumps(results, indent=1))

    log(f"bench_model ({meta['config']} config, {meta['engine']}) on {meta['device']}, torch {meta['torch']}")
    jobs: dict[tuple[str, int, str], list[int]] = {(m, B, kv): list(args.contexts) for kv in args.kv_cache_dtype
                                                   for m in args.modes for B in args.batches}
    for s in args.compare_at:
        B, ctx = point(s)
        for m in args.compare_modes:
            for kv in args.kv_cache_dtype:
                jobs.setdefault((m, B, kv), [])
                if ctx not in jobs[(m, B, kv)]:
                    jobs[(m, B, kv)].append(ctx)
    for (mode, B, kv), contexts in jobs.items():
        rows, prefills = bench_engine(model, cfg, mode, B, contexts, args, log, kv)
        results["decode"] += [dict(r, kv_cache_dtype=kv) for r in rows]
        results["prefill"] += [dict(prefill, kv_cache_dtype=kv) for prefill in prefills]
        save()
    del model
    release(device)
    t_hf = time.perf_counter()
    for s in args.hf_points:
        B, ctx = point(s)
        if time.perf_counter() - t_hf > args.hf_budget_s:
            log(f"  HF B={B} ctx={ctx}: not run (HF time budget of {args.hf_budget_s:.0f} s spent)")
            results["hf"].append(dict(batch=B, context=ctx, error="not run: time budget"))
            continue
        try:
            results["hf"].append(bench_hf(cfg, B, ctx, dtype, device, args, log, chunk=2048 if B == 1 else 256))
        except Exception as e:  # keep the measured numbers even if HF fails
            log(f"  HF B={B} ctx={ctx} failed: {type(e).__name__}: {e}")
            results["hf"].append(dict(batch=B, context=ctx, error=f"{type(e).__name__}: {e}"))
            release(device)
        save()
    save()
    for line in summary(results):
        log(line)
    log(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
