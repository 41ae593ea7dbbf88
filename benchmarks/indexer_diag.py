"""Where the public ``indexer_topk``'s time goes at the bench cases: the whole op, its scores pass
alone, the CUDA top-k alone on those scores (and on Gaussian rows of the same shape), the two back to
back (what the op costs where it routes to the CUDA top-k), the top-k's stages, and how many select
passes its rows took.

    PYTHONPATH=$PWD python3 benchmarks/indexer_diag.py [--batches 64 128] [--contexts 32768]

One line a measurement: ``indexer B=.. ctx=.. cache=.. what=.. us=..``. The inputs are
``bench_ops.py``'s (``kernel_bench/cases.py``, Flash widths), so the lines add up to its table.
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dsv4_ops  # noqa: E402,F401  (registers the ops)
from benchmarks.kernel_bench import cases  # noqa: E402
from benchmarks.timing import kernel_time  # noqa: E402
from lowering.cuda import topk_rows  # noqa: E402
from lowering.triton import indexer as ix  # noqa: E402


def sweep_scores(tag: str, q, w, keys, visible, want: torch.Tensor, dev, both_dots: bool = False,
                 grid: dict | None = None) -> None:
    """The scores pass alone for each launch config; ``ok`` = its scores equal the default's to 1e-5
    (FP8 keys: the default dot, ``fp8_dot``; ``--sweep-both-dots``: also the other one, whose configs
    report their error instead)."""
    fp8 = keys.dim() == 4
    dots = ((1, 0) if both_dots else (1,)) if fp8 and ix.fp8_dot_serves(q) else (None,)
    default_dot = dots[0]
    grid = {k: v for k, v in (grid or {}).items() if v}  # --sweep-* lists replace these
    chunks = grid.get("chunks", (512, 1024, 2048, 4096, 8192) if fp8 else (1024, 2048, 4096, 8192))
    for dot in dots:
        for chunk in chunks:
            for stages in grid.get("stages", (2, 3, 4, 5) if fp8 else (2, 3, 4)):
                for warps in grid.get("warps", (4, 8)):
                    for block_n in grid.get("block_n", (64, 128)):
                        cfg = dict(CHUNK=chunk, num_stages=stages, num_warps=warps, BLOCK_N=block_n)
                        if dot is not None:
                            cfg["FP8_DOT"] = dot
                        try:
                            got, launch = ix.scores_launch(q, w, keys, visible, config=cfg)

                            def run(launch=launch):
                                ix.indexer_scores_kernel[launch.grid](*launch.args, **launch.meta)
                            run()
                            ok = (bool(torch.allclose(got, want, rtol=1e-5, atol=1e-5)) if dot == default_dot
                                  else f"err={relative_error(got, want):.1e}")
                            us = f"{kernel_time([run], dev).us:.1f}"
                        except Exception as e:  # e.g. out of shared memory: say so, go on
                            ok, us = False, f"failed ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
                        print(f"{tag} what=scores_sweep fp8_dot={dot} chunk={chunk} stages={stages} warps={warps} "
                              f"block_n={block_n} grid={programs(want, chunk)} us={us} ok={ok}", flush=True)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over the visible scores, relative to the largest |want| (-inf where invisible)."""
    live = torch.isfinite(want)
    if not torch.equal(torch.isfinite(got), live):
        return float("inf")
    return float((got[live] - want[live]).abs().max() / want[live].abs().max().clamp(min=1e-30))


def fp8_dot_cost(tag: str, q, w, keys, visible, k: int, scores: torch.Tensor, dev) -> None:
    """FP8 keys: the scores pass with the decoded bf16 dot instead of the e4m3 tensor-core dot, the
    FP8 dot's error against it (same quantised queries, exact products: only the accumulation
    differs) and how many of the op's picks the bf16 dot's scores pick too."""
    exact, launch = ix.scores_launch(q, w, keys, visible, config=dict(FP8_DOT=0))

    def run():
        ix.indexer_scores_kernel[launch.grid](*launch.args, **launch.meta)
    run()
    print(f"{tag} what=scores_bf16_dot us={kernel_time([run], dev).us:.1f}", flush=True)
    print(f"{tag} what=fp8_dot_error {relative_error(scores, exact):.2e}", flush=True)
    picks = torch.ops.dsv4.indexer_topk(q, w, keys, visible, k)
    exact_picks = ref_topk(exact, k)
    shared = [len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(picks.flatten(0, 1), exact_picks.flatten(0, 1))]
    print(f"{tag} what=fp8_dot_shared_picks mean={sum(shared) / len(shared):.4f} min={min(shared):.4f}", flush=True)


