"""The Gluon FP8-cache decode attention (``lowering/gluon/sparse_attention_fp8.py``) compiles for
sm_90 at V4-Flash decode shapes (B=64, H=64, D=512, W=128 window entries in one 128-entry page,
top-k 512 of an 8192-entry pool in 64-entry pages), 1 and 2 splits, FP8 modes 2 (FP8 window and
pool) and 1 (bf16 window rows, FP8 pool), with no GPU: registers without spills beyond the known
ones, shared memory within the sm_90 opt-in limit and what the kernel allocates, one warpgroup
scoring a block whole, wgmmas kept async, the decode in its own warps, the raw entry bytes
gathered by zero-filling cp.async and decoded by the PTX bit moves (``prmt``) of
``fp8_codec._e4m3x4_bf16``.

Same method as ``test_sparse_attention_sm90_cross_compile.py`` (``tests/cross_compile.py``): the
launcher runs on ``meta`` tensors, each launch is compiled by ``triton.compile`` from a
``GluonASTSource`` specialised as the JIT would, in a subprocess without ``TRITON_INTERPRET``.
"""
import re

import pytest

from cross_compile import (B_DECODE as B, D, H, K_CSA as K, N_POOL as NC, PAGE, ROPE, W, check_gluon_fits,
                           gluon_cross_compile, gluon_mma_tests)

# known stack bytes (at most this many): the decoder warps give their registers back (setmaxnreg down to 24)
# while they wait at the fork, so ptxas parks loop invariants computed before it (W + K, the shared memory base)
# on the stack, reloaded from L1 twice a block (sm_90 SASS); more with mode 1's window loads; none at 2 splits
SPILLS = {"split1": 16, "mode1_split1": 32}
CONFIGS = {"split1": dict(num_splits=1), "split2": dict(num_splits=2),  # FP8 mode 2
           "mode1_split1": dict(num_splits=1, mode=1), "mode1_split2": dict(num_splits=2, mode=1),
           # the pool's pages shared by the rows, picks then the dense prefix listed (``attention_sm90``)
           "paged_split1": dict(num_splits=1, paged=True)}


def explicit_smem(meta: dict) -> int:
    """The shared memory the kernel allocates (the compiler may add a little for layout conversions): q, the raw
    byte ring (a row's codes, rope and scale bytes), the decoded ring, P two deep, the rescale factors and the
    final row stats handed between the two MMA warpgroups."""
    n = meta["BLOCK_N"]
    return (H * D * 2 + meta["NUM_STAGES"] * n * (512 + 128 + meta["SCALE_BYTES"]) + meta["E_STAGES"] * n * D * 2
            + 2 * H * n * 2 + 4 * H * 4)


def _inputs(mode, paged=False):
    import torch

    from dsv4_ops.reference import fp8_cache as fp8

    meta = torch.device("meta")
    u8, bf16, i32 = (dict(dtype=t, device=meta) for t in (torch.uint8, torch.bfloat16, torch.int32))
    pool = torch.empty(fp8.KVLayout(D, ROPE, PAGE).shape(B, NC), **u8)
    if paged:
        from dsv4_ops.ops.attention_sm90 import shared_rows
        pool = shared_rows(pool.flatten(0, 1), B)
    if mode == 2:
        window = torch.empty(fp8.KVLayout(D, ROPE, W).shape(B, W), **u8)  # a ring of 128 entries, one page
    else:
        window = torch.empty(B, W, D, **bf16)
    return (torch.empty(B, 1, H, D, **bf16), window, torch.empty(B, 1, W, **i32), pool, torch.empty(B, 1, K + (NC if paged else 0), **i32),
            torch.empty(B, 1, **i32), torch.empty(H, dtype=torch.float32, device=meta), D ** -0.5)


def _launch(name):
    """The launches of config ``name`` (FP8 mode 2 unless it says mode 1) on meta tensors, and the shared
    memory the kernel allocates (worker side)."""
    from dsv4_ops.lowering.gluon import sparse_attention_fp8 as gf

    cfg = dict(CONFIGS[name])
    mode, paged = cfg.pop("mode", 2), cfg.pop("paged", False)
    _, launches = gf.gluon_fp8_launch(*_inputs(mode, paged), **cfg, picks=K if paged else None)
    return launches, {"explicit_smem": explicit_smem(launches[0][3])}


compiled = gluon_cross_compile(__file__, __name__, _launch, CONFIGS)
# the bf16 kernel's MMA partitions (the FP8 reader runs them too)
(test_scores_in_one_warpgroup, test_wgmma_not_serialized,
 test_stores_its_output_16_bytes_a_thread) = gluon_mma_tests(CONFIGS)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_compiles_without_spills(compiled, config):
    r = compiled[config]
    check_gluon_fits(r, max_stack=SPILLS.get(config, 0))
    # the explicit buffers are what the launcher budgets; the compiler's scratch must not add much
    assert r["explicit_smem"] <= r["resources"]["shared"] <= r["explicit_smem"] + 4096, (r["explicit_smem"], r)


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
    assert n > 0 and sum(res["cp_async_zfill"].values()) == n, res
    assert res["cp_async"].get("ca16", 0) + res["cp_async"].get("cg16", 0) > 0, res
    per_decode = 2 * 7 * r["meta"]["BLOCK_N"] * 64 // 256 // 4
    assert res["prmt"] >= 2 * per_decode, res


@pytest.mark.parametrize("config", list(CONFIGS))
def test_decodes_in_its_own_warps(compiled, config):
    """The reader is warp-specialised: three 4-warp partitions, the decoder's registers set to ``DECODER_REGS``, the
    helper MMA warpgroup's to ``HELPER_REGS`` and the scorer's to more (``setmaxnreg``)."""
    from dsv4_ops.lowering.gluon import sparse_attention_fp8 as gf

    r = compiled[config]
    assert "error" not in r, r["error"]
    regs, meta = sorted({int(n) for _, n in r["resources"]["setmaxnreg"]}), r["meta"]
    assert (meta["HELPER_REGS"], meta["DECODER_REGS"], meta["DECODER_WARPS"]) == (
        gf.HELPER_REGS, gf.DECODER_REGS, gf.DECODER_WARPS), meta
    assert meta["num_warps"] == 4 and gf.DECODER_REGS in regs and gf.HELPER_REGS in regs, r
    scorer = max(regs)
    assert scorer > gf.HELPER_REGS, regs


def test_split_launch_uses_combine(compiled):
    assert compiled["split1"]["launches"] == 1 and compiled["split2"]["launches"] == 2
    assert compiled["mode1_split1"]["launches"] == 1 and compiled["mode1_split2"]["launches"] == 2
    assert compiled["split2"]["grid"] == [B, 2]
    assert compiled["split1"]["meta"]["FP8"] == 2 and compiled["mode1_split1"]["meta"]["FP8"] == 1


def test_unsupported_arguments_are_named():
    pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")
    import torch

    from dsv4_ops.lowering.gluon import sparse_attention_fp8 as gf

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

