"""Programmatic dependent launch (PDL) between the two kernels of one op, on sm_90+ NVIDIA GPUs.

Two of our ops are a pair of kernels where the second reads only what the first wrote:
``dsv4::indexer_topk`` (the Triton scores pass, then the CUDA top-k) and the Gluon decode
attention (the split-KV partials, then ``combine_kernel``). In stream order the second kernel
is launched only when the first has finished: its launch and its CTAs' start-up are not hidden.
With PDL the first kernel says early that its dependents may launch
(``griddepcontrol.launch_dependents``, here at the start of each of its programs), the second is
launched with the programmatic-serialization attribute, its CTAs become resident while the first
still runs, and each waits (``griddepcontrol.wait``) before it touches global memory until the
first has finished and its writes are visible. The results are the same bits; only the gap goes.

Why it is safe whatever runs before the second kernel: the wait returns only once the kernel
before it in the stream has completed, and the second kernel reads or writes no global memory
before it. Without the launch attribute (another caller, an older GPU) the wait returns at once
and the trigger does nothing.

``DSV4_OPS_PDL=0`` (read at import) turns it off, for measurements. Never under the Triton
interpreter or ROCm (the instructions are PTX for sm_90).
"""
from __future__ import annotations

import functools
import os

import torch
import triton

ENV = "DSV4_OPS_PDL"
_enabled = os.environ.get(ENV, "1").strip() != "0"


@functools.cache
def _sm90_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def enabled(device: torch.device) -> bool:
    """Static: whether the kernels of an op on ``device`` launch as a PDL pair (a function of the
    device and the environment, never of data)."""
    if not (_enabled and device.type == "cuda" and torch.version.hip is None and torch.cuda.is_available()):
        return False  # (fake CUDA tensors on a machine without a GPU, e.g. CPU tracing tests: off)
    if triton.knobs.runtime.interpret:
        return False
    return _sm90_or_newer(device.index if device.index is not None else torch.cuda.current_device())
