"""The Gluon FP8-cache decode attention (``lowering/gluon/sparse_attention_fp8.py``) compiles for
sm_90 at V4-Flash decode shapes (B=64, H=64, D=512, W=128 window entries in one 128-entry page,
top-k 512 of an 8192-entry pool in 64-entry pages), 1 and 2 splits, FP8 modes 2 (FP8 window and
pool) and 1 (bf16 window rows, FP8 pool), with no GPU: registers without spills, shared memory
within the sm_90 opt-in limit, the scores split across the two warpgroups (wgmma N = BLOCK_N / 2,
one copy of each instruction: computing the scores twice would double the count or show
N = BLOCK_N), the raw entry bytes gathered by zero-filling cp.async and decoded by the PTX bit
moves (``prmt``) of ``fp8_codec._e4m3x4_bf16``.

Same method as ``test_gluon_cross_compile.py`` (whose small helpers are copied here): the
launcher runs on ``meta`` tensors, each launch is compiled by ``triton.compile`` from a
``GluonASTSource`` specialised as the JIT would, in a subprocess without ``TRITON_INTERPRET``.
"""
import json
import os
import re
import sys
from pathlib import Path

import pytest
from compiled_worker import run_worker

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_gluon_cross_compile import (  # noqa: E402
    _register_usage, _source, _wgmma_serialized, check_ws_output_stores, global_stores)

ROOT = Path(__file__).resolve().parents[1]
B, H, D, ROPE, W, K, NC, PAGE = 64, 64, 512, 64, 128, 512, 8192, 64
SMEM_LIMIT = 232448
# known stack bytes (at most this many). v0's defaults: none. ws: the decoder warps give their registers
# back (setmaxnreg down to 24) while they wait at the fork, so ptxas parks loop invariants computed before
# it (W + K, the shared memory base) on the stack: 16 B, reloaded from L1 twice a block (sm_90 SASS,
# session 22), 24-32 B with the deeper ring and mode 1's window loads; none at 2 splits
SPILLS = {"split2_n64": 16, "split1_onestore": 8, "ws_split1": 16, "ws_split1_per_block": 16, "ws_split1_s3_e2": 24,
          "ws_mode1_split1": 32, "ws_split1_swizzled": 16}
CONFIGS = {
    # variant v0 (the session-13 reader, decode in the MMA warps)
    "split1": dict(variant="v0", num_splits=1),  # 32-row blocks x 4 stages, two decoded buffers
    "split2": dict(variant="v0", num_splits=2),
    # 64-row blocks x 2 stages, one decoded buffer (a sweep config): at splits 2 it spills 16 B
    # of stack (checked as such: SPILLS)
    "split1_n64": dict(variant="v0", num_splits=1, block_n=64, num_stages=2),
    "split2_n64": dict(variant="v0", num_splits=2, block_n=64, num_stages=2),
    "mode1_split1": dict(variant="v0", num_splits=1, mode=1),
    "mode1_split2": dict(variant="v0", num_splits=2, mode=1),
    # the decode's one-store variant (a sweep option: fewer barriers, a few spilled registers)
    "split1_onestore": dict(variant="v0", num_splits=1, one_store=1),
    # variant ws (sparse_attention_fp8_ws.py): decoder warps beside the MMA warps; its default
    # (32-row blocks, 2 byte blocks, 3 decoded blocks, 16 rows decoded at once in mode 2, a 64-channel
    # block at a time in mode 1), the per-block decode in mode 2, the deepest rings that fit
    "ws_split1": dict(num_splits=1, variant="ws"),
    "ws_split2": dict(num_splits=2, variant="ws"),
    "ws_mode1_split1": dict(num_splits=1, variant="ws", mode=1),
    "ws_split1_per_block": dict(num_splits=1, variant="ws", one_store=0),
    # a deeper byte ring (3 x 3 decoded buffers no longer fit beside session 24's two P buffers: 235,264 B)
    "ws_split1_s3_e2": dict(num_splits=1, variant="ws", num_stages=3, e_bufs=2),
    # the byte ring's rows swizzled against the one-store decode's bank conflicts (a measured option)
    "ws_split1_swizzled": dict(num_splits=1, variant="ws", codes_swizzle=1),
}


def _resources(compiled) -> dict:
    res = {"shared": compiled.metadata.shared}
    ptx = compiled.asm["ptx"]
    res["wgmma_n"] = sorted({int(n) for n in re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx)})
    res["wgmma_count"] = len(re.findall(r"wgmma\.mma_async", ptx))
    # cp.async by size: .cg 16 B (the codes), .ca 4 / 8 B (rope, scales); with a src-size register
    # (0 for masked lanes: zero fill)
    res["cp_async"] = {}
    res["cp_async_zfill"] = 0
    for m in re.finditer(r"cp\.async\.(c[ag])\.shared\.global[^;]*\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-f]+|\d+)(,\s*%r)?",
                         ptx):
        size = int(m.group(2), 0)
        res["cp_async"][str(size)] = res["cp_async"].get(str(size), 0) + 1
        res["cp_async_zfill"] += m.group(3) is not None
    res["prmt"] = len(re.findall(r"prmt\.b32", ptx))
    res["bar_sync"] = len(re.findall(r"bar\.sync|barrier\.sync", ptx))
    res["setmaxnreg_inc"] = sorted({int(n) for n in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx)})
    res["setmaxnreg"] = sorted({int(n) for n in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)})
    res["st_global"] = global_stores(ptx)
    serialized = _wgmma_serialized(ptx)
    if serialized is not None:
        res["wgmma_serialized"] = serialized
    res.update(_register_usage(compiled))
    return res


