"""Shared test fixtures: seeding, the one tolerance table, the ``gpu`` marker, ``poison``.

The tests are grouped by capability: ``ops/<op>/`` (each op's contract, reference, kernels,
cross-compiles and routes, with the op's own inputs in ``<op>_cases.py`` there), ``ops/`` (what spans the
ops), ``model/``, ``runtime/``, ``serve/``, ``hf/``, ``export/``, ``parallel/``, ``project/``. pytest imports them by
basename (the default "prepend" mode; no ``__init__.py``), so every module name under tests/ is unique,
and the helpers beside this file (``launchers``, ``cross_compile``, ``fp8_cases``, ``model_util``, ...) are
importable from every folder; subprocess workers get them through ``compiled_worker``'s ``PYTHONPATH``.

Fixtures:
    seed (autouse)  seeds torch with a per-test value, so every test draws its own fresh,
                    reproducible random inputs (never zeros, never shared between tests).
    device          "cpu", plus "cuda" marked ``gpu`` (skipped with a reason without CUDA).
    tol             ``tol(dtype_or_name) -> dict`` from ``TOLERANCES``: ``atol`` / ``rtol`` for
                    ``torch.testing.assert_close``, or ``rel``, a bound on a relative error the test
                    computes (the metric is written where it is used).
    poison          ``poison(*tensors)`` fills tensors in place with NaN (floats) or a large
                    negative sentinel (ints) before an op runs, so unwritten output shows up.
    fake_check      ``fake_check(op, *args)``: runs ``op`` on real inputs and under FakeTensorMode
                    (static and symbolic shapes); sizes, strides, dtypes and devices must agree.
"""
import os

