"""``dsv4::sparse_attention_sm90``: the Gluon decode attention for Hopper, as an opaque op.

``dsv4::sparse_attention`` routes here, while it is traced or run, when :func:`applies`: bf16
decode (one query token) at V4's attention widths (64 heads of 512 dims, float caches) on an
sm_90 GPU. Everything else -- FP8 caches, prefill, other widths, ROCm, other GPUs -- keeps the
Triton kernel. The Gluon kernel (``lowering/gluon/sparse_attention.py``) has each warpgroup score
its own half of a row block, which ``tl`` cannot express (BENCHMARKS.md, session 12).

Why a second op: torch's ``wrap_triton`` re-parses a kernel as plain Triton, so a Gluon kernel
cannot be inlined by Inductor; it runs as an extern call inside a compiled graph, which CUDA
graphs replay like any launch. AOTInductor cannot call a Python op from its C++ runtime, so
``dsv4_ops.export`` traces under :func:`disabled`: packages keep the Triton kernel.

``DSV4_OPS_GLUON_ATTENTION=0`` (read at import) turns the route off. A compiled graph keeps the
route it was traced with, and so may torch's on-disk compile cache (its key is the graph before
the route is taken): use a fresh ``TORCHINDUCTOR_CACHE_DIR`` when comparing the two settings.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch
from torch import Tensor

ENV = "DSV4_OPS_GLUON_ATTENTION"
_enabled = os.environ.get(ENV, "1").strip() != "0"
# eager / tracing invocations of the kernel launcher (a CUDA-graph replay runs no Python)
stats = {"launches": 0}


@functools.cache
def gluon_available() -> bool:
    try:
        from ..lowering.gluon import sparse_attention  # noqa: F401
    except ImportError:  # a Triton without Gluon (< 3.4)
        return False
    return True


@functools.cache
def _is_sm90(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index) == (9, 0)


def applies(q: Tensor, kv: Tensor, kv_idx: Tensor, cmp: Tensor, cmp_idx: Tensor, cmp_len: Tensor) -> bool:
    """Static: the route is a function of devices, dtypes and shapes, never of values."""
    if not (_enabled and q.device.type == "cuda" and gluon_available()):
        return False
    B, S, H, D = q.shape
    return (S == 1 and H == 64 and D == 512 and kv.dim() == 3 and cmp.dim() == 3
            and q.dtype == kv.dtype == cmp.dtype == torch.bfloat16
            and kv_idx.dtype == cmp_idx.dtype == cmp_len.dtype == torch.int32
            and kv.shape[1] + cmp.shape[1] > 0 and B > 0
            and _is_sm90(q.device.index if q.device.index is not None else torch.cuda.current_device()))


@contextlib.contextmanager
def disabled():
    """Trace with the Triton kernel only (AOTInductor packages). The AOTAutograd cache is off
    meanwhile: its key holds the traced graph before the route is taken."""
    global _enabled
    saved = _enabled
    _enabled = False
    try:
        with torch._functorch.config.patch(enable_autograd_cache=False):
            yield
    finally:
        _enabled = saved


@torch.library.custom_op("dsv4::sparse_attention_sm90", mutates_args=(), device_types="cuda")
def sparse_attention_sm90(
    q: Tensor, kv: Tensor, kv_idx: Tensor, cmp: Tensor, cmp_idx: Tensor, cmp_len: Tensor, sink: Tensor, scale: float,
) -> Tensor:
    from ..lowering.gluon.sparse_attention import sparse_attention_gluon

    stats["launches"] += 1
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return sparse_attention_gluon(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale, out=out)


@sparse_attention_sm90.register_fake
def _(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)
