"""Shared test fixtures: seeding, the one tolerance table, the ``gpu`` marker, ``poison``.

Fixtures:
    seed (autouse)  seeds torch with a per-test value, so every test draws its own fresh,
                    reproducible random inputs (never zeros, never shared between tests).
    device          "cpu", plus "cuda" marked ``gpu`` (skipped with a reason without CUDA).
    tol             ``tol(dtype) -> dict(atol=..., rtol=...)`` from ``TOLERANCES``.
    poison          ``poison(*tensors)`` fills tensors in place with NaN (floats) or a large
                    negative sentinel (ints) before an op runs, so unwritten output shows up.
    fake_check      ``fake_check(op, *args)``: runs ``op`` on real inputs and under FakeTensorMode
                    (static and symbolic shapes); sizes, strides, dtypes and devices must agree.
"""
import os

import torch  # importing torch does not import triton, so the variable below is still in time

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

# The single dtype -> tolerance table. Low-precision entries cover rounding of inputs, of the
# output and fp32 accumulation order; compare against a float64 oracle on the same (rounded) inputs.
TOLERANCES = {
    torch.float64: dict(atol=1e-10, rtol=1e-10),
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}

INT_POISON = -(2**30)


def tolerance(dtype: torch.dtype) -> dict:
    return dict(TOLERANCES[dtype])


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
