"""``dsv4::sparse_attention_sm90``: the Gluon decode attention for Hopper, as an opaque op.

``dsv4::sparse_attention`` routes here, while it is traced or run, when :func:`applies`: bf16
decode (one query token) at V4's attention widths (64 heads of 512 dims) on an sm_90 GPU, over
float caches (``lowering/gluon/sparse_attention.py``) or FP8 pages in FlashMLA's layout
(``lowering/gluon/sparse_attention_fp8.py``): FP8 window pages from batch ``FP8_MIN_BATCH`` on, a
bf16 window ring over an FP8 pool from ``FP8_FLOAT_WINDOW_MIN_BATCH`` on, where the reader measured
faster than the Triton FP8 kernel (BENCHMARKS.md). Everything else -- prefill, other
widths, ROCm, other GPUs -- keeps the Triton kernel. The Gluon kernels warp-specialise the row
gathers and split the scores and ``P @ rows`` between warpgroups in ways ``tl`` cannot express.

Why a second op: torch's ``wrap_triton`` re-parses a kernel as plain Triton, so a Gluon kernel
cannot be inlined by Inductor; it runs as an extern call inside a compiled graph, which CUDA
graphs replay like any launch. AOTInductor cannot call a Python op from its C++ runtime, so the
route steps aside while torch exports (``torch.compiler.is_exporting()``, true through
``torch.export`` and AOTInductor's compile): packages keep the Triton kernel.

``DSV4_OPS_GLUON_ATTENTION=0`` (read at import) turns the route off. A compiled graph keeps the
route it was traced with, and so may torch's on-disk compile cache (its key is the graph before
the route is taken): use a fresh ``TORCHINDUCTOR_CACHE_DIR`` when comparing the two settings.
"""
from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from ..lowering.triton.launch import capability, device_index
from ..reference import ops as ref

ENV = "DSV4_OPS_GLUON_ATTENTION"
_enabled = os.environ.get(ENV, "1").strip() != "0"
# FP8 caches take the Gluon reader from these batches on, below which the Triton FP8 kernel measured as fast
FP8_MIN_BATCH = 1
FP8_FLOAT_WINDOW_MIN_BATCH = 64
# eager / tracing invocations of the kernel launcher (a CUDA-graph replay runs no Python)
stats = {"launches": 0}


@functools.cache
def gluon_available() -> bool:
    try:
        from ..lowering.gluon import sparse_attention  # noqa: F401
    except ImportError:  # a Triton without Gluon (< 3.4)
        return False
    return True


def _fp8_caches(kv: Tensor, cmp: Tensor) -> bool:
    return kv.dtype == torch.uint8 or cmp.dtype == torch.uint8


def applies(q: Tensor, kv: Tensor, kv_idx: Tensor, cmp: Tensor, cmp_idx: Tensor, cmp_len: Tensor,
            block_table: Tensor | None = None) -> bool:
    """Static: the route is a function of devices, dtypes, shapes and strides, never of values.

    A paged pool (``block_table``) is read as the pages seen as one row that every query shares, its
    entries translated to physical ones first (:func:`paged_entries`): the kernels gather from one base
    pointer, and a page lookup in front of every row copy would be one more dependent load there."""
    if not (_enabled and q.device.type == "cuda" and not torch.compiler.is_exporting() and gluon_available()):
        return False
    if block_table is not None:
        one_row = cmp.dtype == torch.uint8 or cmp.stride(0) == cmp.shape[1] * cmp.stride(1)  # FP8: its reader checks
        if cmp.shape[0] * cmp.shape[1] == 0 or not one_row:
            return False
        cmp = shared_rows(cmp, q.shape[0])
    B, S, H, D = q.shape
    if not (S == 1 and H == 64 and D == 512 and q.dtype == torch.bfloat16 and B > 0
            and kv_idx.dtype == cmp_idx.dtype == cmp_len.dtype == torch.int32
            and torch.version.hip is None and capability(device_index(q.device)) == (9, 0)):
        return False
    if _fp8_caches(kv, cmp):  # FP8 pages (FlashMLA's MODEL1 layout), the window FP8 or bf16
        from ..lowering.gluon.sparse_attention_fp8 import serves
        min_batch = FP8_MIN_BATCH if kv.dtype == torch.uint8 else FP8_FLOAT_WINDOW_MIN_BATCH
        return B >= min_batch and serves(q, kv, kv_idx, cmp, cmp_idx, cmp_len)
    return (kv.dim() == 3 and cmp.dim() == 3 and kv.dtype == cmp.dtype == torch.bfloat16
            and kv.shape[1] + cmp.shape[1] > 0)


def shared_rows(pages: Tensor, B: int) -> Tensor:
    """A paged pool's pages ``[num_pages, page, ...]`` as the per-row cache layout the kernels take, one row that
    all ``B`` queries share (stride 0): float ``[B, num_pages * page, D]``, FP8 ``[B, num_pages, page, bytes]``."""
    rows = pages.unsqueeze(0) if pages.dtype == torch.uint8 else pages.flatten(0, 1).unsqueeze(0)
    return rows.expand(B, *rows.shape[1:])


def paged_entries(pages: Tensor, cmp_idx: Tensor, cmp_len: Tensor, block_table: Tensor) -> tuple[Tensor, Tensor]:
    """``(entries [B, S, K + P * page] int32, cmp_len clamped to [0, P * page])``: the K picks, then the dense prefix
    listed (the kernels read it through the list, to ``cmp_len``), as physical entries of the pages seen as one row
    (-1: skipped). Elementwise ops that the compiled step fuses."""
    B, S, _ = cmp_idx.shape
    n = block_table.shape[1] * pages.shape[1]
    clen = cmp_len.clamp(0, n)
    rows = torch.arange(n, dtype=torch.int32, device=cmp_idx.device).expand(B, S, n)
    logical = torch.cat([cmp_idx, torch.where(rows < clen[..., None], rows, -1)], dim=-1)
    return ref.physical_entries(logical, block_table, pages).to(torch.int32), clen


@torch.library.custom_op("dsv4::sparse_attention_sm90", mutates_args=(), device_types="cuda")
def sparse_attention_sm90(
    q: Tensor, kv: Tensor, kv_idx: Tensor, cmp: Tensor, cmp_idx: Tensor, cmp_len: Tensor, sink: Tensor, scale: float,
    picks: int = -1,
) -> Tensor:
    """``picks`` -1: ``cmp`` holds the rows of the ``B`` queries and ``cmp_idx`` lists picks; else ``cmp`` is a
    paged pool's pages and ``cmp_idx`` lists ``picks`` picks, then the dense prefix (:func:`paged_entries`)."""
    stats["launches"] += 1
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    kw = dict(out=out)
    if picks >= 0:  # the view is taken here, not in the graph, where a compiler could materialise it
        cmp, kw["picks"] = shared_rows(cmp, q.shape[0]), picks
    if _fp8_caches(kv, cmp):
        from ..lowering.gluon.sparse_attention_fp8 import sparse_attention_gluon_fp8
        return sparse_attention_gluon_fp8(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale, **kw)
    from ..lowering.gluon.sparse_attention import sparse_attention_gluon
    return sparse_attention_gluon(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale, **kw)


@sparse_attention_sm90.register_fake
def _(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale, picks=-1):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)
