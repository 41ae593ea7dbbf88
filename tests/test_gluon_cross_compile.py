"""The Gluon bf16 decode attention (``lowering/gluon/sparse_attention.py``) compiles for sm_90 at
V4-Flash decode shapes (B=64, H=64, D=512, W=128, top-k 512, 8192-entry pool), 1 and 2 splits,
with no GPU: registers without spills, shared memory within the sm_90 opt-in limit, wgmmas kept
async, and the point of the kernel -- the rows are gathered by a producer partition that arms
mbarriers, and one warpgroup computes a block's scores whole.

The launcher runs on ``meta`` tensors; each launch is compiled with ``triton.compile`` from a
``GluonASTSource`` specialised the way the JIT would (pointers 16-byte aligned, ints == 1 as
constants, ints divisible by 16 marked so). Like ``test_triton_cross_compile.py``, the compiles
run in a subprocess without ``TRITON_INTERPRET``.
"""
import collections
import json
import os
import re
import sys
from pathlib import Path

import pytest
from compiled_worker import run_worker

ROOT = Path(__file__).resolve().parents[1]
B, H, D, W, K, NC, RING = 64, 64, 512, 128, 512, 8192, 256
CONFIGS = {"split1": dict(num_splits=1), "split2": dict(num_splits=2)}
SMEM_LIMIT = 232448


def _source(kernel, args, meta, gluon):
    import torch
    import triton
    from triton.experimental.gluon._runtime import GluonASTSource

    dtypes = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32", torch.uint8: "u8"}
    constexprs = {k: v for k, v in meta.items() if k != "num_warps"}
    signature, attrs = {}, {}
    for i, (name, v) in enumerate(zip(kernel.arg_names, args + (None,) * len(kernel.arg_names))):
        if name in constexprs:
            signature[name] = "constexpr"
        elif isinstance(v, torch.Tensor):
            signature[name] = "*" + dtypes[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            signature[name] = "fp32"  # the JIT's type for a Python float
        elif isinstance(v, int) and v == 1:
            signature[name] = "constexpr"
            constexprs[name] = 1
        elif isinstance(v, int):
            signature[name] = "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            raise TypeError(f"{name}: {type(v)}")
    cls = GluonASTSource if gluon else triton.compiler.ASTSource
    return cls(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)


def _resources(compiled) -> dict:
    res = {"shared": compiled.metadata.shared}
    ptx = compiled.asm["ptx"]
    # wgmma.mma_async.sync.aligned.m64n<N>k16.f32.bf16.bf16: one N per distinct instruction shape
    res["wgmma_n"] = sorted({int(n) for n in re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx)})
    res["wgmma_count"] = len(re.findall(r"wgmma\.mma_async", ptx))
    res["cp_async"] = len(re.findall(r"cp\.async\.cg\.shared\.global", ptx))
    # masked lanes must zero-fill: cp.async with a src-size operand
    res["cp_async_zfill"] = len(re.findall(r"cp\.async\.cg\.shared\.global[^;]*\[[^\]]*\],\s*\[[^\]]*\],\s*0x10,\s*%r",
                                           ptx))
    res["cp_wait"] = len(re.findall(r"cp\.async\.wait_group", ptx))
    res["cp_mbarrier_arrive_noinc"] = len(re.findall(r"cp\.async\.mbarrier\.arrive\.noinc", ptx))
    res["setmaxnreg"] = sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)))
    res["st_global"] = global_stores(ptx)
    serialized = _wgmma_serialized(ptx)
    if serialized is not None:
        res["wgmma_serialized"] = serialized
    res.update(_register_usage(compiled))
    return res


def global_stores(ptx: str) -> dict:
    """How many of each width: st.global.b32 (4 bytes a thread), .v2.b32 (8), .v4.b32 (16)."""
    return dict(collections.Counter(re.findall(r"st\.global(?:\.[a-z0-9]+)*", ptx)))


def _wgmma_serialized(ptx: str):
    """Whether ptxas serialized the kernel's wgmmas (None: no ptxas in this Triton wheel). C7512/C7514/C7515: too
    few registers, or a register of an in-flight wgmma touched (or not provably untouched), and every wgmma of the
    kernel waits for the one before -- what keeps async wgmma async (session 24 met C7512 and C7515 along with
    C7514, the one code this check looked for until then)."""
    import subprocess
    import tempfile

    import triton

    bin_dir = Path(triton.__file__).parent / "backends/nvidia/bin"
    if not (bin_dir / "ptxas").exists():
        return None
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.ptx").write_text(ptx)
        text = subprocess.run([str(bin_dir / "ptxas"), "-arch=sm_90a", "-v", "-o", str(Path(d) / "k.cubin"),
                               str(Path(d) / "k.ptx")], capture_output=True, text=True).stderr
    return "wgmma.mma_async instructions are serialized" in text


