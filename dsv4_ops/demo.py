"""`python -m dsv4_ops demo`: a small DeepSeek-V4 (random weights) prefilling a ragged batch
and generating greedily, eager vs torch.compile (vs CUDA graphs on GPU), with a table of
throughput, compile time, graph breaks, recompiles and whether the tokens agree."""
from __future__ import annotations

import threading
import time

import torch

from .config import DSV4Config
from .generator import Generator
from .model.model import DeepseekV4ForCausalLM


class _Ticker:
    """Prints elapsed seconds every few seconds while a long phase (compilation) runs."""

    def __init__(self, label: str, every: float = 5.0) -> None:
        self.label, self.every = label, every
        self._stop = threading.Event()

    def __enter__(self):
        self.t0 = time.perf_counter()
        print(f"  {self.label} ...", flush=True)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            print(f"    ... {self.label}: {time.perf_counter() - self.t0:.0f} s", flush=True)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        print(f"  {self.label}: done in {time.perf_counter() - self.t0:.1f} s", flush=True)


def random_model(cfg: DSV4Config, dtype=torch.float32, device="cpu", seed: int = 0) -> DeepseekV4ForCausalLM:
    """A model with random weights at scales that keep activations O(1)."""
    torch.manual_seed(seed)
    m = DeepseekV4ForCausalLM(cfg, dtype=dtype, device=device).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
            else:
                p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2)
        for name, b in m.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, cfg.n_routed_experts, b.shape))
            elif name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    return m


def run(device: str | None = None, max_new_tokens: int = 32, compile: bool = True, spec_steps: int = 0) -> int:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = DSV4Config.tiny()
    model = random_model(cfg, device=device)
    prompts = [[1, 2, 3], list(range(5, 45)), [7] * 70]
    print(f"dsv4_ops demo: tiny DeepSeek-V4 ({cfg.num_hidden_layers} layers: {', '.join(cfg.layer_types)}),"
          f" random weights, device={device}, torch {torch.__version__}")
    print(f"  prompts of {[len(p) for p in prompts]} tokens, {max_new_tokens} new tokens each (greedy)")

    modes = [("eager", dict(compile=False))]
    if compile:
        modes.append(("compiled", dict(compile=True, cuda_graphs=False)))
        if device == "cuda":
            modes.append(("compiled + CUDA graphs", dict(compile=True, cuda_graphs=True)))
    if spec_steps:  # the same modes again with MTP drafting (random MTP weights: low acceptance)
        modes += [(f"{name}, MTP k={spec_steps}", dict(kw, spec_steps=spec_steps)) for name, kw in list(modes)]
    rows, reference = [], None
    for name, kw in modes:
        gen = Generator(model, max_batch_size=4, max_seq_len=256, prefill_chunk=32, **kw)
        if kw["compile"]:
            with _Ticker(f"{name}: compiling prefill + decode steps (first call)"):
                gen.generate(prompts, max_new_tokens=2)
        with _Ticker(f"{name}: generating"):
            t0 = time.perf_counter()
            out = gen.generate(prompts, max_new_tokens=max_new_tokens)
            if device == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        reference = reference or out
        s = gen.stats
        accept = f"{s['acceptance_rate']:.0%}" if kw.get("spec_steps") else "-"
        rows.append((name, len(prompts) * max_new_tokens / wall, s["decode_tokens_per_s"], s["compile_time_s"],
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
