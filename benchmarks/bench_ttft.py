"""Time to first token at the limit (#47): prompts of 1K, 4K, 32K and 128K tokens at batch 1 and 8 x 4K, through
every public path with its default settings, against the prefill's compute floor.

What is timed is the wall clock of one call that returns the first new token of every prompt, after a first call of
the same shapes (which compiles; its time is in the row as ``first_call_s``), median of ``--samples`` calls:

- ``Generator``: ``Generator(model, max_batch_size=B, max_seq_len=P + 16).generate(prompts, max_new_tokens=1)``
  (the default chunk buckets);
- ``Engine``: ``Engine(model, max_running=B, max_seq_len=P + 16, prefix_cache=False).generate(prompts, 1)``;
- the HF path: ``model.generate(ids, attention_mask=..., max_new_tokens=1)`` after ``dsv4_ops.hf.enable(model)``;
- HF transformers eager (unpatched) where it fits (``--hf-eager-points``, and ``--hf-budget-s`` of HF time).

One HF ``DeepseekV4ForCausalLM`` (HF's own init, bf16, on the GPU) holds the weights; ``dsv4_ops.from_hf`` shares
them with the Generator and the Engine, so the Flash slice fits one GPU once.

Floor (``prefill_floor``): ``max(flops / 790 TFLOP/s, bytes / 4.3 TB/s)`` with flops = 2 x the parameters a token
multiplies by (every main-model weight but the embedding and the LM head, the routed experts at top-k of E) x
tokens, the LM head for each row's last token, and attention and the indexer over the causal prompt (QK and PV over
each query's window, top-k picks or visible HCA entries; the CSA indexer over every visible compressed key); bytes =
every weight once (a prompt cut into several prefill steps reads them once a step: a 4K prompt in chunks of 2048
reads them twice). Memory: the peak of each path's timed calls (``torch.cuda.max_memory_allocated``).
``--prefill-chunks default 4096``: the Generator and Engine points also at ``prefill_chunk=4096``.

    python3 benchmarks/bench_ttft.py --config flash-slice --out out/bench_ttft.json   # GPU box
    python3 benchmarks/bench_ttft.py --smoke --out /tmp/ttft.json                     # tiny config, CPU: seconds
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `benchmarks` and `dsv4_ops`

import dsv4_ops  # noqa: E402
from benchmarks.bench_hf import hf_model  # noqa: E402
from benchmarks.bench_model import bench_config, is_routed_expert, release  # noqa: E402
from benchmarks.kernel_bench.roofline import BF16_FLOPS_PER_S, HBM_BYTES_PER_S  # noqa: E402
from benchmarks.timing import first_call_s, time_call  # noqa: E402
from benchmarks.random_weights import CONFIGS, flash_slice_config  # noqa: E402
from dsv4_ops import DSV4Config, Generator  # noqa: E402
from dsv4_ops.config import CSA, HCA  # noqa: E402
from dsv4_ops.serve import Engine  # noqa: E402

PATHS = ("generator", "engine", "hf_enabled", "hf_eager")
SLACK = 16  # max_seq_len past the prompt: the first token and a little


def point(s: str) -> tuple[int, int]:
    """``"8x4096"`` -> ``(8, 4096)``."""
    b, _, p = s.lower().partition("x")
    return int(b), int(p)


def attention_flops(cfg: DSV4Config, prompt: int) -> tuple[float, float]:
    """``(attention, indexer)`` matmul flops of one row's causal prefill of ``prompt`` tokens: per query at position
    t, QK and PV over its entries (window, then CSA top-k picks of the visible compressed entries or every visible HCA
    entry), and the CSA indexer's scores over every visible compressed key."""
    t = torch.arange(1, prompt + 1, dtype=torch.float64)  # tokens visible to each query
    window = t.clamp(max=cfg.sliding_window)
    attn = indexer = 0.0
    per_entry = 4 * cfg.num_attention_heads * cfg.head_dim  # QK and PV, 2 flops a multiply-add
    for kind in cfg.layer_types:
        entries = window
        if kind == CSA:
            visible = torch.div(t, cfg.csa_ratio, rounding_mode="floor")
            entries = entries + visible.clamp(max=cfg.index_topk)
            indexer += float(visible.sum()) * 2 * cfg.index_n_heads * cfg.index_head_dim
        elif kind == HCA:
            entries = entries + torch.div(t, cfg.hca_ratio, rounding_mode="floor")
        attn += float(entries.sum()) * per_entry
    return attn, indexer


