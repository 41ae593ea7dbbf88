"""``dsv4::topk_rows_cuda``: the CUDA top-k of the indexer's score rows, as an opaque op.

``dsv4::indexer_topk`` routes its top-k here, while it is traced or run, when :func:`applies`:
an NVIDIA GPU whose top-k library builds (``lowering/cuda/topk_rows.py``: nvcc on first use),
rows of at most 32768 scores (128K tokens of context at ratio 4), ``topk`` at most 2048, and the
query tokens scored in one group (every decode step; a prefill chunk whose scores fit
``SCORES_BUDGET_BYTES``; :func:`serves`). Everything else -- ROCm, no nvcc, longer rows -- keeps the
Triton top-k, which has the same contract (descending score, ties to the lower index, -1 past the
picks).

Why an opaque op: the kernel is CUDA C++ loaded by ctypes, not Triton, so Inductor cannot
inline it; a compiled graph calls it as an extern op and CUDA graphs replay its launch.
AOTInductor's C++ runtime cannot call a Python op, so ``dsv4_ops.export`` traces under
:func:`disabled` (packages keep the Triton top-k). ``DSV4_OPS_CUDA_TOPK=0`` (read at import)
turns the route off.
"""
from __future__ import annotations

import functools
import os
import sys

import torch
from torch import Tensor

from ._backend import route_off

ENV = "DSV4_OPS_CUDA_TOPK"
_enabled = os.environ.get(ENV, "1").strip() != "0"
# eager / tracing invocations (a CUDA-graph replay runs no Python)
stats = {"launches": 0}


@functools.cache
def _limits(index: int) -> tuple[int, int]:
    """(max entries, max topk) of the library on device ``index``; (0, 0) if it cannot be built."""
    from ..lowering.cuda import topk_rows

    return topk_rows.max_entries(index), topk_rows.max_topk(index)


def serves(rows: int, N: int, topk: int, max_n: int, max_k: int) -> bool:
    """The rule (pure, tested on CPU): ``rows`` rows of ``N`` scores go to the CUDA top-k when it
    serves their size (``max_n``, ``max_k``: the library's limits, 0 when it did not build).
    Until session 16 a few rows of more than 16384 scores kept the Triton split top-k, which spreads
    them over the GPU (1 x 32768 scores: the whole op 28.7 us). Since session 17's list kernel the
    CUDA top-k takes one such row in 14.4 us, and the op 20.4 us (H200; at 8 and 16 rows too:
    BENCHMARKS.md, session 17)."""
    return rows > 0 and 1 <= N <= max_n and 1 <= topk <= max_k


def applies(scores_shape: tuple, device: torch.device, topk: int) -> bool:
    """Static: a function of the device and the scores' shape ``[B, S, N]``, never of values."""
    if not (_enabled and device.type == "cuda" and torch.version.hip is None and torch.cuda.is_available()):
        return False  # (fake CUDA tensors on a machine without a GPU: the Triton path, as everywhere)
    B, S, N = scores_shape
    max_n, max_k = _limits(device.index if device.index is not None else torch.cuda.current_device())
    return serves(B * S, N, topk, max_n, max_k)


def disabled():
    """Trace with the Triton top-k only (AOTInductor packages): ``_backend.route_off``."""
    return route_off(sys.modules[__name__])


@torch.library.custom_op("dsv4::topk_rows_cuda", mutates_args=(), device_types="cuda")
def topk_rows_cuda(scores: Tensor, visible: Tensor, topk: int) -> Tensor:
    """``[B, S, topk] int32``: per row of ``scores [B, S, N]`` the ``min(topk, visible)`` best
    of its first ``visible`` entries, descending score then ascending index, then -1."""
    from ..lowering.cuda.topk_rows import topk_rows

    stats["launches"] += 1
    return topk_rows(scores, visible, topk)


@topk_rows_cuda.register_fake
def _(scores, visible, topk):
    return scores.new_empty((*scores.shape[:2], topk), dtype=torch.int32)
