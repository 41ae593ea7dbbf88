"""Every Triton kernel compiles for ROCm (gfx942 = MI300, gfx950 = MI355) and Hopper (sm_90),
with the exact arguments and constexpr configs its launcher uses at DeepSeek-V4 shapes; no GPU
needed. The launchers are called on ``meta`` tensors with ``launch`` swapped for a recorder, and
each recorded launch is compiled with ``triton.compile(ASTSource(...), target=GPUTarget(...))``
the way Triton's JIT would specialise it (pointers 16-byte aligned, ints == 1 as constants,
ints divisible by 16 marked so), except that float arguments are typed fp64 as Inductor types them.

The compiles run in a subprocess without ``TRITON_INTERPRET`` (``conftest.py`` sets it for the
whole CPU test process, and ``@triton.jit`` reads it when a kernel module is imported). Register
and spill counts are read from the artifacts (cuobjdump from Triton's wheel for the cubin, the
AMDGPU metadata for the hsaco) and pinned for the hot decode-attention kernel.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from compiled_worker import run_worker

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"gfx942": ("hip", "gfx942", 64), "gfx950": ("hip", "gfx950", 64), "sm90": ("cuda", 90, 32)}

# V4 shapes: Flash attention (H=64, D=512, W=128, top-k 512, 8192-entry pool), indexer (64 x 128)
B_DECODE, H, D, W, K_CSA, N_POOL, RING = 64, 64, 512, 128, 512, 8192, 256
HI, DI = 64, 128


def _launches(backend: str):
    """(name, kernel, args, meta) of every launch the launchers make at V4 shapes (worker side)."""
    import torch

    sys.path.insert(0, str(ROOT))
    from dsv4_ops.lowering.triton import cache_write as cw
    from dsv4_ops.lowering.triton import compress as cp
    from dsv4_ops.lowering.triton import gemv as gv
    from dsv4_ops.lowering.triton import indexer as ix
    from dsv4_ops.lowering.triton import moe_gemv as mg
    from dsv4_ops.lowering.triton import plan as pl
    from dsv4_ops.lowering.triton import sinkhorn as sk
    from dsv4_ops.lowering.triton import sparse_attention as sa

    recorded = []

    def record(kernel, spec):
        if spec is not None:
            recorded.append((kernel, spec.args, spec.meta))

    sa.launch = ix.launch = pl.launch = cw.launch = cp.launch = sk.launch = mg.launch = gv.launch = record
    meta_dev = torch.device("meta")

    def attention(name, B, heads, dim, dtype, num_splits=None, S=1):
        q = torch.empty(B, S, heads, dim, dtype=dtype, device=meta_dev)
        kv = torch.empty(B, RING, dim, dtype=dtype, device=meta_dev)
        cmp = torch.empty(B, N_POOL, dim, dtype=dtype, device=meta_dev)
        kv_idx = torch.empty(B, S, W, dtype=torch.int32, device=meta_dev)
        cmp_idx = torch.empty(B, S, K_CSA, dtype=torch.int32, device=meta_dev)
        cmp_len = torch.empty(B, S, dtype=torch.int32, device=meta_dev)
        sink = torch.empty(heads, dtype=torch.float32, device=meta_dev)
        cfg = sa.attention_config(B, S, heads, dim, W + K_CSA, num_splits=num_splits, backend=backend, dtype=dtype)
        start = len(recorded)
        sa.sparse_attention(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, dim**-0.5, config=cfg)
        names = [name] if cfg["NUM_SPLITS"] == 1 else [name + "_split", name + "_combine"]
        return [(n,) + r for n, r in zip(names, recorded[start:])]

    out = []
    out += attention("attention_decode", B_DECODE, H, D, torch.bfloat16, num_splits=1)
    out += attention("attention_decode", 1, H, D, torch.bfloat16)  # split-KV + combine
    out += attention("attention_tiny_fp32", 2, 4, 64, torch.float32, num_splits=1)
    # fp32 at V4 widths (a correctness dtype, not tuned): decode, decode with split-KV, a
    # 64-token prefill chunk with the 128 heads of V4-Pro
    out += attention("attention_fp32_decode", B_DECODE, H, D, torch.float32, num_splits=1)
    out += attention("attention_fp32_decode", 1, H, D, torch.float32)
    out += attention("attention_fp32_prefill", 1, 2 * H, D, torch.float32, S=64)
    # the one-program-per-row top-k kernels (TOPK_SPLIT=0: batch-64 decode rows leave SMs idle,
    # so the default config splits them; these kernels serve batches of at least sms rows)
    for topk in (512, 1024):  # Flash, Pro
        q = torch.empty(B_DECODE, 1, HI, DI, dtype=torch.bfloat16, device=meta_dev)
        w = torch.empty(B_DECODE, 1, HI, dtype=torch.float32, device=meta_dev)
        keys = torch.empty(B_DECODE, N_POOL, DI, dtype=torch.bfloat16, device=meta_dev)
        vis = torch.empty(B_DECODE, 1, dtype=torch.int32, device=meta_dev)
        start = len(recorded)
        ix.indexer_topk(q, w, keys, vis, topk,
                        config=dict(ix.indexer_config(B_DECODE, 1, HI, DI, N_POOL, topk, backend=backend),
                                    TOPK_SPLIT=0))
        names = ["indexer_scores", f"topk_{topk}"]
        out += [(n,) + r for n, r in zip(names, recorded[start:]) if not (topk == 1024 and n == "indexer_scores")]
    # the other top-k kernel of each backend: CUDA's looped one for rows past TOPK_ROW (past
    # 128K context), ROCm's row-in-registers one (its config keeps the looped one); and the
    # row kernel at its widest CUDA row (32K scores = 128K context)
    vis = torch.empty(B_DECODE, 1, dtype=torch.int32, device=meta_dev)
    picks = vis.new_empty(B_DECODE, 1, 512)
    row_cfg = dict(ix.indexer_config(B_DECODE, 1, HI, DI, N_POOL, 512), TOPK_SPLIT=0)
    start = len(recorded)
    if backend == "hip":
        scores = torch.empty(B_DECODE, 1, N_POOL, dtype=torch.float32, device=meta_dev)
        ix.topk_from_scores(scores, vis, 512, picks, row_cfg)
    else:
        scores = torch.empty(B_DECODE, 1, 8 * N_POOL, dtype=torch.float32, device=meta_dev)
        ix.topk_from_scores(scores, vis, 512, picks,
                            dict(ix.indexer_config(B_DECODE, 1, HI, DI, 8 * N_POOL, 512), TOPK_SPLIT=0))
    out.append(("topk_other_512",) + recorded[start])
    scores = torch.empty(B_DECODE, 1, 4 * N_POOL, dtype=torch.float32, device=meta_dev)
    start = len(recorded)
    ix.topk_from_scores(scores, vis, 512, picks, dict(ix.indexer_config(B_DECODE, 1, HI, DI, 4 * N_POOL, 512),
                                                      TOPK_ROW=4 * N_POOL, TOPK_SPLIT=0))
    out.append(("topk_row_32k_512",) + recorded[start])
    # the split top-k of a batch-1 decode step at 32K context (8258 pool entries): stage 1 over
    # 2048-entry segments for Flash's top-512 (stage 2 over 5 segments' candidates), 4096 for Pro's
    # top-1024 (3 segments). CUDA's config picks it there; ROCm's never does, forced here so that a
    # sweep forcing it builds
    for topk, seg in ((512, 2048), (1024, 4096)):
        scores = torch.empty(1, 1, 8258, dtype=torch.float32, device=meta_dev)
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
        q = torch.empty(B_DECODE, 1, HI, DI, dtype=torch.bfloat16, device=meta_dev)
        w = torch.empty(B_DECODE, 1, HI, dtype=torch.float32, device=meta_dev)
        keys = torch.empty(B_DECODE, n, DI, dtype=torch.bfloat16, device=meta_dev)
        cfg = ix.indexer_config(B_DECODE, 1, HI, DI, n, 512, backend=backend)
        assert cfg["TOPK_FUSED"] == (0 if backend == "hip" else default), cfg
        cfg["TOPK_FUSED"] = chunk
        start = len(recorded)
        ix.indexer_topk(q, w, keys, vis, 512, config=cfg)
        assert len(recorded) == start + 2 and recorded[-2][2]["TOPK_FUSED"] == 1, "fused: scores + stage 2"
        out += [(name,) + recorded[-2], (name + "_merge",) + recorded[-1]]

    def one(name, launcher, *args, **kw):
        start = len(recorded)
        launcher(*args, **kw)
        assert len(recorded) == start + 1, name
        out.append((name,) + recorded[-1])

    i32 = dict(dtype=torch.int32, device=meta_dev)
    bf16 = dict(dtype=torch.bfloat16, device=meta_dev)
    f32 = dict(dtype=torch.float32, device=meta_dev)
    # plan: decode (ring mode, one query slot) and a long concat-mode prefill chunk
    lengths, n_new = torch.empty(B_DECODE, **i32), torch.empty(B_DECODE, **i32)
    one("plan_decode", pl.plan, lengths, n_new, 1, 1, W, RING, False, 4, 16, 128, 136)
    one("plan_prefill", pl.plan, lengths[:4], n_new[:4], 8192, 1, W, RING, True, 4, 16, 128, 136)
    # cache writes: window ring rows (d = 512), CSA compressor rows (2 x 512), indexer rows (2 x 128)
    for name, C in (("cache_write_window", D), ("cache_write_csa_ring", 2 * D), ("cache_write_indexer_ring", 2 * DI)):
        one(name, cw.cache_write, torch.empty(B_DECODE, RING, C, **bf16), torch.empty(B_DECODE, 1, C, **bf16),
            torch.empty(B_DECODE, 1, **i32))
    # compressor emission: CSA (m = 4, overlap), HCA (m = 128), indexer keys (d = 128, m = 4, overlap)
    for name, d, m, overlap in (("compress_csa", D, 4, True), ("compress_hca", D, 128, False),
                                ("compress_indexer", DI, 4, True)):
        c = 2 if overlap else 1
        ring = torch.empty(B_DECODE, c * m + 8, c * d, **bf16)
        new = torch.empty(B_DECODE, 1, c * d, **bf16)
        one(name, cp.compress, ring, ring, new, new, torch.empty(B_DECODE, **i32), torch.empty(B_DECODE, 1, **i32),
            torch.empty(d, **f32), torch.empty(65536, 32, **f32), torch.empty(65536, 32, **f32),
            torch.empty(B_DECODE, N_POOL, d, **bf16), m, overlap, 1e-6)
    # mHC Sinkhorn: one decode token per row (hc_mult = 4), 20 iterations
    one("sinkhorn", sk.sinkhorn, torch.empty(B_DECODE, 1, 4, 4, **f32), 20, 1e-6)
    # routed experts of a batch-1 decode token at V4-Flash widths (top-6 of 256, 4096 x 2048)
    start = len(recorded)
    mg.moe_gemv(torch.empty(1, 4096, **bf16), torch.empty(1, 6, dtype=torch.int64, device=meta_dev),
                torch.empty(1, 6, **f32), torch.empty(256, 4096, 4096, **bf16), torch.empty(256, 4096, 2048, **bf16), 10.0)
    assert len(recorded) == start + 2, "moe_gemv: gate/up + down"
    out += [("moe_gate_up",) + recorded[-2], ("moe_down",) + recorded[-1]]
    # dense decode projections: q_b of one token, then 8 tokens (the most the op takes) in bf16
    for name, T in (("gemv_decode", 1), ("gemv_8_tokens", 8)):
        gv.gemv(torch.empty(T, 1, 1024, **bf16), torch.empty(1, 32768, 1024, **bf16))
        out.append((name,) + recorded[-1])
    return out


_TRITON_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32",
                  "torch.int32": "i32", "torch.int64": "i64", "torch.uint8": "u8"}


def _source(kernel, args, meta):
    """ASTSource specialised like a JIT launch of ``kernel(*args, **meta)``."""
    import torch
    import triton

    constexprs = {k: v for k, v in meta.items() if k not in ("num_warps", "num_stages")}
    signature, attrs = {}, {}
    values = dict(zip(kernel.arg_names, args))
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        v = values[name]
        if isinstance(v, torch.Tensor):
            signature[name] = "*" + _TRITON_DTYPES[str(v.dtype)]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            signature[name] = "i1"
        elif isinstance(v, int):
            if v == 1:
                signature[name] = "constexpr"
                constexprs[name] = 1
                continue
            signature[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            # Inductor types a Python float fp64 on CUDA/ROCm (Triton's JIT: fp32); the kernels
            # must compile with the stricter one, which is what a compiled model launches
            signature[name] = "fp64"
        else:
            raise TypeError(f"{name}: {type(v)}")
    return triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)


def _resources(compiled) -> dict:
    import re
    import tempfile

    import triton

    asm = compiled.asm
    if "cubin" in asm:
        cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
        if not cuobjdump.exists():
            return {}
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(asm["cubin"])
            f.flush()
            text = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True).stdout
        found = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
        return {"regs": int(found.get("REG", -1)), "stack_bytes": int(found.get("STACK", -1)),
                "shared_bytes": compiled.metadata.shared, "wgmma": asm["ptx"].count("wgmma.mma_async")}
    found = dict(re.findall(r"\.(vgpr_count|agpr_count|sgpr_count|vgpr_spill_count|sgpr_spill_count|"
                            r"private_segment_fixed_size):\s+(\d+)", asm.get("amdgcn", "")))
    return {k: int(v) for k, v in found.items()}


def _worker(target_names):
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget

    results = []
    for tname in target_names:
        target = GPUTarget(*TARGETS[tname])
        for name, kernel, args, meta in _launches("hip" if target.backend == "hip" else "cuda"):
            entry = {"target": tname, "kernel": name, "num_warps": meta.get("num_warps", 4),
                     "num_stages": meta.get("num_stages", 3),
                     "constexprs": {k: v for k, v in meta.items() if k.isupper()}}
            try:
                compiled = triton.compile(_source(kernel, args, meta), target=target,
                                          options={"num_warps": entry["num_warps"], "num_stages": entry["num_stages"]})
                entry["artifacts"] = {k: len(v) for k, v in compiled.asm.items()}
                entry["resources"] = _resources(compiled)
                entry["shared"] = compiled.metadata.shared
            except Exception as e:  # reported, the parent test fails with it
                entry["error"] = f"{type(e).__name__}: {e}"[:2000]
            results.append(entry)
    print(json.dumps(results))


@pytest.fixture(scope="module")
def compiled():
    results = run_worker(__file__, *TARGETS)
    for r in results:  # the report lands in the test log (-rA / on failure)
        print(r["target"], r["kernel"], r.get("resources"), r.get("error", ""))
    return {(r["target"], r["kernel"]): r for r in results}


ATTENTION = ["attention_decode", "attention_decode_split", "attention_tiny_fp32", "attention_fp32_decode",
             "attention_fp32_decode_split", "attention_fp32_prefill"]
KERNELS = ["attention_decode", "attention_decode_split", "attention_decode_combine",
           "attention_tiny_fp32", "attention_fp32_decode", "attention_fp32_decode_split",
           "attention_fp32_decode_combine", "attention_fp32_prefill", "indexer_scores", "topk_512", "topk_1024", "topk_other_512", "topk_row_32k_512",
           "topk_split1_512", "topk_split2_512", "topk_split1_1024", "topk_split2_1024",
           "indexer_fused_32k", "indexer_fused_32k_merge", "indexer_fused_128k", "indexer_fused_128k_merge",
           "plan_decode", "plan_prefill", "cache_write_window", "cache_write_csa_ring", "cache_write_indexer_ring",
           "compress_csa", "compress_hca", "compress_indexer", "sinkhorn", "moe_gate_up", "moe_down",
           "gemv_decode", "gemv_8_tokens"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("target", list(TARGETS))
def test_kernel_compiles(compiled, target, kernel):
    r = compiled[(target, kernel)]
    assert "error" not in r, r["error"]
    art = r["artifacts"]
    if target == "sm90":
        assert art.get("ptx", 0) > 0 and art.get("cubin", 0) > 0, art
    else:
        assert art.get("amdgcn", 0) > 0 and art.get("hsaco", 0) > 0, art


@pytest.mark.parametrize("target", list(TARGETS))
def test_decode_attention_does_not_spill(compiled, target):
    """The hot kernel's chosen configs were picked to keep acc [BLOCK_H, 512] in registers."""
    for kernel in ("attention_decode", "attention_decode_split"):
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


