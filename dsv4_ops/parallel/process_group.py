"""``init_distributed``: the process group of a ``torchrun`` launch, with the settings this
package needs (a timeout, so a lost rank is an error rather than a hang; NVLink multicast off)."""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["init_distributed"]


def init_distributed(device: str | None = None, timeout_s: float = 300.0) -> torch.device:
    """Join the process group ``torchrun`` describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...)
    and return this rank's device: ``cuda:LOCAL_RANK`` with NCCL when CUDA is available (or
    ``device="cuda"``), else CPU with gloo. Collectives that wait longer than ``timeout_s`` raise.

    NCCL's NVLink SHARP / multicast (NVLS) is left off (``NCCL_NVLS_ENABLE=0`` unless set): it
    needs fabric-manager support that shared GPU hosts often lack, and decode all-reduces are too
    small to gain from it."""
    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    if cuda:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    return dev
