"""Compiling the kernels' launches for GPUs this machine does not have: ROCm (gfx942 = MI300,
gfx950 = MI355) and Hopper (sm_90), the machinery of every ``test_*_cross_compile.py``.

A test file's worker (``python <test file> <targets>``, run by ``compile_in_worker`` without
``TRITON_INTERPRET``: ``conftest.py`` sets it for the whole CPU test process, and ``@triton.jit``
reads it when a kernel module is imported) calls the launchers on ``meta`` tensors with their
``launch`` swapped for a recorder (``recorder``), and compiles each recorded launch with
``triton.compile(ast_source(...), target=GPUTarget(...))`` the way Triton's JIT would specialise it
(pointers 16-byte aligned, ints == 1 as constants, ints divisible by 16 marked so). Register and
spill counts are read from the artifacts: cuobjdump from Triton's wheel for the cubin, the AMDGPU
metadata for the hsaco. A worker prints one JSON line: a list of entries, one per target x launch.
"""
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from compiled_worker import ROOT, run_worker

TARGETS = {"gfx942": ("hip", "gfx942", 64), "gfx950": ("hip", "gfx950", 64), "sm90": ("cuda", 90, 32)}

# V4 shapes: Flash attention (H=64, D=512, rope 64, W=128, top-k 512, 8192-entry pool), a 256-slot
# window ring, 64-entry FP8 pages, the indexer (64 heads x 128), batch-64 decode
B_DECODE, H, D, ROPE, W, K_CSA, N_POOL, RING, PAGE = 64, 64, 512, 64, 128, 512, 8192, 256, 64
HI, DI = 64, 128

_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32", "torch.int32": "i32",
           "torch.int64": "i64", "torch.uint8": "u8"}


def padded_fp8_pages(num_pages, page, entry_bytes):
    """``uint8 [num_pages, page, entry_bytes]`` meta pages at FlashMLA's page stride (each page's bytes
    rounded up to a multiple of 576), as a serving engine that allocates FlashMLA's way hands them over."""
    import torch

    used = page * entry_bytes
    return torch.empty(num_pages, -(-used // 576) * 576, dtype=torch.uint8, device="meta")[:, :used].view(
        num_pages, page, entry_bytes)


def recorder(*modules):
    """Swap ``launch`` of each launcher module for a recorder; returns the list it appends
    ``(kernel, args, meta)`` to, one entry per launch (a ``None`` spec launches nothing)."""
    recorded = []

    def record(kernel, spec):
        if spec is not None:
            recorded.append((kernel, spec.args, spec.meta))

    for module in modules:
        module.launch = record
    return recorded


def ast_source(kernel, args, meta, gluon=False):
    """``ASTSource`` (``GluonASTSource`` for a Gluon kernel) specialised like a JIT launch of
    ``kernel(*args, **meta)``. A Triton kernel's float arguments are typed fp64, as Inductor types a
    Python float on CUDA / ROCm (Triton's JIT: fp32), so that the kernels compile with the stricter
    one, which is what a compiled model launches; a Gluon kernel (launched by its own launcher, never
    by Inductor) gets the JIT's fp32 and i32."""
    import torch
    import triton

    launch_options = ("num_warps",) if gluon else ("num_warps", "num_stages")
    constexprs = {k: v for k, v in meta.items() if k not in launch_options}
    signature, attrs = {}, {}
    values = dict(zip(kernel.arg_names, args))
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        v = values.get(name)
        if isinstance(v, torch.Tensor):
            signature[name] = "*" + _DTYPES[str(v.dtype)]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool) and not gluon:
            signature[name] = "i1"
        elif isinstance(v, int):
            if v == 1:
                signature[name] = "constexpr"
                constexprs[name] = 1
                continue
            signature[name] = "i32" if gluon or -(2**31) <= v < 2**31 else "i64"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            signature[name] = "fp32" if gluon else "fp64"
        else:
            raise TypeError(f"{name}: {type(v)}")
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource

        return GluonASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)


