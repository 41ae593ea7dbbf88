"""The kernels a route would take the place of, for tests that compare the two on one machine: the Triton
sparse attention where the Gluon one would run (what ``DSV4_OPS_GLUON_ATTENTION=0`` gives a process), the
Triton top-k where the CUDA one would (``DSV4_OPS_CUDA_TOPK=0``). The switches are read when an op body is
traced or run, so a graph compiled inside keeps its route: reset dynamo, and keep torch's compile caches out."""
import contextlib

import torch

from dsv4_ops.ops import attention_sm90, topk_cuda


@contextlib.contextmanager
def route_off(module):
    saved, module._enabled = module._enabled, False
    try:
        with torch._functorch.config.patch(enable_autograd_cache=False):
            yield
    finally:
        module._enabled = saved


def triton_attention():
    return route_off(attention_sm90)


def triton_topk():
    return route_off(topk_cuda)
