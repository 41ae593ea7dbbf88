"""How fast can an H200 read the rows a decode attention call reads? (the achievable gather floor)

    PYTHONPATH=$PWD python3 benchmarks/gather_bandwidth.py [--batches 64 128]

The attention's bytes floor divides its bytes by 4.3 TB/s, a streaming rate. Its rows are random
1 KB rows (the CSA top-k picks of an 8192-entry pool, the window's ring rows). This times a Triton
kernel that only reads those rows -- the same entry sets as ``gluon_attention_check.py``'s ``csa``
case, every valid row of window + picks once, summed to one float a program so that almost nothing
is written -- with CUDA graphs on L2-cold input copies, and the same kernel on contiguous rows of
the same count. One line a case: ``gather MODE B=.. rows=.. us=.. TB/s=.. of_4.3=..``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gluon_attention_check import D, K, W, copies_for, log, make_inputs, timed  # noqa: E402

HBM = 4.3e12


@triton.jit
def gather_sum_kernel(kv_ptr, kv_idx_ptr, cmp_ptr, cmp_idx_ptr, out_ptr, N_KV, N_CMP, skv_b, sc_b,
                      W: tl.constexpr, K: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                      CONTIGUOUS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    v = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    in_w = v < W
    if CONTIGUOUS:  # the same count of rows, consecutive
        idx = tl.where(in_w, v, v - W)
    else:
        wi = tl.load(kv_idx_ptr + b * W + v, mask=in_w, other=-1)
        ci = tl.load(cmp_idx_ptr + b * K + (v - W), mask=(~in_w) & (v < W + K), other=-1)
        idx = tl.where(in_w, wi, ci)
    valid = (v < W + K) & (idx >= 0) & (idx < tl.where(in_w, N_KV, N_CMP))
    idx64 = tl.where(valid, idx, 0).to(tl.int64)
    row = tl.where(in_w, kv_ptr + b * skv_b + idx64 * D, cmp_ptr + b * sc_b + idx64 * D)
    x = tl.load(row[:, None] + tl.arange(0, D)[None, :], mask=valid[:, None], other=0.0)
    tl.store(out_ptr + b * tl.num_programs(1) + blk, tl.sum(tl.sum(x.to(tl.float32), 1), 0))


def gather(kv, kv_idx, cmp, cmp_idx, block_n: int, contiguous: bool, num_warps: int):
    B = kv.shape[0]
    n_blk = triton.cdiv(W + K, block_n)
    out = torch.empty(B, n_blk, device=kv.device, dtype=torch.float32)
    gather_sum_kernel[(B, n_blk)](kv, kv_idx, cmp, cmp_idx, out, kv.shape[1], cmp.shape[1], kv.stride(0),
                                  cmp.stride(0), W=W, K=K, D=D, BLOCK_N=block_n, CONTIGUOUS=contiguous,
                                  num_warps=num_warps)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 128])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        log("no CUDA device")
        return 2
    dev = torch.device("cuda")
    for B in args.batches:
        first = make_inputs(B, "csa", seed=B, dev=dev)
        _, kv, kv_idx, cmp, cmp_idx, _, _ = first
        valid_w = ((kv_idx >= 0) & (kv_idx < kv.shape[1])).sum()
        valid_k = ((cmp_idx >= 0) & (cmp_idx < cmp.shape[1])).sum()
        rows = int(valid_w + valid_k)
        copies = copies_for(B, "csa", first)
        # the check: the kernel reads exactly the valid rows (fp32 sums against torch's)
        want = sum(float(kv[b, kv_idx[b, 0][(kv_idx[b, 0] >= 0) & (kv_idx[b, 0] < kv.shape[1])].long()].float().sum())
                   + float(cmp[b, cmp_idx[b, 0][(cmp_idx[b, 0] >= 0) & (cmp_idx[b, 0] < cmp.shape[1])].long()]
                           .float().sum()) for b in range(B))
        got = float(gather(kv, kv_idx, cmp, cmp_idx, 64, False, 8).sum())
        log(f"check B={B}: sum {got:.6g} want {want:.6g}")
        for contiguous in (False, True):
            for block_n, warps in ((32, 4), (64, 8), (128, 8)):
                us = timed(lambda q, kv, kv_idx, cmp, cmp_idx, cl, s: gather(kv, kv_idx, cmp, cmp_idx, block_n,
                                                                            contiguous, warps), copies)
                n = B * (W + K) if contiguous else rows  # contiguous: every entry is a valid row
                rate = n * D * 2 / (us * 1e-6)
                log(f"gather {'contiguous' if contiguous else 'random'} B={B} BLOCK_N={block_n} warps={warps} "
                    f"rows={n} us={us:.1f} TB/s={rate / 1e12:.2f} of_4.3={rate / HBM:.0%}")
        del copies
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
