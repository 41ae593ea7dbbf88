"""The FP8-cache variants of the Triton kernels compile for Hopper (sm_90) and ROCm (gfx942,
gfx950) at DeepSeek-V4 shapes with their launchers' exact configs, without a GPU (the method of
``test_triton_cross_compile.py``, whose helpers this reuses): the quantising window write and
compressor epilogues (KV layout, Hadamard-rotated indexer keys), sparse attention reading an FP8
pool (concat mode) and FP8 window + pool (decode, also split-KV), and the indexer scores over
FP8 keys. ROCm decodes with integer ops only (no native e4m3 type needed); sm_90 with the PTX
bit moves (``fp8_codec.e4m3_to``, ``E4M3_HW`` 4)."""
import json
import os
import sys
from pathlib import Path

import pytest
from compiled_worker import run_worker

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_triton_cross_compile import TARGETS, _resources, _source  # noqa: E402

B, H, D, ROPE, W, K, N_POOL, PAGE = 64, 64, 512, 64, 128, 512, 8192, 64
HI, DI = 64, 128


def _launches(backend: str):
    import torch

    sys.path.insert(0, str(ROOT))
    from dsv4_ops.reference import fp8_cache as fp8
    from dsv4_ops.lowering.triton import cache_write as cw
    from dsv4_ops.lowering.triton import compress as cp
    from dsv4_ops.lowering.triton import indexer as ix
    from dsv4_ops.lowering.triton import sparse_attention as sa

    recorded = []

    def record(kernel, spec):
        if spec is not None:
            recorded.append((kernel, spec.args, spec.meta))

    sa.launch = ix.launch = cw.launch = cp.launch = record
    meta = dict(device="meta")
    u8, i32, bf16, f32 = (dict(dtype=t, **meta) for t in (torch.uint8, torch.int32, torch.bfloat16, torch.float32))
    kv_lay, win_lay, key_lay = fp8.KVLayout(D, ROPE, PAGE), fp8.KVLayout(D, ROPE, W), fp8.IndexerLayout(DI, PAGE)
    window = torch.empty(win_lay.shape(B, W), **u8)
    pool = torch.empty(kv_lay.shape(B, N_POOL), **u8)
    keys = torch.empty(key_lay.shape(B, N_POOL), **u8)
    out = []

    def take(name, n_before):
        out.extend((f"{name}{'' if i == 0 else '_combine'}",) + r for i, r in enumerate(recorded[n_before:]))

    n = len(recorded)
    cw.cache_write(window, torch.empty(B, 1, D, **bf16), torch.empty(B, 1, **i32))  # float path: not fp8
    del recorded[n:]
    cw.launch(None, cw.fp8_cache_write_launch(window, torch.empty(B, 1, D, **bf16), torch.empty(B, 1, **i32), ROPE,
                                              win_lay.data_bytes, win_lay.scale_bytes))
    recorded[-1] = (cw.fp8_cache_write_kernel,) + recorded[-1][1:]
    take("fp8_cache_write_window", n)
    for name, d, m, overlap, dest in (("fp8_compress_csa", D, 4, True, pool), ("fp8_compress_hca", D, 128, False, pool),
                                      ("fp8_compress_indexer_keys", DI, 4, True, keys)):
        c = 2 if overlap else 1
        ring, new = torch.empty(B, c * m + 8, c * d, **f32), torch.empty(B, 1, c * d, **f32)
        n = len(recorded)
        cp.compress(ring, ring, new, new, torch.empty(B, **i32), torch.empty(B, 1, **i32), torch.empty(d, **f32),
                    torch.empty(65536, ROPE // 2, **f32), torch.empty(65536, ROPE // 2, **f32), dest, m, overlap, 1e-6)
        take(name, n)
    for name, kv, S, splits in (("fp8_attention_decode", window, 1, 1), ("fp8_attention_decode_split", window, 1, None),
                                ("fp8_attention_prefill_float_window", torch.empty(1, W + 64, D, **bf16), 64, 1)):
        b = 1 if splits is None or S > 1 else B
        q = torch.empty(b, S, H, D, **bf16)
        n = len(recorded)
        cfg = sa.attention_config(b, S, H, D, W + K, num_splits=splits, backend=backend, dtype=torch.bfloat16,
                                  fp8=2 if kv.dtype == torch.uint8 else 1)
        sa.sparse_attention(q, kv[:b], torch.empty(b, S, W, **i32), pool[:b], torch.empty(b, S, K, **i32),
                            torch.empty(b, S, **i32), torch.empty(H, **f32), D**-0.5, config=cfg)
        take(name, n)
    n = len(recorded)
    # bf16 queries on sm_90 score FP8 keys with an e4m3 x e4m3 tensor-core dot (FP8_DOT, chosen at launch from the
    # device: forced here, the tensors are on "meta"); ROCm decodes both sides
    ix.indexer_scores(torch.empty(B, 1, HI, DI, **bf16), torch.empty(B, 1, HI, **f32), keys, torch.empty(B, 1, **i32),
                      config=dict(ix.indexer_config(B, 1, HI, DI, N_POOL, K, backend=backend),
                                  FP8_DOT=int(backend == "cuda")))
    take("fp8_indexer_scores", n)
    # the fused top-k over FP8 keys at batch 64 x 32K (Flash top-512): the scores kernel with stage 1 fused
    # in (2048-entry chunks, forced: no config fuses FP8 keys, measured slower; a sweep may), then stage 2
    cfg = dict(ix.indexer_config(B, 1, HI, DI, N_POOL, K, backend=backend), TOPK_FUSED=2048)
    n = len(recorded)
    ix.indexer_topk(torch.empty(B, 1, HI, DI, **bf16), torch.empty(B, 1, HI, **f32), keys, torch.empty(B, 1, **i32), K,
                    config=cfg)
    assert len(recorded) == n + 2 and recorded[n][2]["TOPK_FUSED"] == 1 and recorded[n][2]["KEYS_FP8"] == 2
    out.append(("fp8_indexer_fused",) + recorded[n])
    return out


def _worker(target_names):
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget

    results = []
    for tname in target_names:
        target = GPUTarget(*TARGETS[tname])
        for name, kernel, args, meta in _launches("hip" if target.backend == "hip" else "cuda"):
            entry = {"target": tname, "kernel": name, "num_stages": meta.get("num_stages", 3),
                     "constexprs": {k: v for k, v in meta.items() if k.isupper()}}
            try:
                compiled = triton.compile(_source(kernel, args, meta), target=target,
                                          options={"num_warps": meta.get("num_warps", 4),
                                                   "num_stages": meta.get("num_stages", 3)})
                entry["artifacts"] = {k: len(v) for k, v in compiled.asm.items()}
                entry["resources"] = _resources(compiled)
                entry["shared"] = compiled.metadata.shared
                entry["fp8_mma"] = "e4m3.e4m3" in compiled.asm.get("ptx", "")  # wgmma ... .f32.e4m3.e4m3
                entry["e4m3_convert"] = "cvt.rn.satfinite.e4m3x2.f32" in compiled.asm.get("ptx", "")
            except Exception as e:  # reported, the parent test fails with it
                entry["error"] = f"{type(e).__name__}: {e}"[:2000]
            results.append(entry)
    print(json.dumps(results))


@pytest.fixture(scope="module")
def compiled():
    results = run_worker(__file__, *TARGETS, timeout=900)
    for r in results:
        print(r["target"], r["kernel"], r.get("resources"), r.get("error", ""))
    return {(r["target"], r["kernel"]): r for r in results}


KERNELS = ["fp8_cache_write_window", "fp8_compress_csa", "fp8_compress_hca", "fp8_compress_indexer_keys",
           "fp8_attention_decode", "fp8_attention_decode_split", "fp8_attention_decode_split_combine",
           "fp8_attention_prefill_float_window", "fp8_indexer_scores", "fp8_indexer_fused"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("target", list(TARGETS))
def test_fp8_kernel_compiles(compiled, target, kernel):
    r = compiled[(target, kernel)]
    assert "error" not in r, r["error"]
    art = r["artifacts"]
    if target == "sm90":
        assert art.get("ptx", 0) > 0 and art.get("cubin", 0) > 0, art
    else:
        assert art.get("amdgcn", 0) > 0 and art.get("hsaco", 0) > 0, art


def test_fp8_indexer_scores_run_on_fp8_tensor_cores(compiled):
    """sm_90: the scores over FP8 keys are e4m3 x e4m3 wgmma (no decode of keys or queries), with
    the queries' codes from the hardware convert, and only there: the fused path (FP8_DOT off, as on
    ROCm) keeps the bf16 dot and the integer encode."""
    assert compiled[("sm90", "fp8_indexer_scores")]["constexprs"]["FP8_DOT"] == 1
    assert compiled[("sm90", "fp8_indexer_scores")]["fp8_mma"]
    assert compiled[("sm90", "fp8_indexer_scores")]["e4m3_convert"]
    assert not compiled[("sm90", "fp8_indexer_fused")]["fp8_mma"]
    assert not compiled[("sm90", "fp8_indexer_fused")]["e4m3_convert"]


@pytest.mark.parametrize("target", list(TARGETS))
def test_fp8_fused_indexer_does_not_spill(compiled, target):
    """The fused top-k's scores kernel over FP8 keys keeps its chunk's register row in registers."""
    res = compiled[(target, "fp8_indexer_fused")]["resources"]
    if target == "sm90":
        if res:  # cuobjdump ships in Triton's wheel; absent -> nothing to check
            assert res["stack_bytes"] == 0, res
    else:
        assert res["vgpr_spill_count"] == 0 and res["sgpr_spill_count"] == 0, res
        assert res["private_segment_fixed_size"] == 0, res


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("target", list(TARGETS))
def test_fp8_kernel_fits_shared_memory(compiled, target, kernel):
    """Every FP8 kernel's launch config fits one program's shared memory (a kernel over it
    compiles but raises OutOfResources at launch). The FP8 reads' byte gathers are pipelined
    too: at D = 512 the bf16 attention config's 4 stages asked 240 KB on sm_90 (found on the
    H200), so the FP8 attention config takes fewer, by ``attention_smem_bytes(..., fp8=FP8)``,
    which bounds what the compiler asks."""
    from dsv4_ops.lowering.triton import sparse_attention as sa

    r = compiled[(target, kernel)]
    assert "error" not in r, r["error"]
    assert r["shared"] <= sa.SMEM_LIMIT["hip" if TARGETS[target][0] == "hip" else "cuda"], r
    if kernel.startswith("fp8_attention") and not kernel.endswith("combine"):
        c = r["constexprs"]
        cfg = dict(BLOCK_D=c["BLOCK_D"], BLOCK_H=c["BLOCK_H"], BLOCK_N=c["BLOCK_N"], num_stages=r["num_stages"])
        assert r["shared"] <= sa.attention_smem_bytes(cfg, 2, fp8=c["FP8"]), r


if __name__ == "__main__":
    _worker(sys.argv[1:])