def ref_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` best scores of each row (stable: ties to the lower index)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def programs(scores: torch.Tensor, chunk: int) -> int:
    """The scores pass's grid size for ``chunk``-entry chunks of ``scores [B, S, N]``."""
    return scores.shape[0] * scores.shape[1] * -(-scores.shape[2] // chunk)


def select_passes(scores: torch.Tensor, visible: torch.Tensor, k: int, out: torch.Tensor) -> dict:
    """{passes: rows}: how many select passes the CUDA top-k took on each row (what it reports when cut
    short after the select; + 256 where the row's candidates stayed in registers, off the shared list)."""
    topk_rows.topk_rows(scores, visible, k, out=out, stop_after=2)
    return dict(sorted(collections.Counter(out[:, :, 0].flatten().tolist()).items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768])
    ap.add_argument("--caches", nargs="+", default=["bf16", "fp8"])
    ap.add_argument("--sweep", action="store_true",
                    help="also the scores pass alone by CHUNK x num_stages x num_warps x BLOCK_N (each checked "
                         "against the default config's scores)")
    ap.add_argument("--sweep-both-dots", action="store_true",
                    help="FP8 keys: sweep the decoded bf16 dot's configs too")
    for name in ("chunks", "stages", "warps", "block-n"):
        ap.add_argument(f"--sweep-{name}", type=int, nargs="+", help=f"the sweep's {name} (default: its own list)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    dims = cases.FLASH
    for B in args.batches:
        for ctx in args.contexts:
            for cache in args.caches:
                case = cases.indexer_topk_case(dims, B, ctx, "flash", cache)
                q, w, keys, visible, k = case.make(dev)
                tag = f"indexer B={B} ctx={ctx} cache={cache}"

                def line(what: str, fn) -> None:
                    fn()
                    print(f"{tag} what={what} us={kernel_time([fn], dev).us:.1f}", flush=True)

                line("op", lambda: torch.ops.dsv4.indexer_topk(q, w, keys, visible, k))
                scores, scoring = ix.scores_launch(q, w, keys, visible)

                def scores_only():
                    ix.indexer_scores_kernel[scoring.grid](*scoring.args, **scoring.meta)
                line("scores", scores_only)
                if keys.dim() == 4 and ix.fp8_dot_serves(q):
                    fp8_dot_cost(tag, q, w, keys, visible, k, scores, dev)
                if args.sweep:
                    sweep_scores(tag, q, w, keys, visible, scores, dev, args.sweep_both_dots,
                                 dict(chunks=args.sweep_chunks, stages=args.sweep_stages, warps=args.sweep_warps,
                                      block_n=args.sweep_block_n))
                if topk_rows.library() is None:  # no nvcc / not NVIDIA: the op took the Triton top-k
                    print(f"{tag} what=topk unavailable ({topk_rows.unavailable_reason()})", flush=True)
                    continue
                out = torch.empty((*scores.shape[:2], k), dtype=torch.int32, device=dev)
                line("topk", lambda: topk_rows.topk_rows(scores, visible, k, out=out))
                want = torch.ops.dsv4.indexer_topk(q, w, keys, visible, k)
                print(f"{tag} what=topk_equals_op {bool(torch.equal(out, want))}", flush=True)
                line("scores_then_cuda_topk", lambda: (scores_only(), topk_rows.topk_rows(scores, visible, k, out=out)))
                listed = scores.shape[-1] > 16 * 512  # the CUDA top-k's shared candidate list
                for stop, stage in ((1, "load"),) + (((4, "+list"),) if listed else ()) + ((2, "+select"),
                                                                                        (3, "+compaction")):
                    line(f"topk_upto_{stage}", lambda stop=stop: topk_rows.topk_rows(scores, visible, k, out=out,
                                                                                       stop_after=stop))
                print(f"{tag} what=select_passes {select_passes(scores, visible, k, out)}", flush=True)
                gauss = torch.randn_like(scores)
                line("topk_gaussian_rows", lambda: topk_rows.topk_rows(gauss, visible, k, out=out))
                print(f"{tag} what=select_passes_gaussian {select_passes(gauss, visible, k, out)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
