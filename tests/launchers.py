"""The raw Triton launchers (``dsv4_ops.lowering.triton.<op>``) where the kernel tests run them.

On a machine without CUDA the kernels run under ``TRITON_INTERPRET=1`` (numpy, one program at a
time: small grids); on a CUDA machine the same tests launch the compiled kernels on ``DEVICE``.
``conftest.py`` sets the variable before Triton is imported; it is set here again (before any
kernel module is imported through ``kernel_module``) for a process that imports this first.
"""
import importlib
import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported
DEVICE = torch.device("cuda" if CUDA else "cpu")


def kernel_module(name):
    """``dsv4_ops.lowering.triton.<name>``."""
    return importlib.import_module(f"dsv4_ops.lowering.triton.{name}")


def i32(x):
    """An int32 tensor of ``x`` on ``DEVICE``."""
    return torch.tensor(x, dtype=torch.int32, device=DEVICE)


def rope_tables(P, half, device=DEVICE):
    """Random rotations: ``(cos, sin)`` tables of ``P`` positions x ``half`` channel pairs."""
    angle = torch.rand(P, half, device=device) * 6.283
    return angle.cos(), angle.sin()
