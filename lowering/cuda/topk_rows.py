"""The CUDA top-k of score rows (``csrc/kernels/topk_rows.cu``), built on first use.

What ``dsv4::indexer_topk`` runs after its Triton scores kernel on NVIDIA GPUs, through the opaque
op ``dsv4::topk_rows_cuda`` (``dsv4_ops/ops/topk_cuda.py``): the Triton top-k's radix select costs
~1.9 us a 5-bit pass (``tl.histogram`` has no shared-memory atomics); the CUDA kernel's 8-bit
passes count into per-warp shared-memory histograms, over the entries above a floor the k-th best
cannot be under, radix digits of the offset from the least candidate (BENCHMARKS.md, sessions
14-15), and its picks are ordered by buckets of their keys where no bucket is crowded (session 28).

The source is compiled by ``nvcc`` (``$DSV4_OPS_NVCC``, ``$CUDA_HOME/bin/nvcc``, or ``nvcc`` on
``PATH``) for the GPU's own architecture into a shared library under ``$DSV4_OPS_CACHE``
(default ``~/.cache/dsv4_ops``), keyed by the source's hash and the architecture, and loaded with
``ctypes``: no torch headers, a few seconds to build, reused by every later process. Where it
cannot be built (no nvcc, no source in an installed wheel, ROCm), :func:`library` returns None
and says why in :func:`unavailable_reason`; the op then keeps the Triton top-k.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "kernels" / "topk_rows.cu"
# diagnostics, added to stop_after (the kernel's kDiag* flags): no row keeps its candidates in the shared list;
# rows of more than 8192 scores load by plain loads instead of bulk copies; the bitonic sort orders every row's picks
DIAG_NO_LIST, DIAG_NO_BULK, DIAG_BITONIC = 16, 32, 64
# stop_after: the whole kernel, then out[b, s, 0] = 1 where the bucket sort ordered the row's picks, 0 the bitonic
REPORT_SORT = 5
_reason: dict[str, str] = {}


def nvcc() -> str | None:
    """The nvcc to build with, or None."""
    for cand in (os.environ.get("DSV4_OPS_NVCC"),
                 os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else None,
                 shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def build_command(compiler: str, arch: str, output: str, source: Path = SOURCE) -> list[str]:
    """nvcc's command line for ``arch`` (e.g. ``"90"``): the GPU's own machine code, no torch."""
    return [compiler, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
            f"-gencode=arch=compute_{arch},code=sm_{arch}", "-o", output, str(source)]


def cache_dir() -> Path:
    return Path(os.environ.get("DSV4_OPS_CACHE", Path.home() / ".cache" / "dsv4_ops"))


def build(arch: str, source: Path = SOURCE) -> Path:
    """The shared library for ``arch``, compiled unless already in the cache (RuntimeError with
    nvcc's message if it fails). Concurrent builders each write a temporary file and rename it.
    ``source``: another version of the kernel (``benchmarks/topk_ab.py``), cached by its own hash."""
    if not source.is_file():
        raise RuntimeError(f"no CUDA source at {source} (an installed package without csrc/)")
    compiler = nvcc()
    if compiler is None:
        raise RuntimeError("nvcc not found (set DSV4_OPS_NVCC or CUDA_HOME)")
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    target = cache_dir() / f"topk_rows-sm{arch}-{digest}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(build_command(compiler, arch, tmp, source), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"nvcc failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def library(index: int = 0) -> ctypes.CDLL | None:
    """The loaded library for CUDA device ``index``, or None (reason: :func:`unavailable_reason`)."""
    key = str(index)
    if torch.version.hip is not None:
        _reason[key] = "ROCm: the CUDA top-k is for NVIDIA GPUs"
        return None
    try:
        major, minor = torch.cuda.get_device_capability(index)
        if major < 7:
            raise RuntimeError(f"sm_{major}{minor}: the CUDA top-k is built for sm_70 or newer (run on sm_90)")
        return load(build(f"{major}{minor}"))
    except (RuntimeError, OSError) as e:
        _reason[key] = str(e)
        return None


def load(path: Path) -> ctypes.CDLL:
    """A built library, its entry points typed."""
    lib = ctypes.CDLL(str(path))
    args = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] * 2 + [ctypes.c_void_p] + [ctypes.c_int64] * 3
            + [ctypes.c_int] * 4 + [ctypes.c_void_p])
    lib.dsv4_topk_rows.restype = lib.dsv4_topk_rows_diag.restype = ctypes.c_int
    lib.dsv4_topk_rows.argtypes = args
    lib.dsv4_topk_rows_diag.argtypes = args + [ctypes.c_int]
    return lib


def unavailable_reason(index: int = 0) -> str | None:
    library(index)
    return _reason.get(str(index))


def max_entries(index: int = 0) -> int:
    lib = library(index)
    return lib.dsv4_topk_rows_max_n() if lib is not None else 0


def max_topk(index: int = 0) -> int:
    lib = library(index)
    return lib.dsv4_topk_rows_max_topk() if lib is not None else 0


def topk_rows(scores: torch.Tensor, visible: torch.Tensor, topk: int, out: torch.Tensor | None = None, *,
              stop_after: int = 0, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``[B, S, topk] int32``: per row of ``scores [B, S, N]`` (fp32, last dim contiguous) the
    ``min(topk, visible)`` best of its first ``visible [B, S]`` entries (clamped to ``[0, N]``),
    by score descending then index ascending, then -1. Launched on the current stream.
    ``stop_after`` (diagnostics, ``benchmarks/topk_diag.py``): 1, 4, 2, 3 end the kernel after its
    load, its candidate list (rows of more than 8192 scores: ``out[b, s, 0]`` is the candidates'
    count), select, compaction (``out`` is then wrong; after the select ``out[b, s, 0]`` is the
    number of passes the select took, + 256 where the row's candidates overflowed the shared list
    and were read from the row); ``REPORT_SORT``: the whole kernel, then ``out[b, s, 0]`` says which
    sort ordered the picks (1 buckets, 0 bitonic); + ``DIAG_NO_LIST`` / ``DIAG_NO_BULK`` /
    ``DIAG_BITONIC``: the same with no row on the list / with plain loads instead of bulk copies / with
    the bitonic sort for every row (0 + them: the whole kernel so, with right picks).
    ``lib``: another build of the kernel (:func:`load`; ``benchmarks/topk_ab.py``)."""
    B, S, N = scores.shape
    index = scores.device.index if scores.device.index is not None else torch.cuda.current_device()
    lib = lib or library(index)
    if lib is None:
        raise RuntimeError(f"topk_rows: the CUDA top-k is unavailable: {unavailable_reason(index)}")
    if scores.dtype != torch.float32 or scores.stride(-1) != 1:
        raise ValueError("topk_rows: scores must be fp32 with a contiguous last dim")
    if visible.dtype != torch.int32 or visible.shape != (B, S):
        raise ValueError(f"topk_rows: visible must be int32 [B, S] = [{B}, {S}]")
    if not 1 <= N <= lib.dsv4_topk_rows_max_n() or not 1 <= topk <= lib.dsv4_topk_rows_max_topk():
        raise ValueError(f"topk_rows: N (got {N}) must be in [1, {lib.dsv4_topk_rows_max_n()}] and topk (got "
                         f"{topk}) in [1, {lib.dsv4_topk_rows_max_topk()}]")
    if out is None:
        out = torch.empty((B, S, topk), dtype=torch.int32, device=scores.device)
    elif out.dtype != torch.int32 or out.shape != (B, S, topk):
        raise ValueError(f"topk_rows: out must be int32 [B, S, topk] = [{B}, {S}, {topk}], got {out.dtype} "
                         f"{list(out.shape)}")
    if visible.device != scores.device or out.device != scores.device:
        raise ValueError(f"topk_rows: scores, visible and out must be on one device, got {scores.device}, "
                         f"{visible.device}, {out.device}")
    with torch.cuda.device(scores.device):  # the runtime launches on the current device
        err = lib.dsv4_topk_rows_diag(scores.data_ptr(), scores.stride(0), scores.stride(1),
                                      visible.data_ptr(), visible.stride(0), visible.stride(1),
                                      out.data_ptr(), out.stride(0), out.stride(1), out.stride(2),
                                      B, S, N, topk, torch.cuda.current_stream(scores.device).cuda_stream,
                                      int(stop_after))
    if err != 0:
        raise RuntimeError(f"topk_rows: launch failed (cudaError {err})")
    return out