def _register_usage(compiled) -> dict:
    """Registers, stack and local bytes of the cubin (``cuobjdump -res-usage``, shipped in Triton's
    wheel; {} without it)."""
    import subprocess
    import tempfile

    import triton

    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    if not cuobjdump.exists():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True).stdout
    found = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", text))
    return dict(regs=int(found.get("REG", -1)), stack=int(found.get("STACK", -1)), local=int(found.get("LOCAL", -1)))


def _worker(names):
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    import triton
    from triton.backends.compiler import GPUTarget

    sys.path.insert(0, str(ROOT))
    from dsv4_ops.lowering.gluon import sparse_attention as ga

    meta_dev = torch.device("meta")
    bf16 = dict(dtype=torch.bfloat16, device=meta_dev)
    i32 = dict(dtype=torch.int32, device=meta_dev)
    inputs = (torch.empty(B, 1, H, D, **bf16), torch.empty(B, RING, D, **bf16), torch.empty(B, 1, W, **i32),
              torch.empty(B, NC, D, **bf16), torch.empty(B, 1, K, **i32), torch.empty(B, 1, **i32),
              torch.empty(H, dtype=torch.float32, device=meta_dev), D ** -0.5)
    target = GPUTarget("cuda", 90, 32)
    results = []
    for name in names:
        _, launches = ga.gluon_launch(*inputs, **CONFIGS[name])
        kernel, grid, args, meta = launches[0]
        entry = {"config": name, "meta": {k: v for k, v in meta.items()}, "grid": list(grid),
                 "launches": len(launches)}
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
    if "regs" in res:  # cuobjdump ships in Triton's wheel; absent -> nothing to check
        assert 0 < res["regs"] <= 255, res
        assert res["stack"] == 0 and res["local"] in (0, -1), res


@pytest.mark.parametrize("config", list(CONFIGS))
def test_scores_in_one_warpgroup(compiled, config):
    """One warpgroup scores the whole block (N = BLOCK_N, q read once a block), and each warpgroup issues P @ rows
    over its own 256 channels: D / 16 score steps + twice BLOCK_N / 16 P @ rows steps."""
    r = compiled[config]
    assert "error" not in r, r["error"]
    res, block_n = r["resources"], r["meta"]["BLOCK_N"]
    assert res["wgmma_n"] == sorted({block_n, D // 2}), res
    assert res["wgmma_count"] == D // 16 + 2 * (block_n // 16), res


@pytest.mark.parametrize("config", list(CONFIGS))
def test_wgmma_not_serialized(compiled, config):
    """ptxas keeps the async wgmmas async (no C7512/C7514/C7515: the score steps stay one group)."""
    res = compiled[config]["resources"]
    if "wgmma_serialized" not in res:
        pytest.skip("no ptxas in this Triton wheel")
    assert res["wgmma_serialized"] is False, res


@pytest.mark.parametrize("config", list(CONFIGS))
def test_gather_is_cp_async_with_zero_fill(compiled, config):
    """Rows are gathered by 16-byte cp.async whose src-size is a register (0 for masked lanes:
    the ring slot is zero-filled, so a masked row contributes 0, never stale data)."""
    res = compiled[config]["resources"]
    assert res["cp_async"] > 0 and res["cp_async_zfill"] == res["cp_async"], res


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


def check_output_stores(r: dict) -> None:
    """One split: each MMA warpgroup stages its 64 x 256 bf16 output columns in q's shared memory and stores them a
    row a warp, 16 bytes a thread: BLOCK_H * D * 2 / (16 * 128) = 32 st.global.v4 in the two partitions, nothing
    narrower. Stored straight from the accumulator's layout (4 bytes a thread, 16-byte pieces of 8 rows) it took
    several microseconds more a call at 128 programs (BENCHMARKS.md). Several splits store the fp32 partials from that layout, 8 bytes
    a thread (whole sectors; staging them gained nothing). Shared with the FP8 reader's test (same MMA partitions)."""
    assert "error" not in r, r["error"]
    stores, block_h = r["resources"]["st_global"], r["meta"]["BLOCK_H"]
    if r["meta"]["NUM_SPLITS"] == 1:
        assert stores == {"st.global.v4.b32": block_h * D * 2 // (16 * 128)}, stores
    else:
        assert "st.global.v4.b32" not in stores and stores["st.global.v2.b32"] == block_h * D * 4 // (8 * 128), stores


@pytest.mark.parametrize("config", list(CONFIGS))
def test_stores_its_output_16_bytes_a_thread(compiled, config):
    check_output_stores(compiled[config])


def test_split_launch_uses_combine(compiled):
    assert compiled["split1"]["launches"] == 1 and compiled["split2"]["launches"] == 2
    assert compiled["split2"]["grid"] == [B, 2]


if __name__ == "__main__":
    _worker(sys.argv[1:])
