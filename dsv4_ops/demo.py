"""`python -m dsv4_ops demo`: a small DeepSeek-V4 (random weights) prefilling a ragged batch and
generating greedily, eager vs torch.compile (vs CUDA graphs on GPU), with a table of throughput,
compile time, graph breaks, recompiles and whether the tokens agree.

The shapes here (``DEMO``) are the README's first snippet's, so once the demo has compiled them
Inductor's on-disk cache serves the snippet in seconds.
"""
from __future__ import annotations

import time

import torch

from .config import DSV4Config
from .generator import Generator
from .model.model import DeepseekV4ForCausalLM
from .progress import Progress

# one layer of each type, one batch bucket (2 prompts), short prefill chunks: the least a CPU
# has to compile (the README's first snippet uses exactly these, so it hits Inductor's cache)
LAYERS = 3
DEMO = dict(max_batch_size=2, max_seq_len=128, prefill_chunk=16)
PROMPTS = [[1, 2, 3], list(range(5, 45))]
CPU_COMPILE_ESTIMATE_S = 95  # a 2-core CPU, cold Inductor cache (4 layers took 122 s)


def run(device: str | None = None, max_new_tokens: int = 32, compile: bool = True, spec_steps: int = 0) -> int:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = DSV4Config.tiny(num_hidden_layers=LAYERS)
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(cfg, device=device).eval()
    print(f"dsv4_ops demo: tiny DeepSeek-V4 ({cfg.num_hidden_layers} layers: {', '.join(cfg.layer_types)}),"
          f" random weights, device={device}, torch {torch.__version__}")
    print(f"  prompts of {[len(p) for p in PROMPTS]} tokens, {max_new_tokens} new tokens each (greedy)")
    if compile and device == "cpu":
        print("  note: the first compile is the slow part: Inductor traces the prefill and decode steps and "
              "compiles C++ kernels for each\n  (1-2 minutes on 2 cores); later runs load them from "
              "Inductor's cache in seconds.")

    modes = [("eager", dict(compile=False))]
    if compile:
        modes.append(("compiled", dict(compile=True, cuda_graphs=False)))
        if device == "cuda":
            modes.append(("compiled + CUDA graphs", dict(compile=True, cuda_graphs=True)))
    if spec_steps:  # the same modes again with MTP drafting (random MTP weights: low acceptance)
        modes += [(f"{name}, MTP k={spec_steps}", dict(kw, spec_steps=spec_steps)) for name, kw in list(modes)]
    rows, reference = [], None
    for name, kw in modes:
        gen = Generator(model, **DEMO, **kw)
        if kw["compile"]:
            estimate = CPU_COMPILE_ESTIMATE_S if device == "cpu" else 40
            with Progress(f"{name}: compiling the prefill and decode steps (first call)", estimate_s=estimate):
                gen.generate(PROMPTS, max_new_tokens=2)
        t0 = time.perf_counter()
        out = gen.generate(PROMPTS, max_new_tokens=max_new_tokens)
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        reference = reference or out
        s = gen.stats
        accept = f"{s['acceptance_rate']:.0%}" if kw.get("spec_steps") else "-"
        rows.append((name, len(PROMPTS) * max_new_tokens / wall, s["decode_tokens_per_s"], s["compile_time_s"],
                     s["graph_breaks"], s["recompiles"], out == reference, accept))

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
    print(f"\n  first prompt's tokens: {reference[0][:16]}{' ...' if max_new_tokens > 16 else ''}")
    if spec_steps:
        print("  (MTP weights are random here, so few drafts are accepted; the tokens are exact regardless)")
    ok = all(r[6] for r in rows) and all(r[4] == 0 and r[5] == 0 for r in rows)
    print("  OK: every mode produced the eager tokens, no graph breaks, no recompiles" if ok else "  MISMATCH")
    return 0 if ok else 1
