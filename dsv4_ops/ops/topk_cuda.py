"""``dsv4::topk_rows_cuda``: the CUDA top-k of the indexer's score rows, a C++ op.

The op -- schema, argument checks and CUDA kernel -- lives in the package's native library
(``csrc/kernels/topk_rows_op.cpp`` around ``csrc/kernels/topk_rows.cu``, built by setup.py and
loaded at import by ``dsv4_ops/native.py``); this module registers its fake kernel and decides
where it is used. ``dsv4::indexer_topk`` routes its top-k here, while it is traced or run, when
:func:`applies`: an NVIDIA GPU (sm_70 or newer) in a process that loaded the native library, rows
of at most ``MAX_ENTRIES`` scores (128K tokens of context at ratio 4), ``topk`` at most
``MAX_TOPK``, and the query tokens scored in one group (every decode step; a prefill chunk whose
scores fit ``SCORES_BUDGET_BYTES``; :func:`serves`). Everything else -- ROCm, no native library,
longer rows -- keeps the Triton top-k, which has the same contract (descending score, ties to the
lower index, -1 past the picks); :func:`unavailable_reason` says why the route is off.

How the kernel works, and why it is CUDA (``tl.histogram`` has no shared-memory atomics): the
header of ``csrc/kernels/topk_rows.cu``.

Because the op is C++, Inductor calls it as an extern kernel in compiled graphs (CUDA graphs
replay its launch) and AOTInductor packages call it through their proxy executor: a process
that runs such a package must have loaded the native library first (``AOTIGenerator``: by
importing dsv4_ops; ``build/dsv4_run``: ``--library``). ``DSV4_OPS_CUDA_TOPK=0`` (read at
import) turns the route off, as does :func:`disabled` while tracing.
"""
from __future__ import annotations

import os

import torch

from .. import native
from ..lowering.triton.launch import capability, device_index

ENV = "DSV4_OPS_CUDA_TOPK"
_enabled = os.environ.get(ENV, "1").strip() != "0"
# What one launch serves; mirrors kTopkRowsMaxEntries / kTopkRowsMaxTopk in csrc/kernels/topk_rows.h
# (tests/ops/indexer_topk/test_topk_rows_cuda_build.py checks that they agree), as do the op's own checks.
MAX_ENTRIES = 32768
MAX_TOPK = 2048
MIN_CAPABILITY = (7, 0)  # warp shuffles with masks, independent thread scheduling


def available() -> bool:
    """The native library loaded, so ``torch.ops.dsv4.topk_rows_cuda`` exists."""
    return native.library_path() is not None


def unavailable_reason() -> str | None:
    """Why :func:`applies` is False for every input in this process, or None when it may be True."""
    if not available():
        return native.unavailable_reason()
    if not _enabled:
        return f"turned off ({ENV}=0)"
    return None


def serves(rows: int, N: int, topk: int, max_n: int = MAX_ENTRIES, max_k: int = MAX_TOPK) -> bool:
    """The rule (pure, tested on CPU): ``rows`` rows of ``N`` scores go to the CUDA top-k when it
    serves their size: one row or many, short rows or up to ``max_n`` scores (the kernel takes a
    long row alone as fast as the Triton split top-k spreads it over the GPU)."""
    return rows > 0 and 1 <= N <= max_n and 1 <= topk <= max_k


def applies(scores_shape: tuple, device: torch.device, topk: int) -> bool:
    """Static: a function of the device and the scores' shape ``[B, S, N]``, never of values."""
    if not (_enabled and available() and device.type == "cuda" and torch.version.hip is None
            and torch.cuda.is_available()):
        return False  # (fake CUDA tensors on a machine without a GPU: the Triton path, as everywhere)
    if capability(device_index(device)) < MIN_CAPABILITY:
        return False
    B, S, N = scores_shape
    return serves(B * S, N, topk)


if available():
    @torch.library.register_fake("dsv4::topk_rows_cuda")
    def _topk_rows_cuda_fake(scores, visible, topk):
        return scores.new_empty((*scores.shape[:2], topk), dtype=torch.int32)
