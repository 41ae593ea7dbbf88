"""The cache_write kernels compile for ROCm (gfx942 = MI300, gfx950 = MI355) and Hopper (sm_90) with
their launcher's exact arguments and configs at DeepSeek-V4 shapes -- a batch-64 decode step's rows
of the window ring (d = 512), the CSA compressor ring (2 x 512) and the indexer ring (2 x 128) in
bf16, and the quantising FP8 write of window rows -- keeping their state in registers and (FP8)
within shared memory; and their paged variants, which write a serving engine's pool pages through
a block table (bf16 and FP8 pages, the FP8 ones at FlashMLA's padded page stride); no GPU needed
(``tests/cross_compile.py``: the method, in a worker process without ``TRITON_INTERPRET``)."""
from cross_compile import (B_DECODE, D, DI, N_POOL, PAGE, RING, ROPE, W, kernel_tests, padded_fp8_pages, recorder,
                           triton_cross_compile)

KERNELS = ["cache_write_window", "cache_write_csa_ring", "cache_write_indexer_ring", "cache_write_paged"]
FP8_KERNELS = ["fp8_cache_write_window", "fp8_cache_write_paged"]


def _launches(backend):
    import torch

    from dsv4_ops.lowering.triton import cache_write as cw
    from dsv4_ops.reference import fp8_cache as fp8

    recorded = recorder(cw)
    i32 = dict(dtype=torch.int32, device="meta")
    bf16 = dict(dtype=torch.bfloat16, device="meta")
    for C in (D, 2 * D, 2 * DI):
        cw.cache_write(torch.empty(B_DECODE, RING, C, **bf16), torch.empty(B_DECODE, 1, C, **bf16),
                       torch.empty(B_DECODE, 1, **i32))
    assert len(recorded) == 3, "cache_write: one launch a call"
    out = [(name,) + r for name, r in zip(KERNELS, recorded)]
    win_lay = fp8.KVLayout(D, ROPE, W)
    window = torch.empty(win_lay.shape(B_DECODE, W), dtype=torch.uint8, device="meta")
    cw.cache_write(window, torch.empty(B_DECODE, 1, D, **bf16), torch.empty(B_DECODE, 1, **i32))  # the launcher takes it
    del recorded[:]  # what it launched; the FP8 write's own launch, below, is the one compiled
    cw.launch(None, cw.fp8_cache_write_launch(window, torch.empty(B_DECODE, 1, D, **bf16),
                                              torch.empty(B_DECODE, 1, **i32), ROPE, win_lay.data_bytes,
                                              win_lay.scale_bytes))
    out.append(("fp8_cache_write_window", cw.fp8_cache_write_kernel) + recorded[-1][1:])
    # pages of a pool of N_POOL entries a row, PAGE entries a page, through a block table
    table = torch.empty(B_DECODE, N_POOL // PAGE, **i32)
    pages = torch.empty(B_DECODE * (N_POOL // PAGE), PAGE, D, **bf16)
    cw.cache_write(pages, torch.empty(B_DECODE, 1, D, **bf16), torch.empty(B_DECODE, 1, **i32), table)
    out.append(("cache_write_paged",) + recorded[-1])
    lay = fp8.KVLayout(D, ROPE, PAGE)
    fp8_pages = padded_fp8_pages(B_DECODE * (N_POOL // PAGE), PAGE, lay.entry_bytes)
    cw.launch(None, cw.fp8_cache_write_launch(fp8_pages, torch.empty(B_DECODE, 1, D, **bf16),
                                              torch.empty(B_DECODE, 1, **i32), ROPE, lay.data_bytes, lay.scale_bytes,
                                              table))
    out.append(("fp8_cache_write_paged", cw.fp8_cache_write_kernel) + recorded[-1][1:])
    return out


compiled = triton_cross_compile(__file__, __name__, _launches)
test_kernel_compiles, test_kernel_does_not_spill = kernel_tests(KERNELS)
test_fp8_kernel_compiles, test_fp8_kernel_fits_shared_memory = kernel_tests(FP8_KERNELS, fp8=True)
