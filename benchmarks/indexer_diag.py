"""Where the public ``indexer_topk``'s time goes at the bench cases: the whole op, its scores pass
alone, the CUDA top-k alone on those scores (and on Gaussian rows of the same shape), the top-k's
stages, and how many select passes its rows took.

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


def sweep_scores(tag: str, q, w, keys, visible, want: torch.Tensor, dev) -> None:
    """The scores pass alone for each launch config; ``ok`` = its scores equal the default's to 1e-5."""
    for chunk in (1024, 2048, 4096, 8192):
        for stages in (2, 3, 4):
            for warps in (4, 8):
                for block_n in (64, 128):
                    cfg = dict(CHUNK=chunk, num_stages=stages, num_warps=warps, BLOCK_N=block_n)
                    try:
                        got, launch = ix.scores_launch(q, w, keys, visible, config=cfg)

                        def run(launch=launch):
                            ix.indexer_scores_kernel[launch.grid](*launch.args, **launch.meta)
                        run()
                        ok = bool(torch.allclose(got, want, rtol=1e-5, atol=1e-5))
                        us = f"{kernel_time([run], dev).us:.1f}"
                    except Exception as e:  # e.g. out of shared memory: say so, go on
                        ok, us = False, f"failed ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
                    print(f"{tag} what=scores_sweep chunk={chunk} stages={stages} warps={warps} block_n={block_n} "
                          f"grid={programs(want, chunk)} us={us} ok={ok}", flush=True)


def programs(scores: torch.Tensor, chunk: int) -> int:
    """The scores pass's grid size for ``chunk``-entry chunks of ``scores [B, S, N]``."""
    return scores.shape[0] * scores.shape[1] * -(-scores.shape[2] // chunk)


def select_passes(scores: torch.Tensor, visible: torch.Tensor, k: int, out: torch.Tensor) -> dict:
    """{passes: rows}: how many select passes the CUDA top-k took on each row (what it reports when cut
    short after the select)."""
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
                if args.sweep:
                    sweep_scores(tag, q, w, keys, visible, scores, dev)
                if topk_rows.library() is None:  # no nvcc / not NVIDIA: the op took the Triton top-k
                    print(f"{tag} what=topk unavailable ({topk_rows.unavailable_reason()})", flush=True)
                    continue
                out = torch.empty((*scores.shape[:2], k), dtype=torch.int32, device=dev)
                line("topk", lambda: topk_rows.topk_rows(scores, visible, k, out=out))
                want = torch.ops.dsv4.indexer_topk(q, w, keys, visible, k)
                print(f"{tag} what=topk_equals_op {bool(torch.equal(out, want))}", flush=True)
                for stop, stage in ((1, "load"), (2, "+select"), (3, "+compaction")):
                    line(f"topk_upto_{stage}", lambda stop=stop: topk_rows.topk_rows(scores, visible, k, out=out,
                                                                                       stop_after=stop))
                print(f"{tag} what=select_passes {select_passes(scores, visible, k, out)}", flush=True)
                gauss = torch.randn_like(scores)
                line("topk_gaussian_rows", lambda: topk_rows.topk_rows(gauss, visible, k, out=out))
                print(f"{tag} what=select_passes_gaussian {select_passes(gauss, visible, k, out)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
