"""The backend is chosen once at import from the environment and the visible devices."""
import pytest

from dsv4_ops.lowering import BACKEND, select_backend


def test_default_is_triton_on_gpu_and_reference_on_cpu():
    assert select_backend(None, gpu_available=True) == "triton"
    assert select_backend(None, gpu_available=False) == "reference"
    assert select_backend("auto", gpu_available=True) == "triton"


def test_env_override_wins():
    assert select_backend("reference", gpu_available=True) == "reference"
    assert select_backend(" Triton ", gpu_available=False) == "triton"


def test_bad_env_value_names_the_variable():
    with pytest.raises(ValueError, match="DSV4_OPS_BACKEND"):
        select_backend("cudnn", gpu_available=True)


def test_this_process_resolved_a_valid_backend():
    assert BACKEND in ("triton", "reference")
