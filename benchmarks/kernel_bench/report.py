"""Results out: JSON (every row, every field), a markdown table, and a plot of the fraction of
the roofline floor reached (matplotlib, imported only here and only if present)."""
from __future__ import annotations

import json
from pathlib import Path

from . import roofline as rl

COLUMNS = ("kernel", "shape", "cache", "batch", "ctx", "time µs", "reference µs", "speedup", "floor µs", "fraction")
TIMING_CUDA = ("triton.testing.do_bench_cudagraph: median of CUDA-graph replays, each a pass over rotated input "
               "copies (L2-cold)")
TIMING_CPU = "CPU wall clock (smoke run: on CPU the op runs the reference too; floors are H200 numbers)"
LINESTYLES = {"flash": "-", "pro": "--"}  # anything else (ops shared by both shapes): dotted
MARKERS = {"bf16": "o", "fp8": "s"}  # per KV-cache dtype


def cache(r: dict) -> str:
    """The row's KV-cache dtype; rows of runs before FP8 cases existed were all bf16."""
    return r.get("cache", "bf16")


def name(r: dict) -> str:
    """Label plus the cache dtype when it is not bf16: one name per plotted line / note."""
    return r["label"] if cache(r) == "bf16" else f"{r['label']} {cache(r)}"


def ctx_label(ctx: int) -> str:
    return f"{ctx // 1024}K" if ctx % 1024 == 0 else str(ctx)


def _num(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x:.1f}" if x >= 100 else f"{x:.2f}" if x >= 1 else f"{x:.3g}"


def _pct(f: float | None) -> str:
    return "–" if f is None else f"{f * 100:.3g}%"


def table_row(r: dict) -> str:
    if r["status"] != "ok":
        time, ref, speedup, frac = r["status"], "–", "–", "–"
    else:
        time, ref, frac = _num(r["time_us"]), _num(r.get("ref_us")), _pct(r["fraction"])
        speedup = "–" if r.get("speedup") is None else f"{r['speedup']:.3g}×"
    cells = (r["label"], r["shape"], cache(r), str(r["batch"]), ctx_label(r["ctx"]), time, ref, speedup,
             _num(r["floor_us"]), frac)
    return "| " + " | ".join(cells) + " |"


def notes(rows: list[dict]) -> list[str]:
    """One line per row that needs a caveat next to its numbers."""
    out, warm = [], {}
    for r in rows:
        case = f"{name(r)} {r['shape']} B={r['batch']} ctx={ctx_label(r['ctx'])}"
        if r["status"] != "ok":
            out.append(f"{case}: {r['status']}: {r.get('reason')}")
            continue
        if r.get("ref_us") is None:
            out.append(f"{case}: reference not timed: {r.get('ref_reason')}")
        check = r.get("check") or {}
        if check and not check.get("ok", True):
            out.append(f"{case}: op and reference DISAGREE ({check})")
        if r.get("method") in ("do_bench", "cuda_events"):  # cuda_events: the same fallback in older runs
            out.append(f"{case}: CUDA-graph capture failed, timed eager calls with triton.testing.do_bench "
                       "(L2 flushed per call; may include launch overhead)")
        if r.get("l2_cold") is False:
            warm.setdefault(name(r), set()).add(r["batch"])
    if warm:  # one line: these are the tiny, latency-bound ops
        which = "; ".join(f"{lab} (B={', '.join(map(str, sorted(b)))})" for lab, b in sorted(warm.items()))
        out.append(f"not L2-cold (too little data to rotate past 2x L2 with the input copies allowed): {which}")
    return out


def markdown(meta: dict, rows: list[dict]) -> str:
    head = [
        "# dsv4_ops per-kernel benchmark (decode)",
        "",
        f"Device: {meta.get('device')}; torch {meta.get('torch')}, triton {meta.get('triton')}; {meta.get('date')}.",
        f"Time: {TIMING_CPU if meta.get('device') == 'cpu' else TIMING_CUDA}; "
        f"reference = `dsv4_ops.reference.ops` on the same inputs. Floor = max(bytes / "
        f"{rl.HBM_BYTES_PER_S / 1e12:.1f} TB/s, bf16 flops / {rl.BF16_FLOPS_PER_S / 1e12:.0f} TFLOP/s); "
        f"fraction = floor / time. Cache = the KV-cache dtype the op reads (fp8: FlashMLA's V4 layout, "
        "its floor counts the FP8 entry bytes, scales included).",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines = head + [table_row(r) for r in rows]
    extra = notes(rows)
    if extra:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in extra]
    return "\n".join(lines) + "\n"


def write_json(path: Path, meta: dict, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    tmp.replace(path)  # a run killed mid-write leaves the previous complete file


def write_markdown(path: Path, meta: dict, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown(meta, rows))


def plot(path: Path, rows: list[dict]) -> bool:
    """Fraction of the floor vs batch: one panel per context, one colour per kernel, one line
    style per shape, one marker per cache dtype. Returns False (with a message) when matplotlib
    is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; the GPU box has no display
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        print(f"matplotlib not installed: skipping the plot {path}")
        return False
    ok = [r for r in rows if r["status"] == "ok" and r.get("fraction")]
    contexts = sorted({r["ctx"] for r in ok})
    if not contexts:
        print(f"no measured rows: skipping the plot {path}")
        return False
    labels = sorted({r["label"] for r in ok})
    colors = {lab: plt.get_cmap("tab10")(i % 10) for i, lab in enumerate(labels)}
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4.5), sharey=True, squeeze=False)
    for ax, ctx in zip(axes[0], contexts):
        for lab, shape, dt in sorted({(r["label"], r["shape"], cache(r)) for r in ok if r["ctx"] == ctx}):
            pts = sorted((r["batch"], r["fraction"]) for r in ok if r["ctx"] == ctx and r["label"] == lab
                         and r["shape"] == shape and cache(r) == dt)
            ax.plot(*zip(*pts), marker=MARKERS.get(dt, "x"), color=colors[lab], linestyle=LINESTYLES.get(shape, ":"))
        ax.set(xscale="log", yscale="log", title=f"context {ctx_label(ctx)}", xlabel="batch")
        ax.set_xticks(sorted({r["batch"] for r in ok}), labels=[str(b) for b in sorted({r["batch"] for r in ok})])
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("fraction of roofline floor")
    shapes = sorted({r["shape"] for r in ok})
    handles = [Line2D([], [], color=colors[lab], marker="o", label=lab) for lab in labels]
    handles += [Line2D([], [], color="gray", linestyle=LINESTYLES.get(s, ":"), label=s) for s in shapes]
    caches = sorted({cache(r) for r in ok})
    if len(caches) > 1:  # a bf16-only run keeps its legend
        handles += [Line2D([], [], color="gray", marker=MARKERS.get(c, "x"), linestyle="", label=f"{c} cache")
                    for c in caches]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize="small")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
