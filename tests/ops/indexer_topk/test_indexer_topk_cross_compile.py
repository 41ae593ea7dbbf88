"""The lightning indexer's kernels compile for ROCm (gfx942 = MI300, gfx950 = MI355) and Hopper (sm_90)
with their launcher's exact arguments and configs at DeepSeek-V4 shapes (64 heads x 128, an
8192-entry pool, batch-64 decode): the scores kernel and the one-program-per-row top-k for Flash's
top-512 and Pro's top-1024; each backend's other top-k (CUDA's looped kernel for rows past
``TOPK_ROW``, ROCm's row in registers) and the row kernel at its widest CUDA row (32K scores = 128K
context); the split top-k of a batch-1 decode step at 32K context (both stages, for top-512 and
top-1024; forced on ROCm, whose config never splits); the fused top-k (the scores kernel with stage
1 fused in, then stage 2) at 32K and 128K context; and over FP8 keys, the scores kernel (bf16
queries: on sm_90 an e4m3 x e4m3 tensor-core dot, and only there) and the fused top-k; and the
scores kernel and the fused top-k over a serving engine's key pages (64 keys a page) through a block
table (``_paged``), bf16 and FP8. Every kernel keeps its state in registers but the measured,
accepted ``KNOWN_SPILLS``, and the FP8 ones fit shared memory. No GPU needed
(``tests/cross_compile.py``: the method, in a worker process without ``TRITON_INTERPRET``)."""
import pytest

from cross_compile import (B_DECODE, DI, HI, K_CSA, N_POOL, PAGE, TARGETS, check_no_spill, kernel_tests, recorder,
                           triton_cross_compile)

KERNELS = ["indexer_scores", "topk_512", "topk_1024", "topk_other_512", "topk_row_32k_512",
           "topk_split1_512", "topk_split2_512", "topk_split1_1024", "topk_split2_1024",
           "indexer_fused_32k", "indexer_fused_32k_merge", "indexer_fused_128k", "indexer_fused_128k_merge",
           "indexer_scores_paged", "indexer_fused_paged"]
FP8_KERNELS = ["fp8_indexer_scores", "fp8_indexer_fused", "fp8_indexer_scores_paged", "fp8_indexer_fused_paged"]
# topk_row_32k_512 keeps part of a 32K-score row on the stack (sm_90) or spills SGPRs (gfx);
# on the H200 it is still 1.6x faster than the looped kernel (BENCHMARKS.md), so CUDA picks
# it at 128K context; the ROCm config keeps the looped kernel.
KNOWN_SPILLS = {("sm90", "topk_row_32k_512"), ("gfx942", "topk_row_32k_512"), ("gfx950", "topk_row_32k_512")}


