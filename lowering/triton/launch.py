"""What the launch-configuration code of every kernel module shares.

Each module computes its launches as :class:`Launch` values (grid, arguments, constexprs and
compile options: pure functions of static shapes). The ``triton_op`` bodies in
``dsv4_ops/ops`` launch them as ``wrap_triton(<kernel>)[l.grid](*l.args, **l.meta)``, naming
the kernel literally so torch's kernel discovery (the AOTAutograd cache key) finds it; the
raw launchers here launch them directly with :func:`launch`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Launch(NamedTuple):
    """One launch of a known kernel: ``kernel[grid](*args, **meta)``."""

    grid: tuple
    args: tuple
    meta: dict


def launch(kernel, spec: Launch | None) -> None:
    """``kernel[spec.grid](*spec.args, **spec.meta)``; nothing for ``None`` (an empty launch)."""
    if spec is not None:
        kernel[spec.grid](*spec.args, **spec.meta)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a GPU device (static: read from the device properties, not
    from data); 132 (H100/H200) on a device without properties, e.g. the interpreter."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def backend() -> str:
    """``"hip"`` on a ROCm build of torch, else ``"cuda"`` (static, decided by the build)."""
    return "hip" if torch.version.hip else "cuda"