def weights_of(model) -> dict:
    """What a prefill's floor needs of a model's parameters: ``dense`` and ``routed`` elements of the main model
    (the embedding, the LM head and the MTP block aside), ``head`` elements, and the ``bytes`` of all of them."""
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    main = [(n, p) for n, p in model.named_parameters()
            if not n.startswith("mtp.") and p is not embed and p is not head]
    return dict(dense=sum(p.numel() for n, p in main if not is_routed_expert(n)),
                routed=sum(p.numel() for n, p in main if is_routed_expert(n)), head=head.numel(),
                bytes=sum(p.nbytes for _, p in main) + head.nbytes)


def prefill_floor(w: dict, cfg: DSV4Config, batch: int, prompt: int) -> dict:
    """The compute and bytes floors of a ``batch x prompt`` prefill that ends in each row's first token."""
    per_token = w["dense"] + w["routed"] * cfg.num_experts_per_tok / max(cfg.n_routed_experts, 1)
    attn, indexer = attention_flops(cfg, prompt)
    parts = dict(weights=2 * per_token * batch * prompt, lm_head=2 * w["head"] * batch, attention=batch * attn,
                 indexer=batch * indexer)
    flops = sum(parts.values())
    compute_ms, bytes_ms = flops / BF16_FLOPS_PER_S * 1e3, w["bytes"] / HBM_BYTES_PER_S * 1e3
    return dict(flops=flops, flops_parts=parts, bytes=w["bytes"], compute_ms=compute_ms, bytes_ms=bytes_ms,
                floor_ms=max(compute_ms, bytes_ms))