def _launches(backend):
    import torch

    from dsv4_ops.lowering.triton import indexer as ix
    from dsv4_ops.reference import fp8_cache as fp8

    recorded = recorder(ix)
    meta_dev = torch.device("meta")
    bf16, f32, i32 = (dict(dtype=t, device=meta_dev) for t in (torch.bfloat16, torch.float32, torch.int32))
    out = []
    # the one-program-per-row top-k kernels (TOPK_SPLIT=0: batch-64 decode rows leave SMs idle,
    # so the default config splits them; these kernels serve batches of at least sms rows)
    for topk in (512, 1024):  # Flash, Pro
        q = torch.empty(B_DECODE, 1, HI, DI, **bf16)
        w = torch.empty(B_DECODE, 1, HI, **f32)
        keys = torch.empty(B_DECODE, N_POOL, DI, **bf16)
        vis = torch.empty(B_DECODE, 1, **i32)
        start = len(recorded)
        ix.indexer_topk(q, w, keys, vis, topk,
                        config=dict(ix.indexer_config(B_DECODE, 1, HI, DI, N_POOL, topk, backend=backend),
                                    TOPK_SPLIT=0))
        names = ["indexer_scores", f"topk_{topk}"]
        out += [(n,) + r for n, r in zip(names, recorded[start:]) if not (topk == 1024 and n == "indexer_scores")]
    # the other top-k kernel of each backend: CUDA's looped one for rows past TOPK_ROW (past
    # 128K context), ROCm's row-in-registers one (its config keeps the looped one); and the
    # row kernel at its widest CUDA row (32K scores = 128K context)
    vis = torch.empty(B_DECODE, 1, **i32)
    picks = vis.new_empty(B_DECODE, 1, 512)
    row_cfg = dict(ix.indexer_config(B_DECODE, 1, HI, DI, N_POOL, 512), TOPK_SPLIT=0)
    start = len(recorded)
    if backend == "hip":
        scores = torch.empty(B_DECODE, 1, N_POOL, **f32)
        ix.topk_from_scores(scores, vis, 512, picks, row_cfg)
    else:
        scores = torch.empty(B_DECODE, 1, 8 * N_POOL, **f32)
        ix.topk_from_scores(scores, vis, 512, picks,
                            dict(ix.indexer_config(B_DECODE, 1, HI, DI, 8 * N_POOL, 512), TOPK_SPLIT=0))
    out.append(("topk_other_512",) + recorded[start])
    scores = torch.empty(B_DECODE, 1, 4 * N_POOL, **f32)
    start = len(recorded)
    ix.topk_from_scores(scores, vis, 512, picks, dict(ix.indexer_config(B_DECODE, 1, HI, DI, 4 * N_POOL, 512),
                                                      TOPK_ROW=4 * N_POOL, TOPK_SPLIT=0))
    out.append(("topk_row_32k_512",) + recorded[start])
    # the split top-k of a batch-1 decode step at 32K context (8258 pool entries): stage 1 over
    # 2048-entry segments for Flash's top-512 (stage 2 over 5 segments' candidates), 4096 for Pro's
    # top-1024 (3 segments). CUDA's config picks it there; ROCm's never does, forced here so that a
    # sweep forcing it builds
    for topk, seg in ((512, 2048), (1024, 4096)):
        scores = torch.empty(1, 1, 8258, **f32)
        cfg = ix.indexer_config(1, 1, HI, DI, 8258, topk, backend=backend)
        assert cfg["TOPK_SPLIT"] == (0 if backend == "hip" else seg), cfg
        cfg["TOPK_SPLIT"] = seg
        start = len(recorded)
        ix.topk_from_scores(scores, vis[:1], topk, picks.new_empty(1, 1, topk), cfg)
        assert len(recorded) == start + 2, "split top-k: two stages"
        out += [(f"topk_split1_{topk}",) + recorded[-2], (f"topk_split2_{topk}",) + recorded[-1]]
    # the fused top-k (Flash top-512): the scores kernel with stage 1 fused in, then stage 2 over the
    # chunks' candidates. 32K context (8192 pool entries): batch 128's 1024-entry chunks, forced at batch
    # 64 (which CUDA's rule leaves unfused); 128K (32768 entries): batch 64's 2048-entry chunks. 4 warps.
    # ROCm's config never fuses, forced here so that a sweep forcing it builds
    for name, n, default, chunk in (("indexer_fused_32k", N_POOL, 0, 1024),
                                    ("indexer_fused_128k", 4 * N_POOL, 2048, 2048)):
        q = torch.empty(B_DECODE, 1, HI, DI, **bf16)
        w = torch.empty(B_DECODE, 1, HI, **f32)
        keys = torch.empty(B_DECODE, n, DI, **bf16)
        cfg = ix.indexer_config(B_DECODE, 1, HI, DI, n, 512, backend=backend)
        assert cfg["TOPK_FUSED"] == (0 if backend == "hip" else default), cfg
        cfg["TOPK_FUSED"] = chunk
        start = len(recorded)
        ix.indexer_topk(q, w, keys, vis, 512, config=cfg)
        assert len(recorded) == start + 2 and recorded[-2][2]["TOPK_FUSED"] == 1, "fused: scores + stage 2"
        out += [(name,) + recorded[-2], (name + "_merge",) + recorded[-1]]
    # FP8 keys. bf16 queries on sm_90 score them with an e4m3 x e4m3 tensor-core dot (FP8_DOT, chosen at
    # launch from the device: forced here, the tensors are on "meta"); ROCm decodes both sides
    keys = torch.empty(fp8.IndexerLayout(DI, PAGE).shape(B_DECODE, N_POOL), dtype=torch.uint8, device=meta_dev)
    q, w, vis = torch.empty(B_DECODE, 1, HI, DI, **bf16), torch.empty(B_DECODE, 1, HI, **f32), vis
    start = len(recorded)
    ix.indexer_scores(q, w, keys, vis, config=dict(ix.indexer_config(B_DECODE, 1, HI, DI, N_POOL, K_CSA,
                                                                     backend=backend), FP8_DOT=int(backend == "cuda")))
    out += [(f"fp8_indexer_scores{'' if i == 0 else '_combine'}",) + r for i, r in enumerate(recorded[start:])]
    # the fused top-k over FP8 keys at batch 64 x 32K (Flash top-512): the scores kernel with stage 1 fused
    # in (2048-entry chunks, forced: no config fuses FP8 keys, measured slower; a sweep may), then stage 2
    cfg = dict(ix.indexer_config(B_DECODE, 1, HI, DI, N_POOL, K_CSA, backend=backend), TOPK_FUSED=2048)
    start = len(recorded)
    ix.indexer_topk(q, w, keys, vis, K_CSA, config=cfg)
    assert len(recorded) == start + 2 and recorded[start][2]["TOPK_FUSED"] == 1 and recorded[start][2]["KEYS_FP8"] == 2
    out.append(("fp8_indexer_fused",) + recorded[start])
    # key pages (64 keys = 256 token positions a page) through a block table: bf16 and FP8 keys, the
    # scores kernel and the fused top-k (forced, as above)
    table = torch.empty(B_DECODE, N_POOL // PAGE, **i32)
    pages = B_DECODE * (N_POOL // PAGE)
    for prefix, key_pages in (("", torch.empty(pages, PAGE, DI, **bf16)),
                              ("fp8_", torch.empty(pages, PAGE, fp8.IndexerLayout(DI, PAGE).entry_bytes,
                                                   dtype=torch.uint8, device=meta_dev))):
        cfg = ix.indexer_config(B_DECODE, 1, HI, DI, N_POOL, K_CSA, backend=backend)
        start = len(recorded)
        ix.indexer_scores(q, w, key_pages, vis, config=dict(cfg, FP8_DOT=int(backend == "cuda" and prefix == "fp8_")),
                          block_table=table)
        out.append((prefix + "indexer_scores_paged",) + recorded[start])
        start = len(recorded)
        ix.indexer_topk(q, w, key_pages, vis, K_CSA, config=dict(cfg, TOPK_FUSED=2048), block_table=table)
        assert len(recorded) == start + 2 and recorded[start][2]["TOPK_FUSED"] == 1, "fused: scores + stage 2"
        out.append((prefix + "indexer_fused_paged",) + recorded[start])
    return out


compiled = triton_cross_compile(__file__, __name__, _launches)
test_kernel_compiles, test_kernel_does_not_spill = kernel_tests(KERNELS, KNOWN_SPILLS)
test_fp8_kernel_compiles, test_fp8_kernel_fits_shared_memory = kernel_tests(FP8_KERNELS, fp8=True)


def test_fp8_indexer_scores_run_on_fp8_tensor_cores(compiled):
    """sm_90: the scores over FP8 keys (per row or paged) are e4m3 x e4m3 wgmma (no decode of keys or queries), with
    the queries' codes from the hardware convert, and only there: the fused path (FP8_DOT off, as on
    ROCm) keeps the bf16 dot and the integer encode."""
    for name in ("fp8_indexer_scores", "fp8_indexer_scores_paged"):
        assert compiled[("sm90", name)]["constexprs"]["FP8_DOT"] == 1
        assert compiled[("sm90", name)]["fp8_mma"] and compiled[("sm90", name)]["e4m3_convert"], name
    assert not compiled[("sm90", "fp8_indexer_fused")]["fp8_mma"]
    assert not compiled[("sm90", "fp8_indexer_fused")]["e4m3_convert"]


@pytest.mark.parametrize("target", list(TARGETS))
def test_fp8_fused_indexer_does_not_spill(compiled, target):
    """The fused top-k's scores kernel over FP8 keys keeps its chunk's register row in registers."""
    check_no_spill(compiled[(target, "fp8_indexer_fused")], target)

