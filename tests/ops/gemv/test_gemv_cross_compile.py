"""The gemv kernel compiles for ROCm (gfx942 = MI300, gfx950 = MI355) and Hopper (sm_90) with its
launcher's exact arguments and configs at a V4-Flash decode projection (q_b: 32768 x 1024, bf16) for
one token and for eight (the most the op takes), keeping its state in registers; no GPU needed
(``tests/cross_compile.py``: the method, in a worker process without ``TRITON_INTERPRET``)."""
import sys

import pytest

from cross_compile import TARGETS, compile_in_worker, kernel_tests, recorder, triton_worker

KERNELS = {"gemv_decode": 1, "gemv_8_tokens": 8}  # name: tokens


def _launches(backend):
    import torch

    from dsv4_ops.lowering.triton import gemv as gv

    recorded = recorder(gv)
    bf16 = dict(dtype=torch.bfloat16, device="meta")
    for T in KERNELS.values():
        gv.gemv(torch.empty(T, 1, 1024, **bf16), torch.empty(1, 32768, 1024, **bf16))
    assert len(recorded) == len(KERNELS), "gemv: one launch a call"
    return [(name,) + r for name, r in zip(KERNELS, recorded)]


@pytest.fixture(scope="module")
def compiled():
    return compile_in_worker(__file__, *TARGETS)


test_kernel_compiles, test_kernel_does_not_spill = kernel_tests(list(KERNELS))

if __name__ == "__main__":
    triton_worker(_launches, sys.argv[1:])
