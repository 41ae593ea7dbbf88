"""Routed experts of a few tokens at V4-Flash widths: ``dsv4::moe_gemv`` (two GEMV launches) vs the
model's grouped path (sort + ``torch._grouped_mm`` x 2 + gathers + weighted sum), against the bytes
floor of the experts the tokens route to. ``--sweep`` first times launch configurations of each
kernel at batch 1 and reports the best.

Every row is timed as a CUDA graph replay (``triton.testing.do_bench_cudagraph``) of ``ROTATE``
calls on different random routings, so the weights come from HBM (13 GB of experts, 50 MB of L2)
and the host's launch cost is out of the picture (inside the model's graph it is too).

    python3 benchmarks/bench_moe.py [--sweep] --out out/bench_moe.json        # GPU box
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dsv4_ops  # noqa: E402,F401  (registers the ops)
from dsv4_ops.lowering.triton import moe_gemv as mg  # noqa: E402
from dsv4_ops.lowering.aten.experts import experts_grouped_mm  # noqa: E402

E, D, I, K, LIMIT = 256, 4096, 2048, 6, 10.0
HBM_BYTES_PER_S = 4.3e12
ROTATE = 8


def bench_graph(fn) -> float:
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=200) * 1e3 / ROTATE  # us per call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default="out/bench_moe.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    w13 = torch.randn(E, 2 * I, D, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, D, I, device=dev, dtype=torch.bfloat16) * 0.02
    expert_bytes = 3 * I * D * 2
    result = {"meta": {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "E": E, "D": D, "I": I,
                       "K": K, "hbm_bytes_per_s": HBM_BYTES_PER_S, "rotate": ROTATE}, "sweep": [], "rows": []}

    def case(T):
        xs = [torch.randn(T, D, device=dev, dtype=torch.bfloat16) for _ in range(ROTATE)]
        idx = [torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)]) for _ in range(ROTATE)]
        wts = [torch.rand(T, K, device=dev).softmax(-1) for _ in range(ROTATE)]
        distinct = sum(int(i.unique().numel()) for i in idx) / ROTATE
        return xs, idx, wts, distinct

    if args.sweep:
        xs, idx, wts, distinct = case(1)
        floor_us = distinct * expert_bytes / HBM_BYTES_PER_S * 1e6
        outs = [torch.empty(1, D, device=dev) for _ in range(ROTATE)]
        grid = {"rows": [4, 8, 16, 32], "cols": [128, 256, 512], "stages": [3, 4], "warps": [4, 8]}
        for kernel in ("gate_up", "down"):
            best = None
            for rows, cols, stages, warps in itertools.product(*grid.values()):
                cfg = {f"{kernel}_rows": rows, f"{kernel}_cols": cols, f"{kernel}_stages": stages,
                       f"{kernel}_warps": warps}
                launches = [mg.moe_gemv_launches(xs[r], idx[r], wts[r], w13, w2, LIMIT, outs[r], cfg)
                            for r in range(ROTATE)]
                which = mg.moe_gate_up_kernel if kernel == "gate_up" else mg.moe_down_kernel

                def run(launches=launches, which=which, kernel=kernel):
                    for lc in launches:
                        mg.launch(which, lc.gate_up if kernel == "gate_up" else lc.down)
                try:
                    run()
                    us = bench_graph(run)
                except Exception as exc:  # a config that does not compile / fit: recorded, skipped
                    result["sweep"].append({"kernel": kernel, **cfg, "error": str(exc)[:200]})
                    continue
                share = 2 / 3 if kernel == "gate_up" else 1 / 3  # of an expert's bytes
                row = {"kernel": kernel, **cfg, "us": us, "floor_fraction": floor_us * share / us}
                result["sweep"].append(row)
                if best is None or us < best["us"]:
                    best = row
            print(f"[sweep] best {kernel}: {best}", flush=True)

    for T in args.tokens:
        xs, idx, wts, distinct = case(T)
        floor_us = distinct * expert_bytes / HBM_BYTES_PER_S * 1e6

        def op(xs=xs, idx=idx, wts=wts):
            for r in range(ROTATE):
                torch.ops.dsv4.moe_gemv(xs[r], idx[r], wts[r], w13, w2, LIMIT)

        def grouped(xs=xs, idx=idx, wts=wts, T=T):
            for r in range(ROTATE):
                y = experts_grouped_mm(xs[r], idx[r], w13, w2, LIMIT).view(T, K, D)
                (y.float() * wts[r].unsqueeze(-1)).sum(dim=1)

        got = torch.ops.dsv4.moe_gemv(xs[0], idx[0], wts[0], w13, w2, LIMIT)
        want = (experts_grouped_mm(xs[0], idx[0], w13, w2, LIMIT).float().view(T, K, D) * wts[0].unsqueeze(-1)).sum(1)
        err = float((got - want).abs().max() / want.abs().max())
        op(), grouped()
        t0 = time.perf_counter()
        op_us, grouped_us = bench_graph(op), bench_graph(grouped)
        row = {"tokens": T, "experts_read": distinct, "floor_us": floor_us, "moe_gemv_us": op_us,
               "grouped_us": grouped_us, "moe_gemv_floor_fraction": floor_us / op_us,
               "grouped_floor_fraction": floor_us / grouped_us, "max_rel_diff": err}
        result["rows"].append(row)
        print(f"[moe] T={T:2d} experts {distinct:5.1f}  floor {floor_us:7.1f} us  moe_gemv {op_us:7.1f} us "
              f"({floor_us / op_us:4.0%})  grouped {grouped_us:7.1f} us ({floor_us / grouped_us:4.0%})  "
              f"rel diff {err:.1e}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
