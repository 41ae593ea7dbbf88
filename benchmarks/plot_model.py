"""Plot the model-level H200 results: decode step latency per mode next to HF transformers and
the bytes floor (bench_model.py), and speculative-step cost vs k next to its floor ratio
(bench_spec.py). Needs matplotlib (not a project requirement).

    python benchmarks/plot_model.py benchmarks/results/h200_bench_model.json \
        benchmarks/results/h200_bench_spec.json -o benchmarks/results/h200_model.png
"""
from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def decode_panel(ax, model: dict, batch: int) -> None:
    rows = [r for r in model["decode"] if r["batch"] == batch]
    ctx = [r["context"] // 1024 for r in rows]
    for key, label, style in (("eager_ms", "dsv4_ops eager", "s--"), ("compiled_ms", "compiled", "o--"),
                              ("graphed_ms", "compiled + CUDA graphs", "o-"), ("floor_ms", "bytes floor", "k:")):
        ax.plot(ctx, [r[key] for r in rows], style, label=label)
    hf = [r for r in model["hf"] if r["batch"] == batch and "hf_eager_ms" in r]
    if hf:
        ax.plot([r["context"] // 1024 for r in hf], [r["hf_eager_ms"] for r in hf], "x-", color="tab:red",
                label="HF transformers eager")
    ax.set_yscale("log")
    ax.set_xlabel("context (K tokens)")
    ax.set_ylabel("decode step (ms)")
    ax.set_title(f"decode, batch {batch}")
    ax.set_xticks(ctx)
    ax.grid(True, which="both", alpha=0.3)


def spec_panel(ax, spec: dict) -> None:
    for batch, color in ((1, "tab:blue"), (16, "tab:orange")):
        rows = [r for r in spec["rows"] if r["batch"] == batch]
        ks = [r["k"] for r in rows]
        ax.plot(ks, [r["ratio"] for r in rows], "o-", color=color, label=f"measured, batch {batch}")
        ax.plot(ks, [r["floor_ratio"] for r in rows], ":", color=color, label=f"bytes-floor ratio, batch {batch}")
    ax.axhline(1.5, color="tab:red", lw=1, label="issue target at k=3 (1.5x)")
    ax.set_xlabel("draft tokens k")
    ax.set_ylabel("speculative step / plain decode step")
    ax.set_title(f"MTP speculative step, ctx {spec['context'] // 1024}K")
    ax.set_xticks([1, 2, 3, 4])
    ax.grid(True, alpha=0.3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_json")
    ap.add_argument("spec_json")
    ap.add_argument("-o", "--out", required=True)
    args = ap.parse_args()
    model, spec = json.load(open(args.model_json)), json.load(open(args.spec_json))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    decode_panel(axes[0], model, 1)
    decode_panel(axes[1], model, 32)
    spec_panel(axes[2], spec)
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    fig.suptitle(f"dsv4_ops on {model['device']}, bench config (V4-Flash widths, 2 layers), bf16")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