def time_ttft(fn, device: torch.device, samples: int) -> dict:
    """``fn()`` returns once every row's first token is on the host: its first call (compiles), then the median of
    ``samples`` calls each timed alone (``timing.time_call``), and the peak memory of those."""
    first = first_call_s(fn, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t = time_call(fn, device, warmup=0, iters=samples, sync_each=True)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return dict(ms=t.ms, samples=t.samples, method=t.method, first_call_s=first, peak_gib=peak)


def prompts_of(cfg: DSV4Config, batch: int, prompt: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, cfg.vocab_size, (batch, prompt), generator=g).tolist()


def run_path(path: str, hf, model, cfg, batch: int, prompt: int, device, samples: int, chunk: int | None = None) -> dict:
    """One path at one point: its TTFT row (or ``error``: what stopped it, e.g. out of memory); ``chunk``: the
    Generator's and Engine's ``prefill_chunk`` (None: their default)."""
    ids = prompts_of(cfg, batch, prompt, seed=batch * 100003 + prompt)
    try:
        if path == "generator":
            gen = Generator(model, max_batch_size=batch, max_seq_len=prompt + SLACK,
                            compile=device.type == "cuda", prefill_chunk=chunk)
            row = time_ttft(lambda: gen.generate(ids, max_new_tokens=1), device, samples)
            row.update(prefill_steps=gen.stats["prefill_steps"], recompiles=gen.stats["recompiles"])
            del gen
        elif path == "engine":
            eng = Engine(model, max_running=batch, max_seq_len=prompt + SLACK, prefix_cache=False,
                         compile=device.type == "cuda", prefill_chunk=chunk)
            row = time_ttft(lambda: eng.generate(ids, max_new_tokens=1), device, samples)
            row.update(recompiles=eng.stats["recompiles"])
            del eng
        else:
            x = torch.tensor(ids, device=device)
            mask = torch.ones_like(x)
            row = time_ttft(lambda: hf.generate(x, attention_mask=mask, max_new_tokens=1, do_sample=False,
                                                pad_token_id=0), device, samples)
    except torch.OutOfMemoryError as e:
        row = dict(error=f"out of memory: {str(e).splitlines()[0][:200]}")
    release(device)
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", choices=CONFIGS, default="flash-slice")
    ap.add_argument("--points", nargs="+", default=None, metavar="BxP",
                    help="batch x prompt tokens (default: 1x1024 1x4096 1x32768 1x131072 8x4096)")
    ap.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    ap.add_argument("--hf-points", nargs="*", default=None, metavar="BxP",
                    help="points of the HF path after enable (default: 1x1024 1x4096 8x4096 1x32768)")
    ap.add_argument("--hf-eager-points", nargs="*", default=None, metavar="BxP",
                    help="points of unpatched HF eager (default: 1x1024 1x4096)")
    ap.add_argument("--hf-budget-s", type=float, default=300.0, help="start no further HF eager point after this")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--prefill-chunks", nargs="+", default=["default"], metavar="N|default",
                    help="generator and engine: each point at each of these prefill_chunk values (default: theirs)")
    ap.add_argument("--smoke", action="store_true", help="tiny config, fp32, eager, small prompts (CPU)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("bench_ttft.py: no CUDA device; on CPU run --smoke")
    if args.smoke:
        cfg, dtype = DSV4Config.tiny(), torch.float32
        args.points = args.points or ["1x24", "2x40"]
        args.hf_points = args.hf_points if args.hf_points is not None else ["1x24"]
        args.hf_eager_points = args.hf_eager_points if args.hf_eager_points is not None else ["1x24"]
        args.samples = min(args.samples, 2)
    else:
        cfg = flash_slice_config() if args.config == "flash-slice" else bench_config(2)
        dtype = torch.bfloat16
        args.points = args.points or ["1x1024", "1x4096", "1x32768", "1x131072", "8x4096"]
        args.hf_points = args.hf_points if args.hf_points is not None else ["1x1024", "1x4096", "8x4096", "1x32768"]
        args.hf_eager_points = args.hf_eager_points if args.hf_eager_points is not None else ["1x1024", "1x4096"]
    log = lambda s: print(s, flush=True)  # noqa: E731
    # no MTP block: no path here drafts, and at V4 widths its experts (a layer's worth) would take the memory a
    # 128K prefill needs beside the Flash slice on an 80 GB card
    cfg = dataclasses.replace(cfg, num_nextn_predict_layers=0)
    hf = hf_model(cfg, dtype, device)
    model = dsv4_ops.from_hf(hf)  # the same weight tensors
    weights = weights_of(model)
    result = dict(script="benchmarks/bench_ttft.py", date=datetime.datetime.now().isoformat(timespec="seconds"),
                  device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  torch=torch.__version__, config="tiny" if args.smoke else args.config, argv=vars(args), rows=[])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def record(path: str, B: int, P: int, row: dict, chunk: int | None = None) -> None:
        floor = prefill_floor(weights, cfg, B, P)
        row = dict(path=path, batch=B, prompt=P, prefill_chunk=chunk, floor=floor, **row)
        if "ms" in row:
            row["floor_fraction"] = floor["floor_ms"] / row["ms"]
            row["tokens_per_s"] = B * P / row["ms"] * 1e3
            peak = "" if row["peak_gib"] is None else f", peak {row['peak_gib']:.1f} GiB"
            at = f"{B} x {P:>6}" + ("" if chunk is None else f" (chunk {chunk})")
            log(f"  {path:<10} {at}: TTFT {row['ms']:9.1f} ms = {row['tokens_per_s']:8.0f} tok/s, "
                f"{row['floor_fraction']:.0%} of its {floor['floor_ms']:.3g} ms floor (first call "
                f"{row['first_call_s']:.1f} s{peak})")
        else:
            log(f"  {path:<10} {B} x {P:>6}{'' if chunk is None else f' (chunk {chunk})'}: {row['error']}")
        result["rows"].append(row)
        out.write_text(json.dumps(result, indent=1))

    chunks = [None if c == "default" else int(c) for c in args.prefill_chunks]
    for path in ("generator", "engine"):
        if path in args.paths:
            for (B, P), chunk in itertools.product(map(point, args.points), chunks):
                record(path, B, P, run_path(path, hf, model, cfg, B, P, device, args.samples, chunk), chunk)
    del model
    release(device)
    if "hf_enabled" in args.paths:
        dsv4_ops.hf.enable(hf)
        for B, P in map(point, args.hf_points):
            record("hf_enabled", B, P, run_path("hf_enabled", hf, None, cfg, B, P, device, args.samples))
        dsv4_ops.hf.disable(hf)
        release(device)
    if "hf_eager" in args.paths:
        t0 = time.perf_counter()
        for B, P in map(point, args.hf_eager_points):
            if time.perf_counter() - t0 > args.hf_budget_s:
                log(f"  hf_eager   {B} x {P:>6}: skipped (--hf-budget-s {args.hf_budget_s:.0f} spent)")
                continue
            record("hf_eager", B, P, run_path("hf_eager", hf, None, cfg, B, P, device, args.samples))
    return result


if __name__ == "__main__":
    main()
