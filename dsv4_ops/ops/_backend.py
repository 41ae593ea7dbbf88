"""What every op body shares: the static device branch.

Each op is a ``torch.library.triton_op`` (DESIGN.md rule 5) whose body is also its fake:

    if use_triton(x):   spec = <module>.<op>_launch(...)                  # CUDA / ROCm
                        wrap_triton(<kernel>)[spec.grid](*spec.args, **spec.meta)
    else:               reference(...)                                    # CPU, backend "reference"

The kernel is named literally in ``wrap_triton(<kernel>)``, with the kernel imported by name
into the op's module: that is the form torch's kernel discovery (``get_inner_triton_kernels``,
which keys AOTAutograd's cache on the kernels' source) recognises in every supported torch
version. Grids, arguments and constexprs come from ``lowering/triton/<module>.py`` and are
pure functions of static shapes.

``use_triton`` reads the backend chosen once at import (``dsv4_ops.lowering.BACKEND``, rule 6)
and the device TYPE of a tensor, both static while tracing.

Checks: the body holds only the shape checks its outputs and an in-bounds launch need
(:func:`check`, static); every dtype, device and value check, with messages that name the
argument, is in the public wrapper (``validate.py``). The raw ``torch.ops.dsv4`` ops read
out-of-range indices the same way on every backend (each op's docstring says how).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .. import lowering


def use_triton(t: Tensor) -> bool:
    return lowering.use_triton(t.device.type)


def check(cond, message: Callable[[], str]) -> None:
    """``torch._check(cond, message)`` for the bodies' shape checks. An eager call's shapes are ints, so its
    conditions are plain bools, and a true one returns here: ``torch._check`` would pass it through the
    symbolic-shapes layer (about 0.7 µs a check, 4-9 checks an op). A traced call's condition may be a
    ``SymBool``, which ``torch._check`` records; a false one raises its error."""
    if cond is not True:
        torch._check(cond, message)
