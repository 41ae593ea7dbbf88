"""``python -m dsv4_ops generate``: one prompt in, its answer streamed to stdout as it is made.

The text goes to stdout (then a newline), one summary line to stderr: tokens, tokens/s, time to
first token, why it finished and, with ``--spec-steps``, the measured draft acceptance. Usage
errors (a missing checkpoint, a prompt past the model's limit, bad sampling values) are one line
on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path

from .chat import encode_chat_ids
from .detokenize import Detokenizer, StopStrings
from .tokenizer import load_tokenizer

__all__ = ["add_arguments", "run", "prompt_ids", "UsageError"]

PROG = "python -m dsv4_ops generate"
SEED_LIMIT = 2**63
SEQ_ROUND = 256  # the KV pool's length is rounded up to this, so prompts of similar length share compiled shapes


class UsageError(ValueError):
    """A bad argument or input: printed as one line, exit code 2."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", metavar="DIR", help="checkpoint directory (config.json, safetensors, tokenizer.json)")
    which.add_argument("--config", choices=["tiny"], help="'tiny': the bundled trained tiny model "
                                                          "(dsv4_ops.pretrained.tiny(); it writes Python)")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the prompt text (without --chat: tokenized as it is, no BOS)")
    p.add_argument("--chat", action="store_true", help="encode the prompt as a user message in DeepSeek-V4's "
                                                       "chat format")
    p.add_argument("--system", metavar="TEXT", help="a system prompt (implies --chat)")
    p.add_argument("--thinking", action="store_true", help="thinking mode (implies --chat): the answer starts with "
                                                           "the reasoning; special tokens are printed, so </think> "
                                                           "shows where it ends")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="sample from the K most likely (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling, in (0, 1] (1 = off)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="seed of the sampled draws (default: random)")
    p.add_argument("--stop", action="extend", nargs="+", default=[], metavar="STR",
                   help="stop before the first of these strings (the end-of-sentence token always stops; in "
                        "bash, $'\\n' is a newline)")
    p.add_argument("--spec-steps", type=int, default=0, metavar="k", help="MTP speculative decoding with k draft "
                                                                          "tokens a step (0 = off)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the steps (default: on for cuda; off for cpu, where the first compile "
                        "takes one to two minutes on 2 cores before the first token)")
    p.add_argument("--dry-run", action="store_true", help="print the prompt as the model gets it (its text, then "
                                                          "its token ids as a JSON list) and exit; loads no model")


def _check_args(args) -> None:
    def bad(flag: str, value, want: str) -> None:
        raise UsageError(f"{flag} {value!r}: must be {want}")

    if args.max_new_tokens < 1:
        bad("--max-new-tokens", args.max_new_tokens, "an int >= 1")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        bad("--temperature", args.temperature, "a finite number >= 0 (0 = greedy)")
    if args.top_k < 0:
        bad("--top-k", args.top_k, "an int >= 0 (0 = off)")
    if not 0 < args.top_p <= 1:
        bad("--top-p", args.top_p, "a number in (0, 1]")
    if args.seed is not None and not 0 <= args.seed < SEED_LIMIT:
        bad("--seed", args.seed, "an int in [0, 2**63)")
    if args.spec_steps < 0:
        bad("--spec-steps", args.spec_steps, "an int >= 0")
    for s in args.stop:
        if not s:
            bad("--stop", s, "a non-empty string")


def checkpoint_dir(args) -> Path:
    if args.config == "tiny":
        from .. import pretrained

        return Path(pretrained.tiny())
    path = Path(args.model)
    if not path.is_dir():
        raise UsageError(f"--model {args.model}: no such directory")
    if not (path / "config.json").is_file():
        raise UsageError(f"--model {args.model}: {path / 'config.json'} not found (not a checkpoint directory)")
    return path


def model_limit(path: Path, tokenizer) -> int:
    """Most tokens a sequence may have: config.json's max_position_embeddings (and the tokenizer's limit)."""
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {path / 'config.json'}: {e}") from None
    limits = [v for v in (cfg.get("max_position_embeddings"), tokenizer.model_max_length) if isinstance(v, int)]
    return min(limits) if limits else 2**31


def eos_ids(path: Path, tokenizer) -> list[int]:
    """The ids that end a generation: generation_config.json's eos_token_id (an int or a list), else the
    tokenizer's EOS."""
    file = path / "generation_config.json"
    if file.is_file():
        with contextlib.suppress(OSError, ValueError):
            eos = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
            ids = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
            if ids and all(isinstance(i, int) for i in ids):
                return ids
    return [] if tokenizer.eos_token is None else [tokenizer.eos_token_id]


