"""The sparse attention kernels compile for ROCm (gfx942 = MI300, gfx950 = MI355) and Hopper (sm_90)
with their launcher's exact arguments and configs at DeepSeek-V4 shapes (64 heads x 512 dims, a
128-row window, top-512 picks of an 8192-entry pool): bf16 decode at batch 64 (one split) and
batch 1 (split-KV + combine); fp32 (a correctness dtype, not tuned) at a tiny width, at decode, with
split-KV and for a 64-token prefill chunk with V4-Pro's 128 heads; and over FP8 caches: FP8 window +
pool at decode (also split-KV), an FP8 pool behind a float window for a prefill chunk; and a serving
engine's decode, the pool read as pages of 64 entries through a block table (``_paged``: bf16, and
FP8 pages at FlashMLA's padded stride behind an FP8 window). The hot
decode kernels keep acc [BLOCK_H, 512] in registers (and run on Hopper's tensor cores), every
kernel keeps its state in registers, and every config fits one program's shared memory within the
estimate ``attention_config`` sizes its pipeline by. No GPU needed (``tests/cross_compile.py``: the
method, in a worker process without ``TRITON_INTERPRET``)."""
import pytest

from cross_compile import (B_DECODE, D, H, K_CSA, N_POOL, PAGE, RING, ROPE, TARGETS, W, kernel_tests,
                           padded_fp8_pages, recorder, triton_cross_compile)

HOT = ["attention_decode", "attention_decode_split"]
ATTENTION = [*HOT, "attention_decode_paged", "attention_decode_paged_split", "attention_tiny_fp32", "attention_fp32_decode", "attention_fp32_decode_split",
             "attention_fp32_prefill"]
KERNELS = ["attention_decode", "attention_decode_split", "attention_decode_combine", "attention_decode_paged",
           "attention_decode_paged_split", "attention_decode_paged_combine",
           "attention_tiny_fp32", "attention_fp32_decode", "attention_fp32_decode_split",
           "attention_fp32_decode_combine", "attention_fp32_prefill"]
FP8_KERNELS = ["fp8_attention_decode", "fp8_attention_decode_split", "fp8_attention_decode_split_combine",
               "fp8_attention_prefill_float_window", "fp8_attention_decode_paged"]
# attention_tiny_fp32 (a test-only D=64 fp32 config, never picked at V4 shapes) keeps 8 bytes
# of stack on sm_90 (two STL/LDL of loop-invariant scalars); every V4-shaped kernel has none.
# The paged decode kernels on sm_90 (found by this test, not yet timed on a GPU): at the hot config's 255
# registers the block-table lookup leaves 8 (split: 16) bytes on the stack, where the per-row kernel
# keeps none; ROCm: no spill.
KNOWN_SPILLS = {("sm90", "attention_tiny_fp32"), ("sm90", "attention_decode_paged"),
                ("sm90", "attention_decode_paged_split")}


