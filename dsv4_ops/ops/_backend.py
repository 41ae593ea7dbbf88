"""What every op body shares: the static device branch and the Triton launcher modules.

Each op is a ``torch.library.triton_op`` (DESIGN.md rule 5) whose body is also its fake:

    if use_triton(x):   launcher(..., wrap=True)    # CUDA / ROCm: Inductor sees the kernels
    else:               reference(...)             # CPU and backend "reference": plain aten

``use_triton`` reads the backend chosen once at import (``dsv4_ops.lowering.BACKEND``, rule 6)
and the device TYPE of a tensor, both static while tracing. The bodies contain only tensor ops
and ``wrap_triton`` launches whose configs come from static shapes.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import lowering


def use_triton(t: Tensor) -> bool:
    return lowering.use_triton(t.device.type)


def launchers(name: str):
    """``lowering/triton/<name>.py`` (imported on first use)."""
    return lowering.triton_module(name)


def key_kernels(op_name: str, module: str, kernels: tuple[str, ...]) -> None:
    """Name the Triton kernels behind a triton_op for AOTAutograd's cache key.

    ``triton_op`` finds kernels by reading the body's source for ``wrap_triton(<name>)``;
    ours are launched through ``lowering/triton/_launch.py``, which that scan cannot follow,
    so a kernel edit would not invalidate a cached compiled graph. Done only when the
    Triton backend is active (it imports Triton); best effort, private table.
    """
    if lowering.BACKEND != "triton":
        return
    try:
        mod = launchers(module)
        torch._library.triton.triton_ops_to_kernels[op_name] = [getattr(mod, k) for k in kernels]
    except (ImportError, AttributeError):
        pass