def _nvidia_tool(name):
    import triton

    path = Path(triton.__file__).parent / "backends/nvidia/bin" / name
    return path if path.exists() else None


def cubin_usage(cubin: bytes):
    """``cuobjdump -res-usage`` of a cubin: {"REG": .., "STACK": .., "SHARED": .., "LOCAL": ..} as
    found; None without cuobjdump (it ships in Triton's wheel)."""
    cuobjdump = _nvidia_tool("cuobjdump")
    if cuobjdump is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True).stdout
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def triton_resources(compiled) -> dict:
    """sm_90: registers, stack bytes, shared bytes and wgmma count ({} without cuobjdump); gfx9: the
    AMDGPU metadata's register, spill and scratch counts."""
    asm = compiled.asm
    if "cubin" in asm:
        found = cubin_usage(asm["cubin"])
        if found is None:
            return {}
        return {"regs": found.get("REG", -1), "stack_bytes": found.get("STACK", -1),
                "shared_bytes": compiled.metadata.shared, "wgmma": asm["ptx"].count("wgmma.mma_async")}
    found = dict(re.findall(r"\.(vgpr_count|agpr_count|sgpr_count|vgpr_spill_count|sgpr_spill_count|"
                            r"private_segment_fixed_size):\s+(\d+)", asm.get("amdgcn", "")))
    return {k: int(v) for k, v in found.items()}


def triton_worker(launches, target_names):
    """The worker of a Triton cross-compile test: compile ``launches(backend)`` (``(name, kernel,
    args, meta)`` tuples) for every target named and print the entries as one JSON line."""
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(ROOT))
    import triton
    from triton.backends.compiler import GPUTarget

    results = []
    for tname in target_names:
        target = GPUTarget(*TARGETS[tname])
        for name, kernel, args, meta in launches("hip" if target.backend == "hip" else "cuda"):
            entry = {"target": tname, "kernel": name, "num_warps": meta.get("num_warps", 4),
                     "num_stages": meta.get("num_stages", 3),
                     "constexprs": {k: v for k, v in meta.items() if k.isupper()}}
            try:
                compiled = triton.compile(ast_source(kernel, args, meta), target=target,
                                          options={"num_warps": entry["num_warps"], "num_stages": entry["num_stages"]})
                ptx = compiled.asm.get("ptx", "")
                entry["artifacts"] = {k: len(v) for k, v in compiled.asm.items()}
                entry["resources"] = triton_resources(compiled)
                entry["shared"] = compiled.metadata.shared
                entry["fp8_mma"] = "e4m3.e4m3" in ptx  # wgmma ... .f32.e4m3.e4m3
                entry["e4m3_convert"] = "cvt.rn.satfinite.e4m3x2.f32" in ptx
            except Exception as e:  # reported, the parent test fails with it
                entry["error"] = f"{type(e).__name__}: {e}"[:2000]
            results.append(entry)
    print(json.dumps(results))


def compile_in_worker(test_file, *args, key=("target", "kernel"), timeout=900):
    """Run ``test_file``'s worker with ``args`` and index its entries by ``key``; each entry's
    report lands in the test log (-rA / on failure)."""
    results = run_worker(test_file, *args, timeout=timeout)
    for r in results:
        print(*(r[k] for k in key), r.get("meta", ""), r.get("resources"), r.get("error", ""))
    return {tuple(r[k] for k in key) if len(key) > 1 else r[key[0]]: r for r in results}


def check_compiles(r: dict, target: str) -> None:
    """The launch compiled to the target's artifacts: PTX and a cubin for sm_90, AMDGCN and a hsaco
    for gfx9."""
    assert "error" not in r, r["error"]
    art = r["artifacts"]
    if target == "sm90":
        assert art.get("ptx", 0) > 0 and art.get("cubin", 0) > 0, art
    else:
        assert art.get("amdgcn", 0) > 0 and art.get("hsaco", 0) > 0, art


