"""Where the top-k row kernel's time goes: its stages timed by cutting the kernel short.

    PYTHONPATH=$PWD python3 benchmarks/topk_diag.py [--rows 1 64] [--n 8192]

A copy of ``topk_row_kernel``'s STAGE-0 path (whole row in registers, the library's own helpers)
that stops after ``UPTO`` stages: 0 = load the row (and store one value), 1 = + the radix
select, 2 = + the compaction's stores, 3 = + ordering the picks (the whole kernel). The
differences between lines are what each stage costs; line 3 is checked against
``torch.topk``'s index set. One line a case: ``topk rows=.. n=.. bits=.. warps=.. upto=.. us=..``;
then the CUDA top-k (``csrc/kernels/topk_rows.cu``) on the same rows: ``topk cuda rows=.. us=..``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.timing import kernel_time  # noqa: E402
from lowering.cuda import topk_rows  # noqa: E402
from lowering.triton.indexer import _order_picks, _ordered_key, _picked, _radix_select  # noqa: E402


@triton.jit
def topk_upto_kernel(scores_ptr, out_ptr, N, TOPK, ROW: tl.constexpr, KPAD: tl.constexpr, BITS: tl.constexpr,
                     UPTO: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    row = scores_ptr + r * N
    out_row = out_ptr + r * TOPK
    offs = tl.arange(0, ROW)
    live = offs < N
    x = tl.load(row + offs, mask=live, other=0.0)
    key = _ordered_key(x)
    k_eff = tl.minimum(N, TOPK)
    if UPTO == 0:
        tl.store(out_row, tl.max(key, 0).to(tl.int32))
    else:
        prefix, known, k_rem, done = _radix_select(key, live, k_eff, BITS)
        if UPTO == 1:
            tl.store(out_row, (prefix + k_rem.to(tl.uint32)).to(tl.int32))
        else:
            sel = _picked(key, live, prefix, known, k_rem, done)
            slot = tl.cumsum(sel, 0) - sel
            tl.store(out_row + slot, offs, mask=sel != 0)
            if UPTO == 3:
                tl.debug_barrier()
                _order_picks(row, 1, out_row, 1, k_eff, TOPK, KPAD, row, False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--n", type=int, nargs="+", default=[8192])
    ap.add_argument("--topk", type=int, default=512)
    ap.add_argument("--bits", type=int, nargs="+", default=[5])
    ap.add_argument("--warps", type=int, nargs="+", default=[16])
    args = ap.parse_args()
    dev = torch.device("cuda")
    for rows in args.rows:
        for n in args.n:
            x = torch.randn(rows, n, device=dev)
            want = torch.topk(x, args.topk, dim=1).indices.sort(1).values
            for bits in args.bits:
                for warps in args.warps:
                    for upto in range(4):
                        out = torch.full((rows, args.topk), -1, dtype=torch.int32, device=dev)
                        meta = dict(ROW=triton.next_power_of_2(n), KPAD=triton.next_power_of_2(args.topk),
                                    BITS=bits, UPTO=upto, num_warps=warps)

                        def call(out=out, meta=meta):
                            topk_upto_kernel[(rows,)](x, out, n, args.topk, **meta)
                        call()
                        ok = ""
                        if upto >= 2:
                            ok = " picks_ok=" + str(bool((out.sort(1).values.long() == want).all()))
                        us = kernel_time([call], dev).us
                        print(f"topk rows={rows} n={n} bits={bits} warps={warps} upto={upto} us={us:.1f}{ok}",
                              flush=True)
            # the CUDA kernel (csrc/kernels/topk_rows.cu) on the same rows, same check
            if topk_rows.library() is None:
                print(f"topk cuda: unavailable ({topk_rows.unavailable_reason()})", flush=True)
                continue
            vis = torch.full((rows, 1), n, dtype=torch.int32, device=dev)
            out = torch.empty((rows, 1, args.topk), dtype=torch.int32, device=dev)

            def call_cuda(out=out, vis=vis):
                topk_rows.topk_rows(x[:, None], vis, args.topk, out=out)
            call_cuda()
            ok = bool((out[:, 0].sort(1).values.long() == want).all())
            order_ok = bool((x.gather(1, out[:, 0].long()).diff(dim=1) <= 0).all())
            us = kernel_time([call_cuda], dev).us
            print(f"topk cuda rows={rows} n={n} us={us:.1f} picks_ok={ok} descending={order_ok}", flush=True)
            listed = n > 16 * 512  # rows of more than 16 scores a thread put their candidates in a shared list
            stages = ((1, "load"),) + (((4, "+list"),) if listed else ()) + ((2, "+select"), (3, "+compaction"))
            variants = {"": 0, "off_list": topk_rows.DIAG_NO_LIST, "plain_loads": topk_rows.DIAG_NO_BULK}
            for name, flags in variants.items() if listed else (("", 0),):
                tag = f" {name}" if name else ""
                for stop, stage in stages + (((0, "whole"),) if flags else ()):
                    def call_stop(out=out, vis=vis, stop=stop + flags):
                        topk_rows.topk_rows(x[:, None], vis, args.topk, out=out, stop_after=stop)
                    us = kernel_time([call_stop], dev).us
                    print(f"topk cuda rows={rows} n={n}{tag} upto={stage} us={us:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
