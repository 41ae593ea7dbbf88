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


def _fp8_args(window="fp8", pool="fp8", entry_bytes=584, offset=0, S=1):
    """Meta tensors (shapes, dtypes, strides only) of a decode call over FP8 pages."""
    H, D, B = 64, 512, 2
    meta = dict(device="meta")
    flat = torch.empty(B * 32 * 64 * entry_bytes + offset, dtype=torch.uint8, **meta)
    pages = flat[offset:].view(B, 32, 64, entry_bytes)
    kv = torch.empty(B, 1, 128, entry_bytes, dtype=torch.uint8, **meta) if window == "fp8" else \
        torch.empty(B, 256, D, dtype=torch.bfloat16, **meta)
    cmp = pages if pool == "fp8" else torch.empty(B, 2048, D, dtype=torch.bfloat16, **meta)
    return [torch.empty(B, S, H, D, dtype=torch.bfloat16, **meta), kv, torch.empty(B, S, 128, dtype=I32, **meta),
            cmp, torch.empty(B, S, 512, dtype=I32, **meta), torch.empty(B, S, dtype=I32, **meta)]


@pytest.mark.parametrize("change, served", [
    (dict(), True),  # FP8 mode 2: window and pool pages
    (dict(window="bf16"), True),  # FP8 mode 1: a bf16 window ring, an FP8 pool
    (dict(pool="bf16"), False),  # an FP8 window over a float pool: no such mode
    (dict(entry_bytes=576), False),  # not 448 nope + 64 rope + 8 scale bytes
    (dict(offset=8), False),  # pages off a 16-byte boundary (the reader's copies are 16 B)
    (dict(S=2), False),  # prefill
])
def test_which_fp8_caches_the_gluon_reader_serves(change, served):
    """What ``applies`` routes FP8 calls on (devices aside): a static function of dtypes, shapes
    and strides; anything the reader cannot take keeps the Triton kernel."""
    pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")
    from lowering.gluon.sparse_attention_fp8 import serves
    assert serves(*_fp8_args(**change)) is served


def test_the_variant_switch_picks_a_known_kernel():
    """``DSV4_OPS_GLUON_VARIANT`` names the bf16 kernel variant the route launches (for measuring
    one through the public op); every name it may take is a variant of the Gluon module, with a
    default config that passes the launcher's own checks."""
    pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")
    from lowering.gluon import sparse_attention as ga
    code = "from dsv4_ops.ops import attention_sm90 as s; print(s.variant)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, sm90.VARIANT_ENV: "v0"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "v0"
    assert sm90.variant is None  # unset: the launcher's default, which is one of its variants
    assert ga.DEFAULT_VARIANT in ga.VARIANTS
    for name in ga.VARIANTS:
        cfg = ga.gluon_config(64, 640, variant=name)
        assert cfg["variant"] == name
        want = ga.DEFAULT_BLOCKS_WS if name == "ws" else ga.DEFAULT_BLOCKS
        assert (cfg["BLOCK_N"], cfg["NUM_STAGES"]) == want
    with pytest.raises(ValueError, match="num_stages must be >= 2"):
        ga.gluon_config(64, 640, num_stages=1)
    with pytest.raises(ValueError, match="variant must be one of"):
        ga.gluon_config(64, 640, variant="v9")


def test_the_fp8_variant_switch_picks_a_known_reader():
    """``DSV4_OPS_GLUON_FP8_VARIANT`` names the FP8 reader the route launches; unset, the
    launcher's default (ws); every variant's default config fits shared memory, and what the
    launcher refuses is named."""
    pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")
    from lowering.gluon import sparse_attention_fp8 as gf
    code = "from dsv4_ops.ops import attention_sm90 as s; print(s.fp8_variant)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, sm90.FP8_VARIANT_ENV: "v0"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "v0"
    assert sm90.fp8_variant is None and gf.DEFAULT_VARIANT == "ws"
    for name, (block_n, stages, bufs) in gf.VARIANTS.items():
        cfg = gf.gluon_fp8_config(64, 640, variant=name)
        assert (cfg["variant"], cfg["BLOCK_N"], cfg["NUM_STAGES"]) == (name, block_n, stages)
        assert gf.fp8_smem_bytes(cfg["BLOCK_N"], cfg["NUM_STAGES"], cfg["E_BUFS"], name) <= gf.SMEM_LIMIT
    with pytest.raises(ValueError, match="variant must be one of"):
        gf.gluon_fp8_config(64, 640, variant="v9")
    with pytest.raises(ValueError, match="variant ws needs e_bufs >= 2"):
        gf.gluon_fp8_config(64, 640, variant="ws", e_bufs=1)
    args = _fp8_args()
    sink = torch.empty(64, device="meta")
    with pytest.raises(ValueError, match="one_store rows at a time"):
        gf.gluon_fp8_launch(*args, sink, 0.04, variant="ws", one_store=12)
    with pytest.raises(ValueError, match=r"needs \d+ B of shared memory"):
        gf.gluon_fp8_launch(*args, sink, 0.04, variant="ws", num_stages=4, e_bufs=3)