def check_no_spill(r: dict, target: str) -> None:
    """The kernel keeps its state in registers: no stack on sm_90 (nothing to check without
    cuobjdump), no VGPR / SGPR spills and no scratch on gfx9."""
    res = r["resources"]
    if target == "sm90":
        if res:  # cuobjdump ships in Triton's wheel; absent -> nothing to check
            assert res["stack_bytes"] == 0, res
    else:
        assert res["vgpr_spill_count"] == 0 and res["sgpr_spill_count"] == 0, res
        assert res["private_segment_fixed_size"] == 0, res


def triton_cross_compile(test_file, module_name, launches):
    """A Triton cross-compile test file's module fixture ``compiled``: its worker's entries by ``(target,
    kernel)``, for every target. Run as a script (``module_name == "__main__"``), the file is that worker:
    this compiles ``launches(backend)`` for the targets named on its command line, prints them and exits.
    ``compiled = triton_cross_compile(__file__, __name__, _launches)``, below the file's ``_launches``."""
    if module_name == "__main__":
        triton_worker(launches, sys.argv[1:])
        sys.exit(0)

    @pytest.fixture(scope="module")
    def compiled():
        return compile_in_worker(test_file, *TARGETS)

    return compiled


def kernel_tests(kernels, known_spills=frozenset(), fp8=False):
    """Two tests over each of ``kernels`` x every target, for the module fixture ``compiled``; assign
    them to module names, which pytest collects. Each kernel compiles (``check_compiles``), and then:

    * float-cache kernels (``test_kernel_compiles, test_kernel_does_not_spill = kernel_tests(KERNELS)``)
      keep their state in registers (no scratch / stack) at their V4 launch config, but for the
      ``known_spills`` (``(target, kernel)`` pairs, measured and accepted: skipped with that reason);
    * FP8-cache kernels (``test_fp8_kernel_compiles, test_fp8_kernel_fits_shared_memory =
      kernel_tests(FP8_KERNELS, fp8=True)``) fit one program's shared memory with their launch config (a
      kernel over it compiles but raises OutOfResources at launch). The FP8 reads' byte gathers are
      pipelined too: at D = 512 the bf16 attention config's 4 stages asked 240 KB on sm_90 (found on the
      H200), so the FP8 attention config takes fewer, by ``attention_smem_bytes(..., fp8=FP8)``, which
      bounds what the compiler asks.
    """
    every = pytest.mark.parametrize("target, kernel", [(t, k) for t in TARGETS for k in kernels])

    @every
    def compiles(compiled, target, kernel):
        check_compiles(compiled[(target, kernel)], target)

    @every
    def does_not_spill(compiled, target, kernel):
        """Every kernel at its V4 launch config keeps its state in registers (no scratch / stack)."""
        if (target, kernel) in known_spills:
            pytest.skip("known spill, measured and accepted (see KNOWN_SPILLS)")
        check_no_spill(compiled[(target, kernel)], target)

    @every
    def fits_shared_memory(compiled, target, kernel):
        """Every FP8 kernel's launch config fits one program's shared memory, and an FP8 attention
        config within the estimate ``attention_config`` sizes its pipeline by."""
        from dsv4_ops.lowering.triton import sparse_attention as sa

        r = compiled[(target, kernel)]
        assert "error" not in r, r["error"]
        assert r["shared"] <= sa.SMEM_LIMIT["hip" if TARGETS[target][0] == "hip" else "cuda"], r
        if kernel.startswith("fp8_attention") and not kernel.endswith("combine"):
            c = r["constexprs"]
            cfg = dict(BLOCK_D=c["BLOCK_D"], BLOCK_H=c["BLOCK_H"], BLOCK_N=c["BLOCK_N"], num_stages=r["num_stages"])
            assert r["shared"] <= sa.attention_smem_bytes(cfg, 2, fp8=c["FP8"]), r

    return compiles, fits_shared_memory if fp8 else does_not_spill


# ---- Gluon (sm_90 only) -----------------------------------------------------------------------
SM90_SMEM_LIMIT = 232448  # the opt-in shared memory of one sm_90 CTA


