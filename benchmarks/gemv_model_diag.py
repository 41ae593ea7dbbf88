"""Where ``dsv4::gemv`` and cuBLAS part ways in a whole model: per-step logit differences, eager.

Session 27 (BENCHMARKS.md): the GPU test that compares a compiled model's decode with the dense projections on
``dsv4::gemv`` against the same model on cuBLAS failed (4.6% of the logits' range at one step). This script feeds one
random bf16 model (the test's widths) the same tokens three ways -- the projections on the op, on cuBLAS
(``GEMV_MAX_TOKENS = 0``), and an fp32 copy on cuBLAS as the truth -- and prints, per step, each pair's largest
difference as a fraction of the fp32 logits' range. Two configs: the test's old one (score-routed experts, an indexer
picking 8 of 12 CSA entries) and one with no discrete choice that rounding can flip (experts routed by token id,
every CSA entry picked).

    PYTHONPATH=$PWD python3 benchmarks/gemv_model_diag.py            # GPU box (~1 min)
    PYTHONPATH=$PWD python3 benchmarks/gemv_model_diag.py --device cpu --small   # smoke run
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from dsv4_ops import DSV4Config, Generator  # noqa: E402
from dsv4_ops.model import linear  # noqa: E402
from model_util import random_model  # noqa: E402

PROMPT = list(range(3, 40))
CONFIGS = {
    "score-routed experts, indexer picks 8 of 12 entries (the test before session 27)": {},
    "no flips: experts routed by token id, index_topk 16": dict(mlp_layer_types=["hash_moe"] * 4, index_topk=16),
}


def decode(model, ids, gemv: bool) -> list[torch.Tensor]:
    """Prefill ``PROMPT``, then decode ``ids``: every step's logits (eager; cuBLAS everywhere unless ``gemv``)."""
    saved = linear.GEMV_MAX_TOKENS
    if not gemv:
        linear.GEMV_MAX_TOKENS = 0
    try:
        g = Generator(model, max_batch_size=1, max_seq_len=128, prefill_chunk=16, compile=False)
        return [o.float() for o in [g.prefill([PROMPT])] + [g.decode(i) for i in ids]]
    finally:
        linear.GEMV_MAX_TOKENS = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--small", action="store_true", help="the tiny config's own widths (a CPU smoke run)")
    args = ap.parse_args()
    widths = {} if args.small else dict(hidden_size=2048, q_lora_rank=512, o_lora_rank=1024, moe_intermediate_size=512)
    for name, extra in CONFIGS.items():
        torch.manual_seed(0)
        model = random_model(DSV4Config.tiny(**widths, **extra), dtype=torch.bfloat16, device=args.device)
        greedy = Generator(model, max_batch_size=1, max_seq_len=128, prefill_chunk=16, compile=False)
        logits, ids = greedy.prefill([PROMPT]), []
        for _ in range(args.steps):
            ids.append(logits.argmax(-1))
            logits = greedy.decode(ids[-1])
        on_op, on_cublas = decode(model, ids, True), decode(model, ids, False)
        truth = decode(copy.deepcopy(model).float(), ids, False)
        print(f"== {name}")
        for step, (a, b, t) in enumerate(zip(on_op, on_cublas, truth)):
            scale = t.abs().max().item()

            def frac(x, y):
                return (x - y).abs().max().item() / scale

            print(f"step {step:2d}: |gemv-cublas| {frac(a, b):.4f}  |gemv-fp32| {frac(a, t):.4f}  "
                  f"|cublas-fp32| {frac(b, t):.4f}  (of max|fp32| {scale:.2f})", flush=True)


if __name__ == "__main__":
    main()
