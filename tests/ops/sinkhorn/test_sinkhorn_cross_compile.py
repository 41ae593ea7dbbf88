"""The sinkhorn kernel compiles for ROCm (gfx942 = MI300, gfx950 = MI355) and Hopper (sm_90) with its
launcher's exact arguments and config at a DeepSeek-V4 decode step (batch 64, one token a row,
hc_mult = 4, 20 iterations), keeping its state in registers; no GPU needed
(``tests/cross_compile.py``: the method, in a worker process without ``TRITON_INTERPRET``)."""
import sys

import pytest

from cross_compile import B_DECODE, TARGETS, compile_in_worker, kernel_tests, recorder, triton_worker

KERNELS = ["sinkhorn"]


def _launches(backend):
    import torch

    from dsv4_ops.lowering.triton import sinkhorn as sk

    recorded = recorder(sk)
    sk.sinkhorn(torch.empty(B_DECODE, 1, 4, 4, dtype=torch.float32, device="meta"), 20, 1e-6)
    assert len(recorded) == 1, "sinkhorn: one launch"
    return [("sinkhorn",) + recorded[0]]


@pytest.fixture(scope="module")
def compiled():
    return compile_in_worker(__file__, *TARGETS)


test_kernel_compiles, test_kernel_does_not_spill = kernel_tests(KERNELS)

if __name__ == "__main__":
    triton_worker(_launches, sys.argv[1:])