def _inputs(mode):
    import torch

    sys.path.insert(0, str(ROOT))
    from dsv4_ops.reference import fp8_cache as fp8

    meta = torch.device("meta")
    u8, bf16, i32 = (dict(dtype=t, device=meta) for t in (torch.uint8, torch.bfloat16, torch.int32))
    pool = torch.empty(fp8.KVLayout(D, ROPE, PAGE).shape(B, NC), **u8)
    if mode == 2:
        window = torch.empty(fp8.KVLayout(D, ROPE, W).shape(B, W), **u8)  # a ring of 128 entries, one page
    else:
        window = torch.empty(B, W, D, **bf16)
    return (torch.empty(B, 1, H, D, **bf16), window, torch.empty(B, 1, W, **i32), pool, torch.empty(B, 1, K, **i32),
            torch.empty(B, 1, **i32), torch.empty(H, dtype=torch.float32, device=meta), D ** -0.5)


def _worker(names):
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget

    sys.path.insert(0, str(ROOT))
    from lowering.gluon import sparse_attention_fp8 as gf

    target = GPUTarget("cuda", 90, 32)
    results = []
    for name in names:
        cfg = dict(CONFIGS[name])
        mode = cfg.pop("mode", 2)
        _, launches = gf.gluon_fp8_launch(*_inputs(mode), **cfg)
        kernel, grid, args, meta = launches[0]
        entry = {"config": name, "meta": dict(meta), "grid": list(grid), "launches": len(launches),
                 "explicit_smem": gf.fp8_smem_bytes(meta["BLOCK_N"], meta["NUM_STAGES"],
                                                    meta.get("E_BUFS", meta.get("E_STAGES")), cfg.get("variant", "v0"))}
        try:
            compiled = triton.compile(_source(kernel, args, meta, gluon=True), target=target,
                                      options={"num_warps": meta["num_warps"]})
            entry["resources"] = _resources(compiled)
        except Exception as e:  # reported; the parent test fails with it
            entry["error"] = f"{type(e).__name__}: {e}"[:3000]
        results.append(entry)
    print(json.dumps(results))


@pytest.fixture(scope="module")
def compiled():
    pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")
    results = run_worker(__file__, *CONFIGS)
    for r in results:  # lands in the test log (-rA / on failure)
        print(r["config"], r["meta"], r.get("resources"), r.get("error", ""))
    return {r["config"]: r for r in results}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_compiles_without_spills(compiled, config):
    r = compiled[config]
    assert "error" not in r, r["error"]
    res = r["resources"]
    assert res["shared"] <= SMEM_LIMIT, res
    # the explicit buffers are what the launcher budgets; the compiler's scratch must not add much
    assert r["explicit_smem"] <= res["shared"] <= r["explicit_smem"] + 4096, (r["explicit_smem"], res)
    if "regs" in res:  # cuobjdump ships in Triton's wheel; absent -> nothing to check
        assert 0 < res["regs"] <= 255, res
        assert res["stack"] <= SPILLS.get(config, 0) and res["local"] in (0, -1), res


