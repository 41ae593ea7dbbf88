"""The switch in front of the sm_90 Gluon attention (``dsv4_ops/ops/attention_sm90.py``), on
any machine: ``disabled()`` (what ``dsv4_ops.export`` traces under) is scoped and restores the
route even when the export fails, keeps its traces out of the AOTAutograd cache, the
``DSV4_OPS_GLUON_ATTENTION=0`` environment switch turns the route off, and CPU tensors never take
it. The route's numerics and its use in compiled graphs: ``tests/ops/test_sparse_attention_sm90.py``
(GPU)."""
import os
import subprocess
import sys

import pytest
import torch

from dsv4_ops.ops import attention_sm90 as sm90

I32 = torch.int32


def test_disabled_is_scoped_and_keeps_traces_out_of_the_autograd_cache():
    assert sm90._enabled  # the default (the test run leaves DSV4_OPS_GLUON_ATTENTION unset)
    cache_default = torch._functorch.config.enable_autograd_cache
    with sm90.disabled():
        assert not sm90._enabled and not torch._functorch.config.enable_autograd_cache
        with sm90.disabled():
            assert not sm90._enabled
        assert not sm90._enabled
    assert sm90._enabled and torch._functorch.config.enable_autograd_cache == cache_default
    with pytest.raises(RuntimeError, match="export failed"), sm90.disabled():
        raise RuntimeError("export failed")
    assert sm90._enabled  # restored on the way out of a failed export


def test_cpu_tensors_never_take_the_gluon_route():
    H, D = 64, 512  # the widths the route serves, in the dtypes it serves: only the device differs
    args = [torch.randn(1, 1, H, D).bfloat16(), torch.randn(1, 8, D).bfloat16(), torch.zeros(1, 1, 4, dtype=I32),
            torch.randn(1, 8, D).bfloat16(), torch.zeros(1, 1, 4, dtype=I32), torch.zeros(1, 1, dtype=I32)]
    assert not sm90.applies(*args)


@pytest.mark.parametrize("value, enabled", [("0", False), ("1", True), ("", True)])
def test_the_environment_switch(value, enabled):
    code = "from dsv4_ops.ops import attention_sm90 as s; print(s._enabled)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, sm90.ENV: value})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == str(enabled)
