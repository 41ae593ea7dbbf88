"""The sinkhorn kernel compiles for ROCm (gfx942 = MI300, gfx950 = MI355) and Hopper (sm_90) with its
launcher's exact arguments and config at a DeepSeek-V4 decode step (batch 64, one token a row,
hc_mult = 4, 20 iterations), keeping its state in registers; no GPU needed
(``tests/cross_compile.py``: the method, in a worker process without ``TRITON_INTERPRET``)."""
from cross_compile import B_DECODE, kernel_tests, recorder, triton_cross_compile

KERNELS = ["sinkhorn"]


def _launches(backend):
    import torch

    from dsv4_ops.lowering.triton import sinkhorn as sk

    recorded = recorder(sk)
    sk.sinkhorn(torch.empty(B_DECODE, 1, 4, 4, dtype=torch.float32, device="meta"), 20, 1e-6)
    assert len(recorded) == 1, "sinkhorn: one launch"
    return [("sinkhorn",) + recorded[0]]


compiled = triton_cross_compile(__file__, __name__, _launches)
test_kernel_compiles, test_kernel_does_not_spill = kernel_tests(KERNELS)