@pytest.mark.parametrize("config", [c for c in CONFIGS if not c.startswith("ws")])
def test_scores_split_across_warpgroups(compiled, config):
    """Two wgmma shapes: the scores at N = BLOCK_N / 2 (each warpgroup its own columns; warps
    [8, 1] would give N = BLOCK_N, and both warpgroups computing them) and P @ rows at N = 256;
    one copy of each per block: D / 16 score steps + BLOCK_N / 16 P @ rows steps."""
    r = compiled[config]
    assert "error" not in r, r["error"]
    res, block_n = r["resources"], r["meta"]["BLOCK_N"]
    assert res["wgmma_n"] == sorted({block_n // 2, D // 2}), res
    assert res["wgmma_count"] == D // 16 + block_n // 16, res


@pytest.mark.parametrize("config", list(CONFIGS))
def test_bytes_by_zero_filling_cp_async_decoded_by_bit_moves(compiled, config):
    """The raw entry bytes come by cp.async with a src-size register (masked lanes zero-filled:
    a masked row decodes to exact zeros, never stale bytes), the codes in 16-byte copies; the
    e4m3 codes are decoded by ``prmt`` (2 a 4-code word; 7 blocks x BLOCK_N x 64 codes / 256
    threads a block, at least the prologue's and the loop's copy)."""
    r = compiled[config]
    assert "error" not in r, r["error"]
    res = r["resources"]
    n = sum(res["cp_async"].values())
    assert n > 0 and res["cp_async_zfill"] == n, res
    assert res["cp_async"].get("16", 0) > 0, res
    per_decode = 2 * 7 * r["meta"]["BLOCK_N"] * 64 // 256 // 4
    assert res["prmt"] >= 2 * per_decode, res


@pytest.mark.parametrize("config", [c for c in CONFIGS if c.startswith("ws")])
def test_ws_scores_in_one_warpgroup(compiled, config):
    """ws runs the bf16 ws kernel's MMA partitions: one warpgroup scores a block whole (N = BLOCK_N) and each
    issues P @ rows over its 256 channels: D / 16 score steps + twice BLOCK_N / 16 P @ rows steps."""
    r = compiled[config]
    assert "error" not in r, r["error"]
    res, block_n = r["resources"], r["meta"]["BLOCK_N"]
    assert res["wgmma_n"] == sorted({block_n, D // 2}), res
    assert res["wgmma_count"] == D // 16 + 2 * (block_n // 16), res


@pytest.mark.parametrize("config", [c for c in CONFIGS if c != "split1_onestore"])
def test_wgmma_not_serialized(compiled, config):
    """ptxas keeps the wgmmas async (``_wgmma_serialized``: no C7512/C7514/C7515). v0's one-store decode (a sweep
    option, routed nowhere) is serialized: first seen in session 24, when this check began."""
    res = compiled[config]["resources"]
    if "wgmma_serialized" not in res:
        pytest.skip("no ptxas in this Triton wheel")
    assert res["wgmma_serialized"] is False, res


@pytest.mark.parametrize("config", [c for c in CONFIGS if c.startswith("ws")])
def test_ws_decodes_in_its_own_warps(compiled, config):
    """ws is warp-specialised: three 4-warp partitions, the decoder's registers set to ``DECODER_REGS``, the helper
    MMA warpgroup's to ``HELPER_REGS`` and the scorer's to more (``setmaxnreg``), within the register file; v0's
    kernel has no partitions."""
    from lowering.gluon import sparse_attention_fp8_ws as fp8_ws

    r = compiled[config]
    assert "error" not in r, r["error"]
    regs = r["resources"]["setmaxnreg"]
    assert r["meta"]["HELPER_REGS"] == fp8_ws.HELPER_REGS and r["meta"]["Q_REG_COLS"] == fp8_ws.Q_REG_COLS, r["meta"]
    assert r["meta"]["DIAG_NO_DECODE"] == 0 and r["meta"]["DIAG_NO_COPY"] == 0, r["meta"]  # timing switches: off
    assert r["meta"]["num_warps"] == 4 and r["meta"]["DECODER_REGS"] in regs and fp8_ws.HELPER_REGS in regs, r
    scorer = max(regs)
    assert scorer > fp8_ws.HELPER_REGS, regs
    assert compiled["split1"]["resources"]["setmaxnreg_inc"] == []


@pytest.mark.parametrize("config", [c for c in CONFIGS if c.startswith("ws")])
def test_ws_stores_its_output_16_bytes_a_thread(compiled, config):
    """The bf16 ws kernel's output store (``check_ws_output_stores``): the FP8 reader runs its MMA partitions."""
    check_ws_output_stores(compiled[config])


def test_split_launch_uses_combine(compiled):
    assert compiled["split1"]["launches"] == 1 and compiled["split2"]["launches"] == 2
    assert compiled["split2"]["grid"] == [B, 2]
    assert compiled["split1"]["meta"]["FP8"] == 2 and compiled["mode1_split1"]["meta"]["FP8"] == 1
    assert compiled["split1"]["meta"]["E_BUFS"] == 2 and compiled["split1_n64"]["meta"]["E_BUFS"] == 1


def test_unsupported_arguments_are_named():
    pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")
    import torch

    sys.path.insert(0, str(ROOT))
    from lowering.gluon import sparse_attention_fp8 as gf

    q, window, kv_idx, pool, cmp_idx, cmp_len, sink, scale = _inputs(2)
    float_pool = torch.empty(B, NC, D, dtype=torch.bfloat16, device="meta")
    cases = [((q.float(), window, kv_idx, pool), "q must be bf16"),
             ((q[:, :, :32], window, kv_idx, pool), "H (q.shape[2])"),
             ((q, window, kv_idx, float_pool), "cmp must be an FP8 page cache"),
             ((q, window.float()[..., 0], kv_idx, pool), "kv must be"),
             ((q, window[..., :576], kv_idx, pool), "kv entries must be 584 bytes"),
             # a token's pool past 2^31 bytes (the decoder's 32-bit offsets): 2^26 entries of 584 B
             ((q, window, kv_idx, torch.empty(B, 2**20, PAGE, 584, dtype=torch.uint8, device="meta")),
              "the reader addresses them in 32 bits")]
    for (qq, kv, ki, cmp), msg in cases:
        with pytest.raises(ValueError, match=re.escape(msg)):
            gf.gluon_fp8_launch(qq, kv, ki, cmp, cmp_idx, cmp_len, sink, scale)


if __name__ == "__main__":
    _worker(sys.argv[1:])