def prompt_ids(args, tokenizer) -> list[int]:
    """The prompt's token ids: chat-encoded with ``--chat`` (``--system``, ``--thinking``), else as typed."""
    if args.chat or args.system is not None or args.thinking:
        messages = ([{"role": "system", "content": args.system}] if args.system is not None else []) + [
            {"role": "user", "content": args.prompt}]
        return encode_chat_ids(tokenizer, messages, thinking=args.thinking)
    return tokenizer.encode(args.prompt)


def _generate(args, path: Path, tokenizer, ids: list[int], limit: int) -> int:
    import torch

    from ..hf import load_pretrained
    from ..generator import Generator

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: this torch sees no CUDA device")
    compile = (device == "cuda") if args.compile is None else args.compile
    model = load_pretrained(path, device=device)
    max_seq_len = min(limit, -(-(len(ids) + args.max_new_tokens) // SEQ_ROUND) * SEQ_ROUND)
    try:
        gen = Generator(model, max_batch_size=1, max_seq_len=max_seq_len, spec_steps=args.spec_steps, compile=compile)
    except ValueError as e:
        raise UsageError(f"--spec-steps {args.spec_steps}: {e}" if args.spec_steps else str(e)) from None
    eos = eos_ids(path, tokenizer)
    # thinking mode prints special tokens (</think>); the end-of-sentence token is never printed
    detok = Detokenizer(tokenizer, skip_special_tokens=not args.thinking)
    stops = StopStrings(args.stop) if args.stop else None
    out = sys.stdout
    n, finish, t_first = 0, "length", None
    t0 = time.perf_counter()
    steps = gen.stream(ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       seed=args.seed, eos_token_id=eos)
    with contextlib.closing(steps):
        for step in steps:
            t_first = t_first or time.perf_counter()
            for token in step:
                n += 1
                if token in eos:
                    finish = "eos"
                    break
                text, stopped = stops.push(detok.push(token)) if stops else (detok.push(token), False)
                out.write(text)
                out.flush()
                if stopped:
                    finish = f"stop string {stops.matched!r}"
                    break
            if finish != "length":
                break
    if stops is None:
        out.write(detok.flush())
    elif not stops.stopped:  # the held-back bytes, then the text held back as a possible stop string
        text, stopped = stops.push(detok.flush())
        out.write(text if stopped else text + stops.flush())
        finish = f"stop string {stops.matched!r}" if stopped else finish
    out.write("\n")
    out.flush()
    t_end = time.perf_counter()
    ttft = t_first - t0
    rate = f"{(n - 1) / (t_end - t_first):.1f} tokens/s after the first" if n > 1 and t_end > t_first else "-"
    mode = "compiled" if compile else "eager"
    if compile:
        mode += f" (compiling took {gen.stats['compile_time_s']:.1f} s, in the time to first token)"
    summary = (f"{PROG}: {n} tokens in {t_end - t0:.2f} s ({rate}), time to first token {ttft * 1000:.0f} ms "
               f"({len(ids)} prompt tokens), finished: {finish}; {mode} on {device}")
    if args.spec_steps:
        s = gen.stats
        summary += (f"; MTP k={args.spec_steps}: {s['acceptance_rate']:.0%} of {s['drafted_tokens']} drafts "
                    f"accepted, {s['tokens_per_step']:.2f} tokens per step")
    print(summary, file=sys.stderr)
    return 0


def run(args) -> int:
    """Run ``generate`` for parsed ``args``; 0 on success, 2 with one line on stderr for bad input."""
    try:
        _check_args(args)
        path = checkpoint_dir(args)
        tokenizer = load_tokenizer(path)
        ids = prompt_ids(args, tokenizer)
        if not ids:
            raise UsageError("--prompt is empty (0 tokens); give the model something to continue")
        limit = model_limit(path, tokenizer)
        if len(ids) > limit:
            raise UsageError(f"--prompt has {len(ids)} tokens, more than the model's limit of {limit}")
        if len(ids) + args.max_new_tokens - 1 > limit:
            raise UsageError(f"--max-new-tokens {args.max_new_tokens}: the prompt's {len(ids)} tokens + the new ones "
                             f"pass the model's limit of {limit} (at most {limit - len(ids) + 1} new tokens)")
        if args.dry_run:
            print(tokenizer.decode(ids, skip_special_tokens=False))
            print(json.dumps(ids))
            return 0
        return _generate(args, path, tokenizer, ids, limit)
    except (ValueError, OSError) as e:  # UsageError, and what loading a checkpoint or tokenizer raises
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130