# attention_tiny_fp32 (a test-only D=64 fp32 config, never picked at V4 shapes) keeps 8 bytes
# of stack on sm_90 (two STL/LDL of loop-invariant scalars); every V4-shaped kernel has none.
# topk_row_32k_512 keeps part of a 32K-score row on the stack (sm_90) or spills SGPRs (gfx);
# on the H200 it is still 1.6x faster than the looped kernel (BENCHMARKS.md), so CUDA picks
# it at 128K context; the ROCm config keeps the looped kernel.
KNOWN_SPILLS = {("sm90", "attention_tiny_fp32"),
                ("sm90", "topk_row_32k_512"), ("gfx942", "topk_row_32k_512"), ("gfx950", "topk_row_32k_512")}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("target", list(TARGETS))
def test_kernel_does_not_spill(compiled, target, kernel):
    """Every kernel at its V4 launch config keeps its state in registers (no scratch / stack)."""
    if (target, kernel) in KNOWN_SPILLS:
        pytest.skip("known spill, measured and accepted (see KNOWN_SPILLS)")
    res = compiled[(target, kernel)]["resources"]
    if target == "sm90":
        if res:  # cuobjdump ships in Triton's wheel; absent -> nothing to check
            assert res["stack_bytes"] == 0, res
    else:
        assert res["vgpr_spill_count"] == 0 and res["sgpr_spill_count"] == 0, res
        assert res["private_segment_fixed_size"] == 0, res


if __name__ == "__main__":
    _worker(sys.argv[1:])
