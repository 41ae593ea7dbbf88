"""The Gluon bf16 decode attention (``lowering/gluon/sparse_attention.py``) compiles for sm_90 at
V4-Flash decode shapes (B=64, H=64, D=512, W=128, top-k 512, 8192-entry pool), 1 and 2 splits,
with no GPU: registers without spills, shared memory within the sm_90 opt-in limit, wgmmas kept
async, and the point of the kernel -- the rows are gathered by a producer partition that arms
mbarriers, and one warpgroup computes a block's scores whole.

The launcher runs on ``meta`` tensors; each launch is compiled with ``triton.compile`` from a
``GluonASTSource`` specialised the way the JIT would (pointers 16-byte aligned, ints == 1 as
constants, ints divisible by 16 marked so), in a subprocess without ``TRITON_INTERPRET``
(``tests/cross_compile.py``: the method and the PTX / cubin counts read here).
"""
import pytest

from cross_compile import (B_DECODE as B, D, H, K_CSA as K, N_POOL as NC, PAGE, RING, W, check_gluon_fits,
                           gluon_cross_compile, gluon_mma_tests)

# paged: the pool is pages shared by the rows (stride 0 between them), the picks then the dense prefix listed as
# physical entries (what ``attention_sm90`` hands the kernel for a block table)
CONFIGS = {"split1": dict(num_splits=1), "split2": dict(num_splits=2), "paged_split1": dict(num_splits=1, paged=True)}


def _launch(name):
    """The launches of config ``name`` at V4-Flash decode shapes, on meta tensors (worker side)."""
    import torch

    from dsv4_ops.lowering.gluon import sparse_attention as ga

    meta_dev = torch.device("meta")
    bf16 = dict(dtype=torch.bfloat16, device=meta_dev)
    i32 = dict(dtype=torch.int32, device=meta_dev)
    from dsv4_ops.ops.attention_sm90 import shared_rows

    cfg = dict(CONFIGS[name])
    paged = cfg.pop("paged", False)
    cmp = shared_rows(torch.empty(B * NC // PAGE, PAGE, D, **bf16), B) if paged else torch.empty(B, NC, D, **bf16)
    inputs = (torch.empty(B, 1, H, D, **bf16), torch.empty(B, RING, D, **bf16), torch.empty(B, 1, W, **i32),
              cmp, torch.empty(B, 1, K + (NC if paged else 0), **i32), torch.empty(B, 1, **i32),
              torch.empty(H, dtype=torch.float32, device=meta_dev), D ** -0.5)
    _, launches = ga.gluon_launch(*inputs, **cfg, picks=K if paged else None)
    return launches, {}


compiled = gluon_cross_compile(__file__, __name__, _launch, CONFIGS)
# the bf16 kernel's MMA partitions (the FP8 reader runs them too)
(test_scores_in_one_warpgroup, test_wgmma_not_serialized,
 test_stores_its_output_16_bytes_a_thread) = gluon_mma_tests(CONFIGS)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_compiles_without_spills(compiled, config):
    check_gluon_fits(compiled[config])


@pytest.mark.parametrize("config", list(CONFIGS))
def test_gather_is_cp_async_with_zero_fill(compiled, config):
    """Rows are gathered by 16-byte cp.async whose src-size is a register (0 for masked lanes:
    the ring slot is zero-filled, so a masked row contributes 0, never stale data)."""
    res = compiled[config]["resources"]
    assert res["cp_async_cg"] > 0 and res["cp_async_zfill"].get("cg16", 0) == res["cp_async_cg"], res


@pytest.mark.parametrize("config", list(CONFIGS))
def test_gathers_in_a_producer_partition(compiled, config):
    """The copies are published on mbarriers by the producer partition: each thread's
    ``cp.async.mbarrier.arrive.noinc`` lands with its copies and no thread waits for them (no
    ``cp.async.wait_group``). The registers are split between the three 4-warp partitions: the
    producer's ``setmaxnreg`` to ``PRODUCER_REGS``, the helper's to ``HELPER_REGS``, the scorer's (the
    default partition) to at most the rest (no spills: ``test_compiles_without_spills``)."""
    from dsv4_ops.lowering.gluon import sparse_attention as ga
    r = compiled[config]
    assert "error" not in r, r["error"]
    res, meta = r["resources"], r["meta"]
    assert (meta["PRODUCER_REGS"], meta["PRODUCER_WARPS"], meta["HELPER_REGS"]) == (
        ga.PRODUCER_REGS, ga.PRODUCER_WARPS, ga.HELPER_REGS), meta
    assert res["cp_mbarrier_arrive_noinc"] == 1 and res["cp_wait"] == 0, res
    regs = {int(n) for _, n in res["setmaxnreg"]}  # (kind, regs) pairs, as JSON lists
    assert ga.PRODUCER_REGS in regs and ga.HELPER_REGS in regs, res
    scorer = [int(n) for kind, n in res["setmaxnreg"] if kind == "dec" and int(n) > ga.HELPER_REGS]
    assert meta["num_warps"] == ga.NUM_WARPS == 4 and len(scorer) == 1, res
    assert 4 * 32 * (scorer[0] + ga.HELPER_REGS) + ga.PRODUCER_WARPS * 32 * ga.PRODUCER_REGS <= 65536, res


def test_split_launch_uses_combine(compiled):
    assert compiled["split1"]["launches"] == 1 and compiled["split2"]["launches"] == 2
    assert compiled["split2"]["grid"] == [B, 2]

