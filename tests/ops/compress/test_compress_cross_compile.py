"""The compress kernel compiles for ROCm (gfx942 = MI300, gfx950 = MI355) and Hopper (sm_90) with its
launcher's exact arguments and configs at DeepSeek-V4 shapes: a batch-64 decode step's emission of
the CSA pool (m = 4, overlap), the HCA pool (m = 128) and the indexer keys (d = 128, m = 4, overlap)
from bf16 rings, keeping its state in registers; and the quantising FP8 epilogues (KV layout for
the CSA / HCA pools, Hadamard-rotated indexer keys) from fp32 rings, within shared memory. Each also
as its paged variant (``_paged``), writing a serving engine's pool pages of 256 token positions
through a block table (FP8 KV pages at FlashMLA's padded stride). No GPU needed
(``tests/cross_compile.py``: the method, in a worker process without ``TRITON_INTERPRET``)."""
from cross_compile import (B_DECODE, D, DI, N_POOL, PAGE, ROPE, kernel_tests, padded_fp8_pages, recorder,
                           triton_cross_compile)

# name: (d, m, overlap); the FP8 ones write an FP8 pool (KV layout) or FP8 indexer keys
KERNELS = {"compress_csa": (D, 4, True), "compress_hca": (D, 128, False), "compress_indexer": (DI, 4, True)}
FP8_KERNELS = {"fp8_compress_csa": (D, 4, True), "fp8_compress_hca": (D, 128, False),
               "fp8_compress_indexer_keys": (DI, 4, True)}
PAGE_TOKENS = 256  # a serving engine's page: 64 CSA entries, 2 HCA entries


def _launches(backend):
    import torch

    from dsv4_ops.lowering.triton import compress as cp
    from dsv4_ops.reference import fp8_cache as fp8

    recorded = recorder(cp)
    i32, bf16, f32, u8 = (dict(dtype=t, device="meta") for t in (torch.int32, torch.bfloat16, torch.float32,
                                                                  torch.uint8))
    pool = torch.empty(fp8.KVLayout(D, ROPE, PAGE).shape(B_DECODE, N_POOL), **u8)
    keys = torch.empty(fp8.IndexerLayout(DI, PAGE).shape(B_DECODE, N_POOL), **u8)
    launches = []
    for paged in (False, True):
        for fp8_dest, kernels in ((False, KERNELS), (True, FP8_KERNELS)):
            for name, (d, m, overlap) in kernels.items():
                c = 2 if overlap else 1
                ring_dtype, half = (f32, ROPE // 2) if fp8_dest else (bf16, 32)
                ring = torch.empty(B_DECODE, c * m + 8, c * d, **ring_dtype)
                new = torch.empty(B_DECODE, 1, c * d, **ring_dtype)
                if paged:
                    page = PAGE_TOKENS // m
                    table = torch.empty(B_DECODE, N_POOL // page, **i32)
                    pages = B_DECODE * (N_POOL // page)
                    if not fp8_dest:
                        dest = torch.empty(pages, page, d, **bf16)
                    elif d == DI:
                        dest = torch.empty(pages, page, fp8.IndexerLayout(DI, page).entry_bytes, **u8)
                    else:
                        dest = padded_fp8_pages(pages, page, fp8.KVLayout(D, ROPE, page).entry_bytes)
                else:
                    table, dest = None, ((keys if d == DI else pool) if fp8_dest
                                         else torch.empty(B_DECODE, N_POOL, d, **bf16))
                cp.compress(ring, ring, new, new, torch.empty(B_DECODE, **i32), torch.empty(B_DECODE, 1, **i32),
                            torch.empty(d, **f32), torch.empty(65536, half, **f32), torch.empty(65536, half, **f32),
                            dest, m, overlap, 1e-6, table)
                assert len(recorded) == 1, name
                launches.append((name + ("_paged" if paged else ""),) + recorded.pop())
    return launches


compiled = triton_cross_compile(__file__, __name__, _launches)
test_kernel_compiles, test_kernel_does_not_spill = kernel_tests([*KERNELS, *(k + "_paged" for k in KERNELS)])
test_fp8_kernel_compiles, test_fp8_kernel_fits_shared_memory = kernel_tests(
    [*FP8_KERNELS, *(k + "_paged" for k in FP8_KERNELS)], fp8=True)