# ``make test`` runs pytest-xdist workers side by side on CI's 2 cores: each worker's OpenMP pool (ATen's
# CPU ops, Inductor's and AOTInductor's C++ kernels) gets its share of the cores. With more threads than
# that, every parallel region waits for a thread whose core the other worker holds: a compiled tiny-model
# decode step took 14 ms with 2 threads vs 1.6 ms with 1 while another process kept one core busy.
# An OMP_NUM_THREADS already set wins; tests' subprocesses inherit the setting.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = None
if _XDIST_WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    _THREADS = max(1, (os.cpu_count() or 1) // _XDIST_WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)

import torch  # noqa: E402  (importing torch does not import triton, so the variable below is still in time)

if _THREADS is not None:
    torch.set_num_threads(_THREADS)  # in case a plugin imported torch before this file

if not torch.cuda.is_available():
    # Triton kernels run under the interpreter on CPU; must be set before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import zlib  # noqa: E402

import pytest  # noqa: E402


def _fix_interpreter_numpy24() -> None:
    """Let ``TRITON_INTERPRET=1`` run loops with runtime bounds under numpy >= 2.4.

    Triton 3.6's interpreter converts a scalar to a Python int with ``int(ndarray)``,
    which numpy 2.4 rejects for the shape-(1,) arrays it uses for scalars
    (triton-lang/triton#9171, fixed upstream with ``.squeeze()``). The same fix, on top of
    the interpreter's per-launch patching; a no-op when the interpreter layout differs.
    A test-only patch: the package never modifies Triton.
    """
    import numpy as np
    from triton.runtime import interpreter

    if getattr(interpreter, "_dsv4_index_fix", False):
        return
    if tuple(int(x) for x in np.__version__.split(".")[:2]) < (2, 4):
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor
    interpreter._dsv4_index_fix = True


import triton  # noqa: E402  (after TRITON_INTERPRET is set)

if triton.knobs.runtime.interpret:
    _fix_interpreter_numpy24()

# The one tolerance table. By dtype: a kernel or op computing in that dtype against a float64 oracle (or
# the reference) on the same (rounded) inputs; low-precision entries cover rounding of inputs, of the output
# and fp32 accumulation order. By name: every other comparison the tests bound, named for what it compares.
# ``atol`` / ``rtol`` are torch.testing.assert_close's; ``rel`` bounds a relative error the test computes.
# Exact comparisons (torch.equal, atol=rtol=0) are not tolerances and stay where they are.
TOLERANCES = {
    torch.float64: dict(atol=1e-10, rtol=1e-10),
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    # ---- kernels and ops against their oracle, where the op's own arithmetic sets the bound
    "sinkhorn_vs_float64": dict(atol=1e-6, rtol=1e-5),  # fp32 sums over 2 * iters - 1 normalisations
    "sinkhorn_1x1_vs_float64": dict(atol=1e-7, rtol=1e-6),  # N = 1: one entry, c / (c + eps) a step
    "sinkhorn_column_sums": dict(atol=1e-5, rtol=0),  # the last normalisation is over columns: each sums to 1
    "sinkhorn_fixed_point": dict(atol=1e-5, rtol=0),  # a doubly stochastic matrix (+ eps) stays put
    "sinkhorn_row_sums_after_20_iters": dict(atol=1e-2, rtol=0),  # rows: not fully converged after 20
    "moe_gemv_vs_reference": dict(atol=2e-5, rtol=2e-5),  # the op's fp32 sum of expert outputs, another order
    "moe_gemv_reference_vs_float64": dict(atol=1e-4, rtol=1e-4),  # the reference vs the per-assignment loop
    "moe_expert_paths_fp32": dict(atol=1e-6, rtol=1e-5),  # blocked, grouped, per-token loop, shared experts
    "gemv_bf16_vs_reference": dict(atol=1e-5, rtol=1e-2),  # bf16 outputs of fp32 sums in another order
    "indexer_pick_scores_fp32": dict(atol=1e-4, rtol=1e-4),  # reference scores of two pick sets (order of sums)
    "fp8_query_quantisation_is_seen": dict(atol=1e-3, rtol=1e-3),  # unquantised queries' scores lie outside it
    "fp8_e4m3_dot_scores": dict(rel=2e-3),  # e4m3 tensor-core scores vs the simulated ones, of their range
    "bf16_one_rounding": dict(atol=1e-2, rtol=1e-2),  # a bf16 output rounded once vs rounded in another order
    "bf16_expert_outputs": dict(rel=1e-2),  # bf16 expert paths rounding each expert's output (1 ulp = 0.4%)
    "bf16_gemv_vs_cublas": dict(rel=1e-2),  # max |ours - cuBLAS| / max |cuBLAS|, bf16 decode projections
    "gluon_vs_triton_bf16": dict(atol=1e-2, rel=1e-2),  # two fp32 softmaxes over the same bf16 rows (P rounded)
    # ---- the same computation another way: compiled, exported, batched, sharded, speculative, PDL
    "compiled_vs_eager_fp32": dict(atol=1e-5, rtol=1e-5),  # Inductor's fusions reorder fp32 sums
    "compiled_vs_eager_rel_fp32": dict(rel=1e-5),  # max |compiled - eager| / max |eager| of a compiled module
    "compiled_vs_eager_bf16": dict(atol=2e-2, rtol=2e-2),  # Inductor rounds a fused chain once (1 bf16 ulp)
    "compiled_generator_vs_eager": dict(atol=1e-4, rtol=1e-4),  # a compiled Generator's logits, whole model
    "exported_vs_eager": dict(atol=1e-4, rtol=1e-4),  # an AOTInductor package's logits vs the eager Generator
    "exported_vs_eager_bf16": dict(rel=5e-2),  # bf16, 3 layers: blocked vs grouped experts, fusions (H100: 2.6%)
    "cuda_step_vs_cpu_reference": dict(atol=1e-4, rtol=1e-4),  # a compiled CUDA layer step vs the CPU reference
    "batch_row_vs_alone": dict(atol=1e-5, rtol=1e-5),  # a row of a padded batch vs its prompt alone
    "prefill_chunking_fp32": dict(atol=1e-5, rtol=1e-5),  # one prompt prefilled in other chunk sizes (or 1 a step)
    "sharded_vs_single_process": dict(atol=1e-5, rtol=1e-5),  # tensor / expert parallel ranks vs one process
    "speculative_cache_entries": dict(atol=1e-5, rtol=1e-4),  # what spec steps wrote vs plain decode / oracle
    "pdl_vs_plain_logits": dict(atol=1e-4, rtol=0),  # programmatic dependent launches vs plain launches
    # ---- relative errors against an independent implementation (the metric is the test's: hf_util.rel, ...)
    "hf_parity_fp32": dict(rel=1e-5),  # one module / layer (or a short model run) vs HF transformers
    "hf_model_parity_fp32": dict(rel=1e-4),  # the whole model vs HF at every position / decode step
    "hf_model_parity_bf16": dict(rel=5e-2),  # the bf16 model vs fp32 (and vs HF's own bf16 drift)
    "hf_model_parity_cuda_bf16": dict(mean_rel=4e-2, rel=0.15),  # bf16 on CUDA vs HF fp32: mean and worst
    "fp8_cache_model_vs_simulated": dict(rel=1e-4),  # FP8 cache logits vs float caches of the FP8 values
    "fp8_cache_model_vs_cache_free": dict(rel=2e-3),  # vs the cache-free FP8 forward (a one-code flip)
    "mtp_drafter_vs_float64": dict(atol=1e-3),  # fp32 drafter logits vs the float64 MTP oracle (logits O(1..10))
}

INT_POISON = -(2**30)


def tolerance(key) -> dict:
    """The ``TOLERANCES`` entry of a dtype or a comparison's name (a copy)."""
    if key not in TOLERANCES:
        names = sorted(k for k in TOLERANCES if isinstance(k, str))
        raise KeyError(f"no tolerance {key!r} in conftest.TOLERANCES (dtypes, or one of {names})")
    return dict(TOLERANCES[key])


def poison_(*tensors: torch.Tensor) -> torch.Tensor:
    """Fill tensors in place with NaN (float) or ``INT_POISON`` (int); returns the first."""
    for t in tensors:
        t.fill_(float("nan") if t.is_floating_point() else INT_POISON)
    return tensors[0] if tensors else None


def assert_fake_matches_real(op, *args):
    """``op(*args)`` on real tensors vs under FakeTensorMode, with static and with symbolic shapes.

    Tensor args are cloned for the real run, so mutating ops leave the caller's inputs alone.
    Returns the real result.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    real = op(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    reals = list(real) if isinstance(real, (tuple, list)) else [real]
    for shape_env in (None, ShapeEnv()):
        with FakeTensorMode(shape_env=shape_env) as mode:
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            fake = op(*fake_args)
        fakes = list(fake) if isinstance(fake, (tuple, list)) else [fake]
        assert len(fakes) == len(reals), f"fake returned {len(fakes)} outputs, real {len(reals)}"
        for i, (f, r) in enumerate(zip(fakes, reals)):
            if r is None:
                assert f is None, f"output {i}: real is None, fake is {f!r}"
                continue
            where = f"output {i} (symbolic={shape_env is not None})"
            assert [int(x) for x in f.shape] == list(r.shape), f"{where}: size {f.shape} vs real {r.shape}"
            assert [int(x) for x in f.stride()] == list(r.stride()), f"{where}: stride {f.stride()} vs {r.stride()}"
            assert f.dtype == r.dtype, f"{where}: dtype {f.dtype} vs real {r.dtype}"
            assert f.device == r.device, f"{where}: device {f.device} vs real {r.device}"
    return real


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped with a reason when CUDA is unavailable)")
    config.addinivalue_line("markers", "smem_poison: poisons every SM's shared memory before a launch; run it in one "
                                       "process (tools/gpu_check.sh tests), not under xdist")
    config.addinivalue_line("markers", "whole_gpu: needs most of an 80 GB GPU's memory (the Flash slice's weights); "
                                       "tools/gpu_check.sh tests runs it in one process, with no other worker beside it")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu); torch.cuda.is_available() is False")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def seed(request):
    value = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(value)
    return value


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    return torch.device(request.param)


@pytest.fixture
def tol():
    return tolerance


@pytest.fixture
def poison():
    return poison_


@pytest.fixture
def fake_check():
    return assert_fake_matches_real