def gluon_cross_compile(test_file, module_name, launch, configs):
    """A Gluon cross-compile test file's module fixture ``compiled``: its worker's entries by config name
    (skipped where this Triton has no Gluon). Run as a script, the file is that worker (``gluon_worker``
    over the config names on its command line). ``compiled = gluon_cross_compile(__file__, __name__,
    _launch, CONFIGS)``, below the file's ``_launch``."""
    if module_name == "__main__":
        gluon_worker(sys.argv[1:], launch)
        sys.exit(0)

    @pytest.fixture(scope="module")
    def compiled():
        pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")
        return compile_in_worker(test_file, *configs, key=("config",))

    return compiled


def gluon_worker(names, launch):
    """The worker of a Gluon cross-compile test: ``launch(name)`` gives ``(launches, extra entry
    fields)`` for each config name; its first launch is compiled for sm_90 and described by
    ``gluon_resources``. Prints the entries as one JSON line."""
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(ROOT))
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)
    results = []
    for name in names:
        launches, extra = launch(name)
        kernel, grid, args, meta = launches[0]
        entry = {"config": name, "meta": dict(meta), "grid": list(grid), "launches": len(launches), **extra}
        try:
            compiled = triton.compile(ast_source(kernel, args, meta, gluon=True), target=target,
                                      options={"num_warps": meta["num_warps"]})
            entry["resources"] = gluon_resources(compiled)
        except Exception as e:  # reported; the parent test fails with it
            entry["error"] = f"{type(e).__name__}: {e}"[:3000]
        results.append(entry)
    print(json.dumps(results))


def gluon_resources(compiled) -> dict:
    """What the Gluon attention tests read from a compiled kernel's PTX and cubin: shared bytes, the
    wgmma shapes and count, cp.async copies by size (with a src-size register: zero fill), waits and
    mbarrier arrivals, ``prmt`` bit moves, barriers, ``setmaxnreg`` (kind, registers) pairs, global
    stores by width, whether ptxas serialized the wgmmas, registers / stack / local bytes."""
    ptx = compiled.asm["ptx"]
    res = {"shared": compiled.metadata.shared}
    # wgmma.mma_async.sync.aligned.m64n<N>k16.f32.bf16.bf16: one N per distinct instruction shape
    res["wgmma_n"] = sorted({int(n) for n in re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx)})
    res["wgmma_count"] = len(re.findall(r"wgmma\.mma_async", ptx))
    # cp.async by kind and size ("cg16": .cg, 16 bytes: rows, FP8 codes; "ca4" / "ca8": FP8 rope, scales), and
    # those with a src-size register (0 for masked lanes: zero fill)
    res["cp_async"], res["cp_async_zfill"] = collections.Counter(), collections.Counter()
    for m in re.finditer(r"cp\.async\.(c[ag])\.shared\.global[^;]*\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-f]+|\d+)(,\s*%r)?",
                         ptx):
        copy = f"{m.group(1)}{int(m.group(2), 0)}"
        res["cp_async"][copy] += 1
        res["cp_async_zfill"][copy] += m.group(3) is not None
    res["cp_async_cg"] = len(re.findall(r"cp\.async\.cg\.shared\.global", ptx))  # every .cg copy, whatever its form
    res["cp_wait"] = len(re.findall(r"cp\.async\.wait_group", ptx))
    res["cp_mbarrier_arrive_noinc"] = len(re.findall(r"cp\.async\.mbarrier\.arrive\.noinc", ptx))
    res["prmt"] = len(re.findall(r"prmt\.b32", ptx))
    res["bar_sync"] = len(re.findall(r"bar\.sync|barrier\.sync", ptx))
    res["setmaxnreg"] = sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)))
    res["st_global"] = dict(collections.Counter(re.findall(r"st\.global(?:\.[a-z0-9]+)*", ptx)))
    serialized = wgmma_serialized(ptx)
    if serialized is not None:
        res["wgmma_serialized"] = serialized
    found = cubin_usage(compiled.asm["cubin"])
    if found is not None:
        res.update(regs=found.get("REG", -1), stack=found.get("STACK", -1), local=found.get("LOCAL", -1))
    return res


