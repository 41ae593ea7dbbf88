"""Speculative decoding through the public path (DESIGN.md §6): a speculative step of
``Generator(model, ..., spec_steps=k)`` (verify k+1 tokens, accept on device, MTP extend, k-1
MTP drafts: one CUDA graph) vs a plain decode step of ``Generator(..., spec_steps=0)``, both
driven by ``generate``, on the bench config (benchmarks/bench_model.py) at a ``--context``-token
prompt.

A step's time, by difference: ``generate(prompts, max_new_tokens=n)`` is timed for
``n = n_short`` and ``n_long`` (benchmarks/timing.py: CUDA events, each call alone, median of
``--samples`` after a warm-up call), and the number of steps each call ran is read from
``gen.stats["decode_steps"]``; prefill and every fixed per-call cost cancel:

    step_ms = (T(n_long) - T(n_short)) / (steps(n_long) - steps(n_short))

The speculative ``generate`` loop syncs once per step (it reads the accepted counts); the plain
loop does not. The speculative step is a static graph, so its cost does not depend on how many
drafts are accepted: tokens/s under full acceptance = B (k+1) / step_ms. The measured tokens per
step and acceptance come from ``gen.stats`` (random MTP weights against a random main model:
drafts almost never match, ~1 token per step) -- unless ``--distill-steps N`` first trains the MTP
block on the main model's own greedy continuations (``dsv4_ops.distill.distill_mtp``), which gives
the drafter real acceptance on a random-weight model.

Bytes floor of a step (4.3 TB/s): a plain step reads the main model once (bench_model.floor_parts);
a speculative step reads it once for the verify pass (its B (k+1) tokens route to more experts)
plus, k times, the MTP block (its routed experts for B tokens), the shared LM head, the MTP
window and B embedding rows -- the k draft forwards depend on each other.

    python3 benchmarks/bench_spec.py --out out/bench_spec.json     # GPU box (tools/gpu_check.sh spec), ~5 min cold
    python3 benchmarks/bench_spec.py --config flash-slice --distill-steps 200 --ks 1 2 3 4 --out out/spec.json
    python3 benchmarks/bench_spec.py --smoke --out /tmp/spec.json   # tiny config, eager, CPU
    python3 benchmarks/bench_spec.py --model build/trained-gpu --context 1024 --ks 1 2 3 4 --out spec.json

``--model DIR`` times a trained checkpoint (``python -m dsv4_ops.train_tiny``) in bf16 instead, on
prompts cut from its held-out text (``train_tiny.corpus_files``): the acceptance is then that of a
trained MTP block on real continuations. The timed window (tokens ``n_short..n_long`` of the timed
prompts: 64 tokens of one prompt at batch 1) is a thin basis for it, so the tokens a step and the
acceptance that tokens/s is computed from are counted over ``--acceptance-prompts`` held-out prompts
(batches of B) of ``n_long`` greedy tokens each, on the same generator; the timed
window's own counts stay in each row as ``timed_tokens_per_step`` / ``timed_acceptance_rate``.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `benchmarks` and `dsv4_ops`

from benchmarks.bench_model import MODES, bench_config, floor_parts, release, weight_read_bytes  # noqa: E402
from benchmarks.kernel_bench.roofline import HBM_BYTES_PER_S  # noqa: E402
from benchmarks.timing import first_call_s, time_call  # noqa: E402
from dsv4_ops import DSV4Config, Generator  # noqa: E402
from benchmarks.random_weights import CONFIGS, bench_setup  # noqa: E402

STATS = ("decode_steps", "decode_tokens", "accepted_tokens", "drafted_tokens")


def spec_floor_bytes(model, cfg: DSV4Config, batch: int, ctx: int, k: int) -> int:
    """Main model once for the verify pass of ``k + 1`` tokens per row, plus ``k`` times the MTP
    block (routed experts of ``batch`` tokens), the LM head, the MTP window and the embedding rows."""
    verify = floor_parts(model, cfg, batch, ctx, tokens_per_row=k + 1)["total"]
    mtp = [(n, p) for n, p in model.named_parameters() if n.startswith("mtp.")]
    dense, experts, _ = weight_read_bytes(mtp, cfg, batch)
    head, embed = model.lm_head.weight, model.model.embed_tokens.weight
    window = batch * cfg.sliding_window * cfg.head_dim * model.dtype.itemsize
    per_draft = dense + experts + head.nbytes + window + batch * embed.shape[-1] * embed.element_size()
    return int(round(verify + k * per_draft))


def step_cost(gen, prompts, n_short: int, n_long: int, device, samples: int) -> dict:
    """Time of one decode / speculative step of ``gen`` from two ``generate`` lengths (above)."""
    first = first_call_s(lambda: gen.generate(prompts, max_new_tokens=n_long), device)  # compiles
    per: dict[int, dict] = {}
    for n in (n_short, n_long):
        before = {s: gen.stats.get(s, 0) for s in STATS}
        t = time_call(lambda: gen.generate(prompts, max_new_tokens=n), device, warmup=1, iters=samples,
                      sync_each=True)
        per[n] = {s: (gen.stats.get(s, 0) - before[s]) / (1 + samples) for s in STATS}
        per[n].update(ms=t.ms, samples=t.samples)
    short, long = per[n_short], per[n_long]
    d = {s: long[s] - short[s] for s in STATS}
    if d["decode_steps"] <= 0:
        raise RuntimeError(f"generate({n_long}) ran no more steps than generate({n_short}): {per}")
    B = len(prompts)
    return dict(step_ms=(long["ms"] - short["ms"]) / d["decode_steps"], steps_short=short["decode_steps"],
                steps_long=long["decode_steps"], generate_short_ms=short["ms"], generate_long_ms=long["ms"],
                tokens_per_step=d["decode_tokens"] / d["decode_steps"] / B,
                acceptance_rate=d["accepted_tokens"] / d["drafted_tokens"] if d["drafted_tokens"] else 0.0,
                samples=long["samples"], first_call_s=first)


def acceptance(gen, prompt_sets: list[list[list[int]]], max_new_tokens: int) -> dict:
    """Tokens a step (per row) and draft acceptance of ``gen`` over whole greedy continuations of
    ``max_new_tokens`` for each batch of prompts in ``prompt_sets``, counted from ``gen.stats``."""
    before = {s: gen.stats.get(s, 0) for s in STATS}
    for prompts in prompt_sets:
        gen.generate(prompts, max_new_tokens=max_new_tokens)
    d = {s: gen.stats.get(s, 0) - before[s] for s in STATS}
    rows = len(prompt_sets[0])
    return dict(tokens_per_step=d["decode_tokens"] / d["decode_steps"] / rows,
                acceptance_rate=d["accepted_tokens"] / d["drafted_tokens"] if d["drafted_tokens"] else 0.0,
                prompts=sum(len(p) for p in prompt_sets), new_tokens=max_new_tokens)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default: 1 16 (smoke: 1)")
    ap.add_argument("--ks", type=int, nargs="*", default=None,
                    help="draft tokens per step (default: 1 3; smoke: 1; none: the plain step only)")
    ap.add_argument("--context", type=int, nargs="+", default=None,
                    help="prompt tokens, one run per value on the same model (default 4096; smoke 24)")
    ap.add_argument("--new-tokens", type=int, nargs=2, default=None, metavar=("N_SHORT", "N_LONG"),
                    help="the two generate lengths (default: 8 72; smoke: 2 5)")
    ap.add_argument("--samples", type=int, default=None, help="timed generate calls per length (default 5; smoke 1)")
    ap.add_argument("--layers", type=int, default=2,
                    help="main-model layers (2 = the bench config); deeper models shrink the MTP block's share")
    ap.add_argument("--config", choices=CONFIGS, default="bench",
                    help="bench: the 2-layer 8-expert config; flash-slice: V4-Flash in miniature (256 experts)")
    ap.add_argument("--distill-steps", type=int, default=0,
                    help="first distil the MTP block for this many steps (dsv4_ops.distill.distill_mtp); 0 = random")
    ap.add_argument("--distill-params", default="attn+proj", help="which MTP parameters distillation trains")
    ap.add_argument("--distill-seq-len", type=int, default=96, help="tokens per distillation sequence")
    ap.add_argument("--model", default=None, metavar="DIR",
                    help="a trained checkpoint (python -m dsv4_ops.train_tiny) on held-out prompts, instead of --config")
    ap.add_argument("--acceptance-prompts", type=int, default=8,
                    help="--model: held-out prompts the tokens a step are counted over (rounded up to batches; 0: the "
                         "timed window only)")
    ap.add_argument("--smoke", action="store_true", help="tiny config, fp32, eager: a seconds-long check")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu (needs --smoke)")
    args = ap.parse_args(argv)
    if args.acceptance_prompts < 0:
        ap.error(f"--acceptance-prompts must be >= 0 (0: the timed window only), got {args.acceptance_prompts}")
    smoke = args.smoke
    defaults = dict(batches=[1] if smoke else [1, 16], ks=[1] if smoke else [1, 3], context=[24] if smoke else [4096],
                    new_tokens=[2, 5] if smoke else [8, 72], samples=1 if smoke else 5)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def trained_setup(args):
    """``(device, cfg, model, prompts_for)`` of ``--model DIR``: the checkpoint in bf16 on CUDA (fp32
    on CPU with ``--smoke``), prompts cut from consecutive stretches of its held-out text."""
    import dsv4_ops
    from dsv4_ops import pretrained, train_tiny

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.float32 if args.smoke else torch.bfloat16
    model = dsv4_ops.load_pretrained(args.model, dtype=dtype, device=device)
    stream = train_tiny.encode_texts(pretrained.tokenizer(args.model),
                                     train_tiny.read_texts(train_tiny.corpus_files()[1]))

    def prompts_for(batch: int, ctx: int) -> list[list[int]]:
        if len(stream) < batch * ctx:
            raise SystemExit(f"--model: the held-out text has {len(stream)} tokens, fewer than batch x context = "
                             f"{batch} x {ctx}")
        return stream[: batch * ctx].view(batch, ctx).tolist()

    return device, model.config, model, prompts_for


def main(argv=None, log=None) -> dict:
    args = parse_args(argv)
    log = log or (lambda msg: print(msg, flush=True))
    if args.model:
        device, cfg, model, prompts_for = trained_setup(args)
    else:
        device, cfg, model = bench_setup(args, "bench_spec", bench_config)

        def prompts_for(batch: int, ctx: int) -> list[list[int]]:
            return torch.randint(0, cfg.vocab_size, (batch, ctx), generator=torch.Generator().manual_seed(batch)).tolist()
    mode = MODES["eager" if args.smoke else "graphs"]
    distill = None
    if args.distill_steps:
        from dsv4_ops.distill import distill_mtp

        try:
            distill = distill_mtp(model, steps=args.distill_steps, batch=4 if args.smoke else 16,
                                  seq_len=24 if args.smoke else args.distill_seq_len, params=args.distill_params,
                                  init="last_layer")
            distill = {k: v for k, v in distill.items() if k not in ("loss", "trained_names")}
            log(f"distilled the MTP block: {distill}")
        except Exception as e:  # the timings still stand with the random drafter; say so in the results
            distill = dict(error=f"{type(e).__name__}: {e}")
            log(f"distillation failed, timing the random MTP block: {distill['error']}")
        release(device)
    n_short, n_long = args.new_tokens
    res = dict(meta=dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                         torch=torch.__version__, date=datetime.datetime.now().isoformat(timespec="seconds"),
                         argv=sys.argv[1:] if argv is None else argv,
                         config=args.model or ("tiny" if args.smoke else args.config), distill=distill,
                         layers=cfg.num_hidden_layers, generator=mode, new_tokens=[n_short, n_long],
                         hbm_bytes_per_s=HBM_BYTES_PER_S),
               contexts=args.context, layers=cfg.num_hidden_layers, rows=[], plain=[])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for ctx, B in itertools.product(args.context, args.batches):
        prompts = prompts_for(B, ctx)
        chunk = 512 if B == 1 and not args.smoke else 16 if args.smoke else 64
        held_out = prompts_for(B * -(-args.acceptance_prompts // B), ctx) if args.model else []
        accept_sets = [held_out[i:i + B] for i in range(0, len(held_out), B)]  # batches of B held-out prompts

        def generator(k: int) -> Generator:
            return Generator(model, max_batch_size=B, max_seq_len=ctx + n_long + 16, spec_steps=k,
                             prefill_chunk=chunk, **mode)

        plain = step_cost(generator(0), prompts, n_short, n_long, device, args.samples)
        release(device)
        plain_floor = floor_parts(model, cfg, B, ctx)["floor_ms"]
        t_plain = plain["step_ms"]
        res["plain"].append(dict(batch=B, context=ctx, plain_ms=t_plain, plain_floor_ms=plain_floor, plain=plain))
        out.write_text(json.dumps(res, indent=1))
        log(f"B={B} ctx={ctx}: plain decode step {t_plain:.3f} ms (bytes floor {plain_floor:.3f} ms; generate "
            f"{plain['generate_short_ms']:.1f} / {plain['generate_long_ms']:.1f} ms for {n_short} / {n_long} tokens)")
        for k in args.ks:
            gen = generator(k)
            spec = step_cost(gen, prompts, n_short, n_long, device, args.samples)
            accepted = acceptance(gen, accept_sets, n_long) if accept_sets else spec
            del gen
            release(device)
            t = spec["step_ms"]
            floor = spec_floor_bytes(model, cfg, B, ctx, k) / HBM_BYTES_PER_S * 1e3
            row = dict(batch=B, k=k, context=ctx, plain_ms=t_plain, spec_ms=t, ratio=t / t_plain,
                       plain_floor_ms=plain_floor, spec_floor_ms=floor, floor_ratio=floor / plain_floor,
                       spec_floor_fraction=floor / t, tokens_per_step=accepted["tokens_per_step"],
                       acceptance_rate=accepted["acceptance_rate"], tok_s_plain=B / t_plain * 1e3,
                       tok_s_measured=B * accepted["tokens_per_step"] / t * 1e3,
                       timed_tokens_per_step=spec["tokens_per_step"], timed_acceptance_rate=spec["acceptance_rate"],
                       acceptance_basis={f: accepted[f] for f in ("prompts", "new_tokens")} if accept_sets else "timed",
                       tok_s_full_acceptance=B * (k + 1) / t * 1e3,
                       plain=plain, spec=spec)
            res["rows"].append(row)
            log(f"B={B} ctx={ctx} k={k}: spec step {t:.3f} ms = {row['ratio']:.2f}x plain (bytes floors: {floor:.3f} ms = "
                f"{row['floor_ratio']:.2f}x plain's, {row['spec_floor_fraction']:.0%} reached); tok/s: "
                f"{row['tok_s_full_acceptance']:.0f} full acceptance, {row['tok_s_measured']:.0f} measured "
                f"({row['tokens_per_step']:.2f} tokens/step), {row['tok_s_plain']:.0f} plain")
            out.write_text(json.dumps(res, indent=1))
    out.write_text(json.dumps(res, indent=1))
    log(f"wrote {out}")
    return res


if __name__ == "__main__":
    main()
