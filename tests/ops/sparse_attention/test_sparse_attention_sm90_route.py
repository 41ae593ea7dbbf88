"""The switch in front of the sm_90 Gluon attention (``dsv4_ops/ops/attention_sm90.py``), on
any machine: the ``DSV4_OPS_GLUON_ATTENTION=0`` environment switch turns the route off, CPU tensors
never take it, and both Gluon launchers split a call as the Triton kernel would. That it steps aside
while torch exports is checked on the GPU. The route's numerics and its use in compiled graphs:
``test_sparse_attention_sm90.py`` (GPU)."""
import os
import subprocess
import sys

import pytest
import torch

from dsv4_ops.ops import attention_sm90 as sm90

I32 = torch.int32


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


def _fp8_args(window="fp8", pool="fp8", entry_bytes=584, offset=0, S=1, B=2):
    """Meta tensors (shapes, dtypes, strides only) of a decode call over FP8 pages."""
    H, D = 64, 512
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
    from dsv4_ops.lowering.gluon.sparse_attention_fp8 import serves
    assert serves(*_fp8_args(**change)) is served


@pytest.mark.parametrize("B", [1, 64, 128])
@pytest.mark.parametrize("window, pool", [("bf16", "bf16"), ("fp8", "fp8"), ("bf16", "fp8")])
def test_the_gluon_launchers_split_as_the_triton_kernel(B, window, pool):
    """Both launchers plan the Triton kernel's split count for the call (its rule, on the entries it plans for:
    window + picks) and merge several splits with ``combine_kernel``; nothing here launches (meta tensors)."""
    pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")
    from dsv4_ops.lowering.gluon import sparse_attention as ga, sparse_attention_fp8 as gf
    from dsv4_ops.lowering.triton.sparse_attention import attention_config, combine_kernel
    launch = ga.gluon_launch if pool == "bf16" else gf.gluon_fp8_launch
    _, launches = launch(*_fp8_args(window, pool, B=B), torch.empty(64, device="meta"), 0.04)
    splits = attention_config(B, 1, 64, 512, 128 + 512)["NUM_SPLITS"]
    assert launches[0][1] == (B, splits) and launches[0][3]["NUM_SPLITS"] == splits
    assert [k for k, *_ in launches[1:]] == ([combine_kernel] if splits > 1 else [])


@pytest.mark.parametrize("pool, served", [
    ("bf16", True),  # pages back to back: one row of num_pages * page entries
    ("bf16_strided", False),  # pages at a stride: not one row without a copy
    ("fp8", True),  # FP8 pages back to back
    ("fp8_padded", False),  # FlashMLA's padded page stride: the reader addresses pages back to back
    ("empty", False),  # no pages
])
def test_which_paged_pools_take_the_gluon_route(monkeypatch, pool, served):
    """A compressed pool read through a block table takes the Gluon route when its pages can be seen as one row
    that all queries share (``attention_sm90.shared_rows``; the entries are then translated, ``paged_entries``);
    otherwise it keeps the Triton kernel. An sm_90 device with Gluon stood in for, fake CUDA tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(sm90, "_enabled", True)
    monkeypatch.setattr(sm90, "gluon_available", lambda: True)
    monkeypatch.setattr(sm90, "capability", lambda index: (9, 0))
    monkeypatch.setattr(sm90, "device_index", lambda device: 0)
    if pool.startswith("fp8"):
        pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")
    B, H, D, E = 2, 64, 512, 584
    with FakeTensorMode(allow_non_fake_inputs=False):
        cuda = dict(device="cuda:0")
        q, kv = torch.empty(B, 1, H, D, dtype=torch.bfloat16, **cuda), torch.empty(B, 256, D, dtype=torch.bfloat16, **cuda)
        idx = (torch.empty(B, 1, 128, dtype=I32, **cuda), torch.empty(B, 1, 512, dtype=I32, **cuda),
               torch.empty(B, 1, dtype=I32, **cuda))
        pages = {"bf16": lambda: torch.empty(65, 64, D, dtype=torch.bfloat16, **cuda),
                 "bf16_strided": lambda: torch.empty_strided((65, 64, D), (80 * D, D, 1), dtype=torch.bfloat16, **cuda),
                 "fp8": lambda: torch.empty(65, 64, E, dtype=torch.uint8, **cuda),
                 "fp8_padded": lambda: torch.empty_strided((65, 64, E), (65 * E, E, 1), dtype=torch.uint8, **cuda),
                 "empty": lambda: torch.empty(0, 64, D, dtype=torch.bfloat16, **cuda)}[pool]()
        if pool.startswith("fp8"):  # the FP8 window pages the model pairs with an FP8 pool
            kv = torch.empty(B, 1, 128, E, dtype=torch.uint8, **cuda)
        table = torch.empty(B, 32, dtype=I32, **cuda)
        assert sm90.applies(q, kv, idx[0], pages, idx[1], idx[2], table) is served
