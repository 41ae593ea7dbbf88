"""Moving step inputs and outputs between host and GPU without waiting for the GPU.

A plain host-to-device copy of a pageable tensor, and ``tensor.tolist()`` of a device tensor, wait
for everything queued on the stream. A loop that launches a step and then reads what an earlier
one produced can let the host work while the GPU runs only if neither waits for the step just
launched: inputs are staged in pinned memory (whose caching allocator keeps a buffer until its
copy ran), and outputs are copied to pinned memory before the next launch and read through an
event that waits for that copy alone.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

__all__ = ["to_device", "start_read"]


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device``; from the host to a GPU without a wait."""
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def start_read(t: Tensor) -> Callable[[], list]:
    """Start copying ``t`` to the host -> a function that waits for that copy (not for work queued
    after this call) and returns ``t.tolist()``."""
    if t.device.type != "cuda":
        return t.tolist
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def read() -> list:
        copied.synchronize()
        return host.tolist()
    return read
