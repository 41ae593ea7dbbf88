"""The hot decode kernels, each launched a fixed number of times, for Nsight Compute.

    ncu --clock-control none -k regex:'sparse_attention_kernel|combine_kernel|indexer_scores_kernel|topk_row_kernel' \
        --launch-skip 4 --launch-count 4 --set full -o out/kernels python3 tools/ncu_kernels.py

Runs the per-kernel benchmark's V4-Flash inputs (``benchmarks/kernel_bench/cases.py``) at batch 64 and
context 32K: sparse attention (CSA: window 128 + top-k 512 entries; two launches, the
attention kernel and the split-KV combine) and the indexer (scores, then top-k). ``--rounds``
repeats the whole set: the first round compiles the kernels, so skip its 4 launches.
``tools/gpu_check.sh ncu`` runs this under ncu and writes the reports to ``$OUT``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.kernel_bench import cases as C  # noqa: E402
from dsv4_ops.lowering.triton import indexer as ix  # noqa: E402
from dsv4_ops.lowering.triton import sparse_attention as sa  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("ncu_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    torch.manual_seed(0)
    attn = C.sparse_attention_case(C.FLASH, "csa", args.batch, args.ctx, "flash").make(dev)
    index = C.indexer_topk_case(C.FLASH, args.batch, args.ctx, "flash").make(dev)
    for _ in range(args.rounds):
        sa.sparse_attention(*attn)
        ix.indexer_topk(*index)
    torch.cuda.synchronize()
    print("ncu_kernels: done", sa.attention_config(args.batch, 1, C.FLASH.heads, C.FLASH.head_dim,
                                                   C.FLASH.window + C.FLASH.topk))
    return 0


if __name__ == "__main__":
    sys.exit(main())
