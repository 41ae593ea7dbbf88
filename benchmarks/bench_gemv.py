"""Dense decode projections at V4-Flash widths: ``dsv4::gemv`` vs cuBLAS (``F.linear`` / the grouped
einsum the model ran before) vs the weight-bytes floor, for 1-8 tokens. ``--sweep`` first times
launch configurations at one token and reports the best per shape.

Each row is a CUDA graph replay (``triton.testing.do_bench_cudagraph``) of calls on rotating
weight copies (at least 256 MB in all, 5x the H200's L2), so the weights come from HBM as in a
decode step. The "Flash slice step" line sums each path over the projections one batch-1 decode
step of the 4-layer Flash slice runs (2 sliding, 1 CSA, 1 HCA layer; counts in ``STEP``).

    python3 benchmarks/bench_gemv.py [--sweep] --out out/bench_gemv.json        # GPU box
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dsv4_ops  # noqa: E402,F401  (registers the ops)
from dsv4_ops.lowering.triton import gemv as gv  # noqa: E402

HBM_BYTES_PER_S = 4.3e12
MIN_ROTATED_BYTES = 256 << 20
# (name, G, N, K): count in one batch-1 decode step of the Flash slice
STEP = {("q_a", 1, 1024, 4096): 4, ("q_b", 1, 32768, 1024): 4, ("kv", 1, 512, 4096): 4,
        ("o_a (8 groups)", 8, 1024, 4096): 4, ("o_b", 1, 4096, 8192): 4, ("shared gate / up", 1, 2048, 4096): 8,
        ("shared down", 1, 4096, 2048): 4, ("CSA compressor kv / gate", 1, 1024, 4096): 2,
        ("HCA compressor kv / gate", 1, 512, 4096): 2, ("indexer q_b", 1, 8192, 1024): 1}

SWEPT = ("q_b", "o_b", "kv")  # the widest, the longest rows, the narrowest


def bench_graph(fn, calls: int) -> float:
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3 / calls  # us per call


def cublas(x, w):
    """What the model ran before: F.linear for one group, the grouped einsum (bmm) for o_a."""
    return F.linear(x[:, 0], w[0]) if w.shape[0] == 1 else torch.einsum("tgk,gnk->tgn", x, w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default="out/bench_gemv.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    result = {"meta": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "hbm_bytes_per_s": HBM_BYTES_PER_S, "default_config": gv.DEFAULT_CONFIG}, "sweep": [], "rows": []}
    weights = {}
    for (name, G, N, K) in STEP:
        nbytes = G * N * K * 2
        copies = max(2, -(-MIN_ROTATED_BYTES // nbytes))
        weights[name] = [torch.randn(G, N, K, device=dev, dtype=torch.bfloat16) * K**-0.5 for _ in range(copies)]

    def timed(name, T, fn_one):
        ws = weights[name]
        xs = torch.randn(T, ws[0].shape[0], ws[0].shape[2], device=dev, dtype=torch.bfloat16)

        def fn():
            for w in ws:
                fn_one(xs, w)
        return bench_graph(fn, len(ws))

    if args.sweep:
        grid = [dict(rows=r, cols=c, stages=s, warps=wp) for r, c, s, wp in
                itertools.product((2, 4, 8), (256, 512, 1024), (3, 4), (4, 8))]
        for (name, G, N, K) in [s for s in STEP if s[0] in SWEPT]:
            floor = G * N * K * 2 / HBM_BYTES_PER_S * 1e6
            best = None
            for cfg in grid:
                us = timed(name, 1, lambda x, w, cfg=cfg: gv.gemv(x, w, config=cfg))
                result["sweep"].append({"shape": name, "config": cfg, "us": us, "floor_us": floor})
                if best is None or us < best[0]:
                    best = (us, cfg)
            print(f"[sweep] {name:26s} best {best[0]:7.1f} us ({floor / best[0]:.0%} of floor) {best[1]}", flush=True)

    step = {T: {"gemv": 0.0, "cublas": 0.0, "best": 0.0, "floor": 0.0} for T in args.tokens}
    print(f"{'projection':26s} {'T':>2s} {'floor us':>9s} {'cuBLAS us':>10s} {'gemv us':>8s} {'gemv/floor':>10s} "
          f"{'speedup':>8s}", flush=True)
    for (name, G, N, K), count in STEP.items():
        ref = weights[name][0]
        x = torch.randn(1, G, K, device=dev, dtype=torch.bfloat16)
        got, want = gv.gemv(x, ref).float(), cublas(x, ref).float().view(1, G, N)
        assert (got - want).abs().max() <= 2e-2 * want.abs().max(), name  # a wrong kernel is not timed
        for T in args.tokens:
            floor = G * N * K * 2 / HBM_BYTES_PER_S * 1e6
            t_gemv = timed(name, T, gv.gemv)
            t_cublas = timed(name, T, cublas)
            row = dict(shape=name, G=G, N=N, K=K, tokens=T, count=count, floor_us=floor, gemv_us=t_gemv,
                       cublas_us=t_cublas)
            result["rows"].append(row)
            for key, val in (("gemv", t_gemv), ("cublas", t_cublas), ("best", min(t_gemv, t_cublas)), ("floor", floor)):
                step[T][key] += count * val
            print(f"{name:26s} {T:2d} {floor:9.1f} {t_cublas:10.1f} {t_gemv:8.1f} {floor / t_gemv:10.0%} "
                  f"{t_cublas / t_gemv:7.2f}x", flush=True)
    for T, s in step.items():
        print(f"Flash slice step, {T} token(s): floor {s['floor']:.0f} us, cuBLAS {s['cublas']:.0f} us, "
              f"gemv {s['gemv']:.0f} us, best of each {s['best']:.0f} us", flush=True)
    result["step"] = step
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
