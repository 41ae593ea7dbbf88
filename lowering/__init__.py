"""Backend-specific lowerings of the ``torch.ops.dsv4`` ops (installed as ``dsv4_ops.lowering``).

The backend is chosen ONCE, at import (DESIGN.md rule 6), never inside a traced region:

* ``triton`` — the Triton kernels in ``lowering/triton`` serve CUDA tensors. ROCm builds of
  torch also report CUDA devices and run the same kernels (no NVIDIA-only features; a
  wave64 config is picked from ``torch.version.hip``).
* ``reference`` — the portable plain-PyTorch path (``dsv4_ops.reference``) on every device.

Default: ``triton`` when a GPU is visible, else ``reference``. Override with the environment
variable ``DSV4_OPS_BACKEND=reference`` (or ``triton``), read once when dsv4_ops is imported.
CPU tensors always take the reference path.
"""
from __future__ import annotations

import os

import torch

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
