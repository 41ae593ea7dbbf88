"""The routed-expert kernels (gate/up, then down) compile for ROCm (gfx942 = MI300, gfx950 = MI355) and
Hopper (sm_90) with their launcher's exact arguments and configs at a V4-Flash batch-1 decode token
(top-6 of 256 experts, 4096 x 2048, bf16), keeping their state in registers; no GPU needed
(``tests/cross_compile.py``: the method, in a worker process without ``TRITON_INTERPRET``)."""
from cross_compile import kernel_tests, recorder, triton_cross_compile

KERNELS = ["moe_gate_up", "moe_down"]


def _launches(backend):
    import torch

    from dsv4_ops.lowering.triton import moe_gemv as mg

    recorded = recorder(mg)
    bf16 = dict(dtype=torch.bfloat16, device="meta")
    mg.moe_gemv(torch.empty(1, 4096, **bf16), torch.empty(1, 6, dtype=torch.int64, device="meta"),
                torch.empty(1, 6, dtype=torch.float32, device="meta"), torch.empty(256, 4096, 4096, **bf16),
                torch.empty(256, 4096, 2048, **bf16), 10.0)
    assert len(recorded) == 2, "moe_gemv: gate/up + down"
    return [(name,) + r for name, r in zip(KERNELS, recorded)]


compiled = triton_cross_compile(__file__, __name__, _launches)
test_kernel_compiles, test_kernel_does_not_spill = kernel_tests(KERNELS)
