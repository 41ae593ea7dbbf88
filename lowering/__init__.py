"""Backend-specific lowerings of the ``torch.ops.dsv4`` ops (installed as ``dsv4_ops.lowering``).

The backend is chosen ONCE, at import (DESIGN.md rule 6), never inside a traced region:

* ``triton`` — the Triton kernels in ``lowering/triton`` serve CUDA tensors. ROCm builds of
  torch also report CUDA devices and run the same kernels (no NVIDIA-only features; a
  wave64 config is picked from ``torch.version.hip``).
* ``reference`` — the portable plain-PyTorch path (``dsv4_ops.reference``) on every device.

Default: ``triton`` when a GPU is visible, else ``reference``. Override with the environment
variable ``DSV4_OPS_BACKEND=reference`` (or ``triton``), read once when dsv4_ops is imported.
CPU tensors always take the reference path.

Every op body (a ``torch.library.triton_op``) branches on :func:`use_triton` with the device
TYPE of an input tensor: a static fact of the traced graph, so the branch is resolved while
tracing and Inductor sees either the Triton kernels or the plain-aten reference. The kernel
modules are imported with the ops (Triton is a requirement); they only compile on first launch.
"""
from __future__ import annotations

import os

import torch

if __name__ != "dsv4_ops.lowering":
    # one module identity: as a top-level ``lowering`` (the checkout's root on sys.path) every kernel
    # module would exist twice, with two sets of globals and two Triton caches
    raise ImportError(f"the kernels' package is dsv4_ops.lowering; import it under that name, not {__name__!r}")

BACKEND_ENV = "DSV4_OPS_BACKEND"
BACKENDS = ("triton", "reference")


def select_backend(env_value: str | None, gpu_available: bool) -> str:
    """Pure decision function (tested on CPU): env override, else triton iff a GPU is visible."""
    if env_value:
        choice = env_value.strip().lower()
        if choice not in BACKENDS + ("auto",):
            raise ValueError(f"{BACKEND_ENV}={env_value!r}: must be one of {BACKENDS + ('auto',)}")
        if choice != "auto":
            return choice
    return "triton" if gpu_available else "reference"


BACKEND = select_backend(os.environ.get(BACKEND_ENV), torch.cuda.is_available())


def use_triton(device_type: str) -> bool:
    """The static device branch of every op: Triton kernels for CUDA (and ROCm, which also
    reports ``"cuda"``) tensors when the backend is ``triton``; the reference otherwise."""
    return device_type == "cuda" and BACKEND == "triton"

