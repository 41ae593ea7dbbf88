"""Plot the model-level H200 results: decode step latency per mode next to HF transformers and
the bytes floor (bench_model.py), and speculative-step cost vs k next to its floor ratio
(bench_spec.py). Needs matplotlib (not a project requirement).

    python3 benchmarks/plot_model.py out/bench_model.json \
        out/bench_spec.json -o out/model.png
"""
from __future__ import annotations

import argparse
import json



def decode_series(model: dict, batch: int) -> dict[str, list[tuple[int, float]]]:
    """``{series: [(context, ms), ...]}`` at ``batch``, from either JSON layout: rows with a
    ``mode`` and ``ms`` (bench_model.py now) or one row per point with ``eager_ms`` /
    ``compiled_ms`` / ``graphed_ms`` (results from before the public-path rewrite)."""
    series: dict[str, list[tuple[int, float]]] = {}
    for r in model["decode"]:
        if r["batch"] != batch:
            continue
        if "mode" in r:
            series.setdefault(r["mode"], []).append((r["context"], r["ms"]))
            if r["mode"] in ("graphs", "aoti"):
                series.setdefault("floor", []).append((r["context"], r["floor_ms"]))
        else:
            for key, name in (("eager_ms", "eager"), ("compiled_ms", "compiled"), ("graphed_ms", "graphs"),
                              ("floor_ms", "floor")):
                series.setdefault(name, []).append((r["context"], r[key]))
    hf = [(r["context"], r.get("ms", r.get("hf_eager_ms"))) for r in model.get("hf", []) if r["batch"] == batch]
    series["hf"] = [(c, ms) for c, ms in hf if ms is not None]
    return {k: sorted(v) for k, v in series.items() if v}


def decode_panel(ax, model: dict, batch: int) -> None:
    series = decode_series(model, batch)
    styles = (("eager", "dsv4_ops eager", "s--"), ("compiled", "compiled", "o--"),
              ("graphs", "compiled + CUDA graphs", "o-"), ("aoti", "AOTI", "^-"), ("floor", "bytes floor", "k:"),
              ("hf", "HF transformers eager", "x-"))
    for key, label, style in styles:
        if key in series:
            ax.plot([c // 1024 for c, _ in series[key]], [ms for _, ms in series[key]], style, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("context (K tokens)")
    ax.set_ylabel("decode step (ms)")
    ax.set_title(f"decode, batch {batch}")
    ax.set_xticks(sorted({c // 1024 for v in series.values() for c, _ in v}))
    ax.grid(True, which="both", alpha=0.3)


def spec_panel(ax, spec: dict) -> None:
    for batch, color in zip(sorted({r["batch"] for r in spec["rows"]}), ("tab:blue", "tab:orange", "tab:green")):
        rows = [r for r in spec["rows"] if r["batch"] == batch]
        ks = [r["k"] for r in rows]
        ax.plot(ks, [r["ratio"] for r in rows], "o-", color=color, label=f"measured, batch {batch}")
        ax.plot(ks, [r["floor_ratio"] for r in rows], ":", color=color, label=f"bytes-floor ratio, batch {batch}")
    ax.axhline(1.5, color="tab:red", lw=1, label="issue target at k=3 (1.5x)")
    ax.set_xlabel("draft tokens k")
    ax.set_ylabel("speculative step / plain decode step")
    ctx = spec.get("contexts", [spec.get("context")])[0]  # older results: one "context"
    ax.set_title(f"MTP speculative step, ctx {ctx // 1024}K")
    ax.set_xticks(sorted({r["k"] for r in spec["rows"]}))
    ax.grid(True, alpha=0.3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_json")
    ap.add_argument("spec_json")
    ap.add_argument("-o", "--out", required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    model, spec = json.load(open(args.model_json)), json.load(open(args.spec_json))
    batches = sorted({r["batch"] for r in model["decode"]})
    fig, axes = plt.subplots(1, len(batches) + 1, figsize=(5.3 * (len(batches) + 1), 4.8))
    for ax, batch in zip(axes, batches):
        decode_panel(ax, model, batch)
    spec_panel(axes[-1], spec)
    axes[0].legend(fontsize=8)
    axes[-1].legend(fontsize=8)
    device = model.get("meta", model).get("device")
    fig.suptitle(f"dsv4_ops on {device}, bench config (V4-Flash widths, 2 layers), bf16")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