def wgmma_serialized(ptx: str):
    """Whether ptxas serialized the kernel's wgmmas (None: no ptxas in this Triton wheel). C7512/C7514/C7515: too
    few registers, or a register of an in-flight wgmma touched (or not provably untouched), and every wgmma of the
    kernel waits for the one before -- what keeps async wgmma async (all three codes have been met; checking for
    C7514 alone missed the other two)."""
    ptxas = _nvidia_tool("ptxas")
    if ptxas is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.ptx").write_text(ptx)
        text = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", "-o", str(Path(d) / "k.cubin"),
                               str(Path(d) / "k.ptx")], capture_output=True, text=True).stderr
    return "wgmma.mma_async instructions are serialized" in text


def check_gluon_fits(r: dict, max_stack=None) -> None:
    """Compiled, within sm_90's opt-in shared memory, at most 255 registers a thread and no local memory; no
    stack (``max_stack`` None) or at most ``max_stack`` bytes. Registers unchecked without cuobjdump."""
    assert "error" not in r, r["error"]
    res = r["resources"]
    assert res["shared"] <= SM90_SMEM_LIMIT, res
    if "regs" in res:  # cuobjdump ships in Triton's wheel; absent -> nothing to check
        assert 0 < res["regs"] <= 255, res
        assert (res["stack"] == 0 if max_stack is None else res["stack"] <= max_stack), res
        assert res["local"] in (0, -1), res


def gluon_mma_tests(configs):
    """The tests of what the bf16 Gluon kernel and the FP8 reader share, their MMA partitions, over each
    config, for the module fixture ``compiled``: ``test_scores_in_one_warpgroup, test_wgmma_not_serialized,
    test_stores_its_output_16_bytes_a_thread = gluon_mma_tests(CONFIGS)``."""
    every = pytest.mark.parametrize("config", list(configs))

    @every
    def scores_in_one_warpgroup(compiled, config):
        """One warpgroup scores the whole block (N = BLOCK_N, q read once a block), and each warpgroup issues
        P @ rows over its own 256 channels: D / 16 score steps + twice BLOCK_N / 16 P @ rows steps."""
        r = compiled[config]
        assert "error" not in r, r["error"]
        res, block_n = r["resources"], r["meta"]["BLOCK_N"]
        assert res["wgmma_n"] == sorted({block_n, D // 2}), res
        assert res["wgmma_count"] == D // 16 + 2 * (block_n // 16), res

    @every
    def wgmma_not_serialized(compiled, config):
        """ptxas keeps the async wgmmas async (``wgmma_serialized``: no C7512/C7514/C7515, the score steps
        stay one group); skipped without ptxas."""
        res = compiled[config]["resources"]
        if "wgmma_serialized" not in res:
            pytest.skip("no ptxas in this Triton wheel")
        assert res["wgmma_serialized"] is False, res

    @every
    def stores_its_output_16_bytes_a_thread(compiled, config):
        """One split: each MMA warpgroup stages its 64 x 256 bf16 output columns in q's shared memory and
        stores them a row a warp, 16 bytes a thread: BLOCK_H * D * 2 / (16 * 128) = 32 st.global.v4 in the two
        partitions, nothing narrower. Stored straight from the accumulator's layout (4 bytes a thread, 16-byte
        pieces of 8 rows) it took several microseconds more a call at 128 programs (BENCHMARKS.md). Several
        splits store the fp32 partials from that layout, 8 bytes a thread (whole sectors; staging them gained
        nothing)."""
        r = compiled[config]
        assert "error" not in r, r["error"]
        stores, block_h = r["resources"]["st_global"], r["meta"]["BLOCK_H"]
        if r["meta"]["NUM_SPLITS"] == 1:
            assert stores == {"st.global.v4.b32": block_h * D * 2 // (16 * 128)}, stores
        else:
            assert "st.global.v4.b32" not in stores, stores
            assert stores["st.global.v2.b32"] == block_h * D * 4 // (8 * 128), stores

    return scores_in_one_warpgroup, wgmma_not_serialized, stores_its_output_16_bytes_a_thread
