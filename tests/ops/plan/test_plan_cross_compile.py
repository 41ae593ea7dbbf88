"""The plan kernel compiles for ROCm (gfx942 = MI300, gfx950 = MI355) and Hopper (sm_90) with its
launcher's exact arguments and configs at DeepSeek-V4 shapes -- a batch-64 decode step (ring mode,
one query slot) and a long concat-mode prefill chunk -- and keeps its state in registers; no GPU
needed (``tests/cross_compile.py``: the method, in a worker process without ``TRITON_INTERPRET``)."""
from cross_compile import B_DECODE, RING, W, kernel_tests, recorder, triton_cross_compile

KERNELS = ["plan_decode", "plan_prefill"]


def _launches(backend):
    import torch

    from dsv4_ops.lowering.triton import plan as pl

    recorded = recorder(pl)
    i32 = dict(dtype=torch.int32, device="meta")
    lengths, n_new = torch.empty(B_DECODE, **i32), torch.empty(B_DECODE, **i32)
    pl.plan(lengths, n_new, 1, 1, W, RING, False, 4, 16, 128, 136)
    pl.plan(lengths[:4], n_new[:4], 8192, 1, W, RING, True, 4, 16, 128, 136)
    assert len(recorded) == len(KERNELS), "plan: one launch a call"
    return [(name,) + r for name, r in zip(KERNELS, recorded)]


compiled = triton_cross_compile(__file__, __name__, _launches)
test_kernel_compiles, test_kernel_does_not_spill = kernel_tests(KERNELS)
