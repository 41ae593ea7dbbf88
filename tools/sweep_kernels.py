"""Launch-config sweep of the hot decode kernels on one GPU (tuning data for the static configs).

    python tools/sweep_kernels.py --out out/sweep.json [--only attention|scores|topk|sinkhorn|fp8|fused ...]

For each kernel the script builds the per-kernel benchmark's inputs
(``benchmarks/kernel_bench/cases.py``: V4-Flash widths, context 32K, L2-cold input copies), runs
every config of its list, checks the output against the default config's (a config that computes
something else is reported, not timed) and times it like ``benchmarks/bench_ops.py``
(``benchmarks/timing.kernel_time``: do_bench_cudagraph, median). One line per
config, best first at the end of each sweep; the JSON keeps every row.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.kernel_bench import cases as C  # noqa: E402
from benchmarks.kernel_bench import roofline as rl  # noqa: E402
from benchmarks.timing import kernel_time, l2_bytes, rotation_copies  # noqa: E402
from dsv4_ops.lowering.triton import indexer as ix  # noqa: E402
from dsv4_ops.lowering.triton import sinkhorn as sk  # noqa: E402
from dsv4_ops.lowering.triton import sparse_attention as sa  # noqa: E402

CTX = 32768
FLASH, PRO = C.FLASH, C.PRO


def _copies(case: C.Case, dev: torch.device) -> list[tuple]:
    n = rotation_copies(case.cost.bytes, C.alloc_bytes(case), l2_bytes(dev), int(4e9))
    torch.manual_seed(case.seed)
    return [case.make(dev) for _ in range(n)]


def _attention_configs(B: int, H: int, D: int, entries: int) -> list[dict]:
    base = sa.attention_config(B, 1, H, D, entries)
    out = [base]
    if B < 64:  # small batches: the split count is what matters
        grid = [(32, 4, 8, sp) for sp in (1, 2, 3, 4, 6, 8, 10, 12, 16)] + [(32, 3, 8, sp) for sp in (2, 4, 8)]
    else:
        grid = [(32, st, 8, sp) for st in (2, 3, 4, 5) for sp in (1, 2, 3, 4)]
        grid += [(16, st, 8, sp) for st in (4, 6) for sp in (1, 2)] + [(64, 2, 8, sp) for sp in (1, 2)]
        grid += [(32, 4, 16, sp) for sp in (1, 2)]
    for bn, stages, warps, splits in grid:
        cfg = dict(base, BLOCK_N=bn, num_stages=stages, num_warps=warps, NUM_SPLITS=splits)
        if cfg != base:
            out.append(cfg)
    return out


def _scores_configs(base: dict) -> list[dict]:
    out = [base]
    for bn, chunk, warps, stages in [(64, 64, 4, 1), (64, 256, 4, 3), (64, 512, 4, 3), (64, 1024, 4, 2),
                                     (64, 1024, 4, 3), (64, 1024, 4, 4), (64, 2048, 4, 3), (64, 1024, 8, 3),
                                     (128, 128, 4, 1), (128, 512, 4, 3), (128, 1024, 4, 3), (128, 1024, 8, 3),
                                     (128, 2048, 8, 3), (128, 1024, 8, 4)]:
        cfg = dict(base, BLOCK_N=bn, CHUNK=chunk, num_warps=warps, num_stages=stages)
        if cfg != base:
            out.append(cfg)
    return out


def _topk_configs(base: dict, n: int) -> list[dict]:
    """The row-in-registers kernel's digit width and warps, and the looped kernel (rows of
    ``n`` scores; past the default TOPK_ROW, the row kernel is tried with a wider row); the
    split top-k off and on with segments of 2048, 4096 and 8192 entries (those shorter than
    the row), at 8 and 16 warps, whatever the default chose."""
    split = [dict(base, TOPK_SPLIT=0)]
    split += [dict(base, TOPK_SPLIT=seg, row_warps=w) for seg in (2048, 4096, 8192) if seg < n for w in (8, 16)]
    if n > base["TOPK_ROW"]:
        wide = [dict(base, TOPK_ROW=n, TOPK_BITS=bits, row_warps=16, TOPK_SPLIT=0) for bits in (4, 5)]
        configs = [base] + wide + split
    else:
        row = [dict(base, TOPK_BITS=bits, row_warps=w) for bits in (3, 4, 5, 6, 8) for w in (8, 16)]
        looped = [dict(base, TOPK_ROW=0, TOPK_BLOCK=4096, loop_warps=8, TOPK_SPLIT=0)]
        configs = [base] + row + split + looped
    out = []
    for c in configs:  # the default first, no config twice
        if c not in out:
            out.append(c)
    return out


FUSED_CHUNKS = (1024, 2048, 4096, 8192)
# warps tried besides the default (indexer.fused_warps) for a chunk; 4096 x 4 spills on sm_90
FUSED_OTHER_WARPS = {2048: (8,), 8192: (16,)}


def _fused_configs(base: dict, n: int, topk: int, chunks=FUSED_CHUNKS) -> list[dict]:
    """The whole indexer_topk: the unfused path first (``TOPK_FUSED=0``: the default before the
    fused top-k, the reference every other config's output must equal exactly), then the fused
    path at every chunk of ``chunks`` that keeps at most half of what it scores (``2 * topk <=
    chunk``) and is not longer than the row, at its default warps and ``FUSED_OTHER_WARPS``."""
    out = [dict(base, TOPK_FUSED=0)]
    for chunk in chunks:
        if 2 * topk <= chunk <= max(n, chunks[0]):
            out += [dict(base, TOPK_FUSED=chunk, fused_warps=0)]
            out += [dict(base, TOPK_FUSED=chunk, fused_warps=w) for w in FUSED_OTHER_WARPS.get(chunk, ())]
    return out


def _fp8_attention_configs(base: dict) -> list[dict]:
    """The FP8 readers' decode (``E4M3_HW``: 0 integer, 2 hardware convert, 3 bit moves, 4 bit moves in
    PTX) and how many gathered blocks are in flight (stages; more than fit raise at launch and are
    reported)."""
    out = [base]
    grid = [(hw, 32, st) for hw in (0, 2, 3, 4) for st in (2, 3)] + [(hw, 16, 4) for hw in (0, 4)]
    grid += [(4, 32, 4), (4, 32, 5), (4, 64, 2)]
    for hw, bn, stages in grid:
        cfg = dict(base, E4M3_HW=hw, num_stages=stages, BLOCK_N=bn)
        if cfg not in out:
            out.append(cfg)
    return out


def _fp8_scores_configs(base: dict) -> list[dict]:
    out = [base]
    for hw in (0, 2, 3, 4):
        for bn, chunk, warps, stages in [(64, base["CHUNK"], 4, 3), (128, base["CHUNK"], 8, 3)]:
            cfg = dict(base, E4M3_HW=hw, BLOCK_N=bn, CHUNK=chunk, num_warps=warps, num_stages=stages)
            if cfg not in out:
                out.append(cfg)
    return out


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.dtype in (torch.int32, torch.int64):
        return bool((got == want).float().mean() >= 0.99)  # near-ties may swap at the k-th score
    fin = torch.isfinite(want)
    if not torch.equal(fin, torch.isfinite(got)):
        return False
    return bool(((got[fin].float() - want[fin].float()).abs().max() <= 2e-2 * want[fin].float().abs().max()).item())


def sweep(name: str, run, configs: list[dict], copies: list[tuple], floor_us: float, target_ms: float, log,
          same=_same, show=None) -> list:
    dev = copies[0][0].device
    want = run(copies[0], configs[0]).clone()
    rows = []
    for i, cfg in enumerate(configs):
        row = dict(sweep=name, config=cfg, default=i == 0)
        try:
            ok = same(run(copies[0], cfg), want)
            row["matches_default"] = ok
            if ok:
                t = kernel_time([functools.partial(run, a, cfg) for a in copies], dev, target_ms)
                row.update(time_us=t.us, fraction=floor_us / t.us)
        except Exception as e:  # a config that does not compile or launch: report and go on
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        shown = {k: v for k, v in cfg.items() if k not in ("BLOCK_D", "BLOCK_HI", "BLOCK_DI", "KPAD")
                 and (show is None or k in show)}
        log(f"  [{i + 1:>2}/{len(configs)}] {name:<20} {shown} -> "
            + (f"{row['time_us']:8.2f} us  {100 * row['fraction']:5.1f}% of floor" if "time_us" in row
               else row.get("error", "output differs from the default config")))
    best = sorted((r for r in rows if "time_us" in r), key=lambda r: r["time_us"])[:3]
    for r in best:
        log(f"  best {name}: {r['time_us']:.2f} us ({100 * r['fraction']:.1f}%) {r['config']}")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/sweep.json")
    p.add_argument("--only", nargs="+", choices=["attention", "scores", "topk", "sinkhorn", "fp8", "fused"],
                   default=["attention", "scores", "topk"])
    p.add_argument("--fused-ctx", type=int, nargs="+", default=[32768, 131072],
                   help="contexts of the fused top-k sweep (--only fused; default: %(default)s)")
    p.add_argument("--batches", type=int, nargs="+", default=[64])
    p.add_argument("--target-ms", type=float, default=30.0)
    p.add_argument("--ctx", type=int, default=32768, help="context of every case (default: %(default)s)")
    p.add_argument("--tiny", action="store_true", help="tiny widths on the CPU under TRITON_INTERPRET=1 (a smoke run)")
    args = p.parse_args(argv)
    global CTX, FLASH, PRO
    CTX = args.ctx
    if args.tiny:
        CTX, FLASH, PRO = 256, C.TINY["flash"], C.TINY["pro"]
    elif not torch.cuda.is_available():
        print("sweep_kernels: needs a CUDA GPU (or --tiny under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    dev = torch.device("cpu" if args.tiny else "cuda")
    rows: list = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    for B in args.batches:
        if "attention" in args.only:
            for d, variant in ((FLASH, "csa"), (PRO, "csa"), (FLASH, "hca")):
                case = C.sparse_attention_case(d, variant, B, CTX, d.name)
                copies = _copies(case, dev)
                entries = d.window + (d.topk if variant == "csa" else CTX // d.hca_ratio)

                def run_attn(a, cfg):
                    return sa.sparse_attention(*a, config=cfg)

                configs = _attention_configs(B, d.heads, d.head_dim, entries)
                if (d, variant) != (FLASH, "csa"):  # the other shapes: the default and the 8 best of Flash CSA
                    flash = sorted((r for r in rows if r["sweep"] == f"attention flash csa B={B}" and "time_us" in r),
                                   key=lambda r: r["time_us"])[:8]
                    configs = [configs[0]] + [dict(configs[0], **{k: r["config"][k] for k in
                                              ("BLOCK_N", "num_stages", "num_warps", "NUM_SPLITS")}) for r in flash]
                rows += sweep(f"attention {d.name} {variant} B={B}", run_attn, configs, copies,
                              rl.floor_us(case.cost), args.target_ms, log)
                del copies
                torch.cuda.empty_cache()
                out.write_text(json.dumps(rows, indent=1))
        if {"scores", "topk"} & set(args.only):
            case = C.indexer_topk_case(FLASH, B, CTX, "flash")
            copies = _copies(case, dev)
            q, w, keys, vis, k = copies[0]
            base = ix.indexer_config(B, 1, q.shape[2], q.shape[3], keys.shape[1], k)
            if "scores" in args.only:
                scores_floor = B * keys.shape[1] * keys.shape[2] * keys.element_size() / 4.3e6  # keys read once, us
                rows += sweep(f"indexer_scores B={B}", lambda a, cfg: ix.indexer_scores(*a[:4], config=cfg),
                              _scores_configs(base), copies, scores_floor, args.target_ms, log)
            if "topk" in args.only:
                scored = [(ix.indexer_scores(*a[:4]), a[3], a[4]) for a in copies]

                def run_topk(a, cfg):
                    s, v, kk = a
                    o = torch.empty((*v.shape, kk), dtype=torch.int32, device=s.device)
                    return ix.topk_from_scores(s, v, kk, o, dict(base, **cfg))

                rows += sweep(f"topk B={B}", run_topk, _topk_configs(base, keys.shape[1]), scored, rl.floor_us(case.cost),
                              args.target_ms, log)
                # the whole op at the best scores + top-k configs (unfused: TOPK_FUSED=0), against the whole op's floor
                best = {}
                for kind, keys_of in (("indexer_scores", ("BLOCK_N", "CHUNK", "num_warps", "num_stages")),
                                      ("topk", ("TOPK_ROW", "TOPK_BITS", "TOPK_SPLIT", "row_warps", "TOPK_BLOCK",
                                               "loop_warps"))):
                    cand = sorted((r for r in rows if r["sweep"] == f"{kind} B={B}" and "time_us" in r),
                                  key=lambda r: r["time_us"])
                    if cand:
                        best.update({key: cand[0]["config"][key] for key in keys_of})
                rows += sweep(f"indexer_topk B={B}", lambda a, cfg: ix.indexer_topk(*a, config=cfg),
                              [base, dict(base, **best, TOPK_FUSED=0)], copies, rl.floor_us(case.cost),
                              args.target_ms, log)
            del copies
            torch.cuda.empty_cache()
            out.write_text(json.dumps(rows, indent=1))
        if "fp8" in args.only:  # the FP8-cache readers: attention (Flash CSA, HCA) and the indexer scores
            for d, variant in ((FLASH, "csa"), (FLASH, "hca")):
                case = C.sparse_attention_case(d, variant, B, CTX, d.name, "fp8")
                copies = _copies(case, dev)
                entries = d.window + (d.topk if variant == "csa" else CTX // d.hca_ratio)
                base = sa.attention_config(B, 1, d.heads, d.head_dim, entries, fp8=2)
                configs = _fp8_attention_configs(base)
                if variant == "hca":  # the default and the 4 best of CSA
                    timed = [r for r in rows if r["sweep"] == f"fp8 attention {d.name} csa B={B}" and "time_us" in r]
                    csa = sorted(timed, key=lambda r: r["time_us"])[:4]
                    configs = [base] + [r["config"] for r in csa if r["config"] != base]
                rows += sweep(f"fp8 attention {d.name} {variant} B={B}",
                              lambda a, cfg: sa.sparse_attention(*a, config=cfg), configs,
                              copies, rl.floor_us(case.cost), args.target_ms, log)
                del copies
                torch.cuda.empty_cache()
                out.write_text(json.dumps(rows, indent=1))
            case = C.indexer_topk_case(FLASH, B, CTX, "flash", "fp8")
            copies = _copies(case, dev)
            q, w, keys, vis, k = copies[0]
            n_keys = keys.shape[1] * keys.shape[2]
            base = ix.indexer_config(B, 1, q.shape[2], q.shape[3], n_keys, k)
            scores_floor = B * n_keys * keys.shape[3] / 4.3e6  # the keys' bytes (codes + scale) read once, us
            rows += sweep(f"fp8 indexer_scores B={B}", lambda a, cfg: ix.indexer_scores(*a[:4], config=cfg),
                          _fp8_scores_configs(base), copies, scores_floor, args.target_ms, log)
            del copies
            torch.cuda.empty_cache()
            out.write_text(json.dumps(rows, indent=1))
        if "fused" in args.only:  # the whole indexer_topk: unfused vs the fused top-k by chunk (exact same picks)
            for ctx in ([CTX] if args.tiny else args.fused_ctx):
                case = C.indexer_topk_case(FLASH, B, ctx, "flash")
                copies = _copies(case, dev)
                q, w, keys, vis, k = copies[0]
                n = keys.shape[1]
                base = ix.indexer_config(B, 1, q.shape[2], q.shape[3], n, k,
                                         ix.sm_count(dev), ix.backend())
                log(f"fused B={B} x {n} keys (ctx {ctx}), top-{k}: rule TOPK_FUSED={base['TOPK_FUSED']} "
                    f"(TOPK_SPLIT={base['TOPK_SPLIT']} unfused)")
                chunks = (16, 32, 64) if args.tiny else FUSED_CHUNKS
                rows += sweep(f"indexer_topk fused B={B} N={n}", lambda a, cfg: ix.indexer_topk(*a, config=cfg),
                              _fused_configs(base, n, k, chunks), copies, rl.floor_us(case.cost), args.target_ms, log,
                              same=torch.equal, show=("CHUNK", "TOPK_SPLIT", "TOPK_FUSED", "fused_warps"))
                del copies
                torch.cuda.empty_cache()
                out.write_text(json.dumps(rows, indent=1))
        if "sinkhorn" in args.only:  # one mHC site: the decode step's B matrices, a 1024-token prefill chunk's
            for T in (B, B * 1024):
                comb = [((torch.rand(T, 4, 4, device=dev) * 3).softmax(-1) + 1e-6,) for _ in range(4)]
                base = sk.sinkhorn_config(T, 4)
                configs = [base] + [c for c in (dict(BLOCK_T=bt, num_warps=w) for bt, w in
                                                ((2, 1), (8, 1), (16, 2), (64, 4), (4, 2))) if c != base]
                rows += sweep(f"sinkhorn T={T}", lambda a, cfg: sk.sinkhorn(a[0], 20, 1e-6, config=cfg), configs,
                              comb, rl.floor_us(rl.sinkhorn_cost(T)), args.target_ms, log)
    out.write_text(json.dumps(rows, indent=1))
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