def _launches(backend):
    import torch

    from dsv4_ops.lowering.triton import sparse_attention as sa
    from dsv4_ops.reference import fp8_cache as fp8

    recorded = recorder(sa)
    meta = dict(device="meta")
    i32, f32, u8 = (dict(dtype=t, **meta) for t in (torch.int32, torch.float32, torch.uint8))

    def attention(name, B, heads, dim, dtype, num_splits=None, S=1, kv=None, pool=None, fp8_mode=0, table=None):
        q = torch.empty(B, S, heads, dim, dtype=dtype, **meta)
        kv = torch.empty(B, RING, dim, dtype=dtype, **meta) if kv is None else kv
        cmp = torch.empty(B, N_POOL, dim, dtype=dtype, **meta) if pool is None else pool
        cfg = sa.attention_config(B, S, heads, dim, W + K_CSA, num_splits=num_splits, backend=backend, dtype=dtype,
                                  **({"fp8": fp8_mode} if fp8_mode else {}))
        start = len(recorded)
        sa.sparse_attention(q, kv, torch.empty(B, S, W, **i32), cmp, torch.empty(B, S, K_CSA, **i32),
                            torch.empty(B, S, **i32), torch.empty(heads, **f32), dim**-0.5, config=cfg,
                            block_table=table)
        if fp8_mode:  # the FP8 file's names: the launch, then its combine
            names = [f"{name}{'' if i == 0 else '_combine'}" for i in range(len(recorded) - start)]
        else:
            names = [name] if cfg["NUM_SPLITS"] == 1 else [name + "_split", name + "_combine"]
        return [(n,) + r for n, r in zip(names, recorded[start:])]

    bf16 = torch.bfloat16
    out = []
    out += attention("attention_decode", B_DECODE, H, D, bf16, num_splits=1)
    out += attention("attention_decode", 1, H, D, bf16)  # split-KV + combine
    out += attention("attention_tiny_fp32", 2, 4, 64, torch.float32, num_splits=1)
    # fp32 at V4 widths (a correctness dtype, not tuned): decode, decode with split-KV, a
    # 64-token prefill chunk with the 128 heads of V4-Pro
    out += attention("attention_fp32_decode", B_DECODE, H, D, torch.float32, num_splits=1)
    out += attention("attention_fp32_decode", 1, H, D, torch.float32)
    out += attention("attention_fp32_prefill", 1, 2 * H, D, torch.float32, S=64)
    # FP8 caches: window pages of W entries and a pool of PAGE-entry pages (mode 2, decode), or a float
    # window over the FP8 pool (mode 1, a prefill chunk)
    window = torch.empty(fp8.KVLayout(D, ROPE, W).shape(B_DECODE, W), **u8)
    pool = torch.empty(fp8.KVLayout(D, ROPE, PAGE).shape(B_DECODE, N_POOL), **u8)
    out += attention("fp8_attention_decode", B_DECODE, H, D, bf16, num_splits=1, kv=window, pool=pool, fp8_mode=2)
    out += attention("fp8_attention_decode_split", 1, H, D, bf16, kv=window[:1], pool=pool[:1], fp8_mode=2)
    out += attention("fp8_attention_prefill_float_window", 1, H, D, bf16, num_splits=1, S=64,
                     kv=torch.empty(1, W + 64, D, dtype=bf16, **meta), pool=pool[:1], fp8_mode=1)
    # a serving engine's pool: pages of PAGE entries (256 token positions of CSA) through a block table
    table = torch.empty(B_DECODE, N_POOL // PAGE, **i32)
    pages = B_DECODE * (N_POOL // PAGE)
    bf16_pages = torch.empty(pages, PAGE, D, dtype=bf16, **meta)
    out += attention("attention_decode_paged", B_DECODE, H, D, bf16, num_splits=1, pool=bf16_pages, table=table)
    out += attention("attention_decode_paged", 1, H, D, bf16, pool=bf16_pages, table=table[:1])  # split-KV
    fp8_pages = padded_fp8_pages(pages, PAGE, fp8.KVLayout(D, ROPE, PAGE).entry_bytes)
    out += attention("fp8_attention_decode_paged", B_DECODE, H, D, bf16, num_splits=1, kv=window, pool=fp8_pages,
                     fp8_mode=2, table=table)
    return out


compiled = triton_cross_compile(__file__, __name__, _launches)
test_kernel_compiles, test_kernel_does_not_spill = kernel_tests(KERNELS, KNOWN_SPILLS)
test_fp8_kernel_compiles, test_fp8_kernel_fits_shared_memory = kernel_tests(FP8_KERNELS, fp8=True)


@pytest.mark.parametrize("target", list(TARGETS))
def test_decode_attention_does_not_spill(compiled, target):
    """The hot kernel's chosen configs were picked to keep acc [BLOCK_H, 512] in registers."""
    for kernel in HOT:
        res = compiled[(target, kernel)]["resources"]
        if target == "sm90":
            if res:  # cuobjdump ships in Triton's wheel; absent -> nothing to check
                assert res["stack_bytes"] == 0, res
                assert res["wgmma"] > 0, res  # Hopper tensor-core path
        else:
            assert res["vgpr_spill_count"] == 0, res


@pytest.mark.parametrize("kernel", ATTENTION)
@pytest.mark.parametrize("target", list(TARGETS))
def test_attention_fits_shared_memory(compiled, target, kernel):
    """Every attention config fits one program's shared memory (sm_90: 227 KB; fp32 at D=512
    once asked for 328 KB, an OutOfResources at launch), and within the estimate
    ``attention_config`` sizes its pipeline by."""
    from dsv4_ops.lowering.triton import sparse_attention as sa

    r = compiled[(target, kernel)]
    assert "error" not in r, r["error"]
    limit = sa.SMEM_LIMIT["hip" if TARGETS[target][0] == "hip" else "cuda"]
    assert r["shared"] <= limit, r
    c = r["constexprs"]
    cfg = dict(BLOCK_D=c["BLOCK_D"], BLOCK_H=c["BLOCK_H"], BLOCK_N=c["BLOCK_N"], num_stages=r["num_stages"])
    assert r["shared"] <= sa.attention_smem_bytes(cfg, 4 if "fp32" in kernel else 2), r

