"""The gemv kernel compiles for ROCm (gfx942 = MI300, gfx950 = MI355) and Hopper (sm_90) with its
launcher's exact arguments and configs at a V4-Flash decode projection (q_b: 32768 x 1024, bf16) for
one token and for eight (the most the op takes), keeping its state in registers; no GPU needed
(``tests/cross_compile.py``: the method, in a worker process without ``TRITON_INTERPRET``)."""
from cross_compile import kernel_tests, recorder, triton_cross_compile

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


compiled = triton_cross_compile(__file__, __name__, _launches)
test_kernel_compiles, test_kernel_does_not_spill = kernel_tests(list(KERNELS))
