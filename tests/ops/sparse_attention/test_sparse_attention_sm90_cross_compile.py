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
import sys

import pytest

from cross_compile import (B_DECODE as B, D, H, K_CSA as K, N_POOL as NC, RING, SM90_SMEM_LIMIT as SMEM_LIMIT, W,
                           check_gluon_output_stores, check_gluon_scores_in_one_warpgroup, check_gluon_wgmma_async,
                           compile_in_worker, gluon_worker)

CONFIGS = {"split1": dict(num_splits=1), "split2": dict(num_splits=2)}


def _launch(name):
    """The launches of config ``name`` at V4-Flash decode shapes, on meta tensors (worker side)."""
    import torch

    from dsv4_ops.lowering.gluon import sparse_attention as ga

    meta_dev = torch.device("meta")
    bf16 = dict(dtype=torch.bfloat16, device=meta_dev)
    i32 = dict(dtype=torch.int32, device=meta_dev)
    inputs = (torch.empty(B, 1, H, D, **bf16), torch.empty(B, RING, D, **bf16), torch.empty(B, 1, W, **i32),
              torch.empty(B, NC, D, **bf16), torch.empty(B, 1, K, **i32), torch.empty(B, 1, **i32),
              torch.empty(H, dtype=torch.float32, device=meta_dev), D ** -0.5)
    _, launches = ga.gluon_launch(*inputs, **CONFIGS[name])
    return launches, {}


@pytest.fixture(scope="module")
def compiled():
    pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")
    return compile_in_worker(__file__, *CONFIGS, key=("config",))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_compiles_without_spills(compiled, config):
    r = compiled[config]
    assert "error" not in r, r["error"]
    res = r["resources"]
    assert res["shared"] <= SMEM_LIMIT, res
    if "regs" in res:  # cuobjdump ships in Triton's wheel; absent -> nothing to check
        assert 0 < res["regs"] <= 255, res
        assert res["stack"] == 0 and res["local"] in (0, -1), res


@pytest.mark.parametrize("config", list(CONFIGS))
def test_scores_in_one_warpgroup(compiled, config):
    """One warpgroup scores a block whole, each issues P @ rows over its 256 channels."""
    check_gluon_scores_in_one_warpgroup(compiled[config])


@pytest.mark.parametrize("config", list(CONFIGS))
def test_wgmma_not_serialized(compiled, config):
    """ptxas keeps the async wgmmas async (no C7512/C7514/C7515: the score steps stay one group)."""
    check_gluon_wgmma_async(compiled[config])


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


@pytest.mark.parametrize("config", list(CONFIGS))
def test_stores_its_output_16_bytes_a_thread(compiled, config):
    """Staged in shared memory, stored a row a warp (``check_gluon_output_stores``)."""
    check_gluon_output_stores(compiled[config])


def test_split_launch_uses_combine(compiled):
    assert compiled["split1"]["launches"] == 1 and compiled["split2"]["launches"] == 2
    assert compiled["split2"]["grid"] == [B, 2]


if __name__ == "__main__":
    gluon_worker(sys.argv[1:], _launch)
