"""`python -m dsv4_ops demo`: the bundled trained tiny DeepSeek-V4 (``dsv4_ops.pretrained.tiny()``)
writing Python. First the text (eager, seconds): two prompts continued greedily, sampled
(seeded) and speculatively with the model's trained MTP block (with the measured acceptance
rate); then eager vs torch.compile (vs CUDA graphs on GPU), plain and speculative: a table of
throughput, compile time, graph breaks, recompiles and whether the tokens agree.

The generator shapes (``DEMO``) are the README's first snippet's, on the same model, so once the
demo has compiled them Inductor's on-disk cache serves the snippet in seconds.
"""
from __future__ import annotations

import sys
import time

import torch

from . import pretrained
from .checkpoint import load_checkpoint
from .generator import Generator
from .progress import Progress

# one batch bucket (2 prompts), short prefill chunks: the least a CPU has to compile
DEMO = dict(max_batch_size=2, max_seq_len=256, prefill_chunk=16)
# no trailing newline: the BPE merges a newline with the next line's indentation, so a prompt that
# ends in a bare "\n" token ends where training text almost never does
PROMPTS = ['def fibonacci(n):\n    """Return the n-th Fibonacci number."""', "class Stack:\n    def __init__(self):"]
SAMPLING = dict(temperature=0.8, top_p=0.95, seed=0)
# a 2-core CPU, cold Inductor cache: the prefill + decode steps, the prefill + speculative steps
CPU_COMPILE_ESTIMATE_S = {False: 105, True: 150}


def _show(title: str, prompts: list[str], texts: list[str]) -> None:
    # the generated text in bold on a terminal, after a marker elsewhere (a log, a pipe)
    start, end = ("\033[1m", "\033[0m") if sys.stdout.isatty() else ("\u25b6", "")
    print(f"\n  --- {title} ---")
    for prompt, text in zip(prompts, texts):
        print("  " + (prompt + start + text + end).replace("\n", "\n  "))
        print("  " + "." * 40)


def run(device: str | None = None, max_new_tokens: int = 48, compile: bool = True, spec_steps: int = 2,
        model_path: str | None = None) -> int:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    path = model_path or pretrained.tiny()
    model = load_checkpoint(path, device=device)
    tok = pretrained.tokenizer(path)
    print(f"dsv4_ops demo: a trained tiny DeepSeek-V4 on device={device}, torch {torch.__version__}")
    print("  model: " + pretrained.describe(path).replace("\n", "\n  "))
    ids = [tok.encode(p).ids for p in PROMPTS]
    print(f"  prompts of {[len(p) for p in ids]} tokens, {max_new_tokens} new tokens each")

    gen = Generator(model, **DEMO, compile=False)
    greedy = gen.generate(ids, max_new_tokens=max_new_tokens)
    _show("greedy", PROMPTS, [tok.decode(o) for o in greedy])
    sampled = gen.generate(ids, max_new_tokens=max_new_tokens, **SAMPLING)
    _show(f"sampled ({', '.join(f'{k} {v}' for k, v in SAMPLING.items())})", PROMPTS, [tok.decode(o) for o in sampled])
    if spec_steps:
        spec = Generator(model, **DEMO, compile=False, spec_steps=spec_steps)
        drafted = spec.generate(ids, max_new_tokens=max_new_tokens)
        print(f"\n  --- speculative, greedy (MTP k={spec_steps}): {spec.stats['acceptance_rate']:.0%} of the drafts "
              f"accepted, {spec.stats['tokens_per_step']:.2f} tokens per step; the tokens are the greedy ones: "
              f"{drafted == greedy} ---")

    modes = [("eager", dict(compile=False))]
    if compile:
        modes.append(("compiled", dict(compile=True, cuda_graphs=False)))
        if device == "cuda":
            modes.append(("compiled + CUDA graphs", dict(compile=True, cuda_graphs=True)))
        if device == "cpu":
            print("\n  note: the first compile is the slow part: Inductor traces the prefill and decode steps and "
                  "compiles C++ kernels for each\n  (1-2 minutes on 2 cores per kind of step); later runs load them "
                  "from Inductor's cache in seconds.")
    if spec_steps:
        modes += [(f"{name}, MTP k={spec_steps}", dict(kw, spec_steps=spec_steps)) for name, kw in list(modes)]
    rows = []
    for name, kw in modes:
        gen = Generator(model, **DEMO, **kw)
        if kw["compile"]:
            estimate = CPU_COMPILE_ESTIMATE_S["spec_steps" in kw] if device == "cpu" else 40
            with Progress(f"{name}: compiling the steps (first call)", estimate_s=estimate):
                gen.generate(ids, max_new_tokens=2 + kw.get("spec_steps", 0))
        before = gen.stats
        t0 = time.perf_counter()
        out = gen.generate(ids, max_new_tokens=max_new_tokens)
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        s = gen.stats
        drafted = s.get("drafted_tokens", 0) - before.get("drafted_tokens", 0)  # this run's, not the warm-up's
        accept = f"{(s['accepted_tokens'] - before['accepted_tokens']) / drafted:.0%}" if drafted else "-"
        rows.append((name, len(ids) * max_new_tokens / wall, s["decode_tokens_per_s"], s["compile_time_s"],
                     s["graph_breaks"], s["recompiles"], out == greedy, accept))

    head = ("mode", "tokens/s (all)", "decode tok/s", "compile s", "graph breaks", "recompiles", "tokens == eager",
            "drafts accepted")
    table = [head] + [(r[0], f"{r[1]:.1f}", f"{r[2]:.1f}", f"{r[3]:.1f}", str(r[4]), str(r[5]), str(r[6]), r[7])
                      for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    print()
    for i, r in enumerate(table):
        print("  " + " | ".join(c.ljust(w) for c, w in zip(r, widths)))
        if i == 0:
            print("  " + "-+-".join("-" * w for w in widths))
    ok = all(r[6] for r in rows) and all(r[4] == 0 and r[5] == 0 for r in rows)
    print("\n  OK: every mode produced the eager greedy tokens, no graph breaks, no recompiles" if ok else "\n  MISMATCH")
    return 0 if ok else 1
