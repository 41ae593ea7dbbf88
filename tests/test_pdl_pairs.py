"""PDL pairs (``lowering/pdl.py``) without a GPU: where the pairing is on, which launches pair up,
and, compiled for sm_90, that the dependent kernel touches no global memory before it waits for
the kernel before it (the CUDA top-k's side: ``tests/test_topk_cuda_build.py``). The pairs' results
against unpaired launches, eager and in CUDA graphs: ``tests/ops/test_pdl_pairs_gpu.py``."""
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from compiled_worker import run_worker
from lowering import pdl

ROOT = Path(__file__).resolve().parents[1]
B, H, D, W, K, NC, RING = 64, 64, 512, 128, 512, 8192, 256
GLOBAL_ACCESS = re.compile(r"\b(?:ld|st|atom|red)\.global|\bcp\.async")


@pytest.fixture
def gpu_like(monkeypatch):
    """``enabled``'s view of a machine with an NVIDIA GPU of capability ``cap`` (no interpreter)."""
    def make(cap):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.version, "hip", None)
        monkeypatch.setattr(pdl, "_sm90_or_newer", lambda index: cap >= (9, 0))
        monkeypatch.setattr(pdl.triton.knobs.runtime, "interpret", False)
    return make


def test_on_for_sm90_cuda_devices_only(gpu_like, monkeypatch):
    gpu_like((9, 0))
    assert pdl.enabled(torch.device("cuda", 0))
    assert not pdl.enabled(torch.device("cpu")) and not pdl.enabled(torch.device("meta"))
    monkeypatch.setattr(pdl, "_enabled", False)  # DSV4_OPS_PDL=0
    assert not pdl.enabled(torch.device("cuda", 0))


def test_off_before_sm90_on_rocm_and_in_the_interpreter(gpu_like, monkeypatch):
    gpu_like((8, 0))
    assert not pdl.enabled(torch.device("cuda", 0))
    gpu_like((9, 0))
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert not pdl.enabled(torch.device("cuda", 0))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(pdl.triton.knobs.runtime, "interpret", True)
    assert not pdl.enabled(torch.device("cuda", 0))


def _attention_inputs(fp8_pool: bool):
    from dsv4_ops.reference import fp8_cache as fp8

    meta = torch.device("meta")
    bf16, i32 = dict(dtype=torch.bfloat16, device=meta), dict(dtype=torch.int32, device=meta)
    if fp8_pool:
        pool = torch.empty(fp8.KVLayout(D, 64, 64).shape(B, NC), dtype=torch.uint8, device=meta)
    else:
        pool = torch.empty(B, NC, D, **bf16)
    return (torch.empty(B, 1, H, D, **bf16), torch.empty(B, RING, D, **bf16), torch.empty(B, 1, W, **i32), pool,
            torch.empty(B, 1, K, **i32), torch.empty(B, 1, **i32), torch.empty(H, dtype=torch.float32, device=meta),
            D ** -0.5)


@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_gluon_attention_pairs_with_its_combine_only_when_split(cache):
    """A split launch is the pair: the attention lets the combine launch at its start, the combine
    is launched with the attribute and waits; unsplit there is no dependent, so no trigger. Off, the
    launches are the unpaired ones."""
    pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")
    if cache == "bf16":
        from lowering.gluon.sparse_attention import gluon_launch as launcher
    else:
        from lowering.gluon.sparse_attention_fp8 import gluon_fp8_launch as launcher
    args = _attention_inputs(cache == "fp8")
    (_, split), (_, one) = launcher(*args, num_splits=2, pdl=True), launcher(*args, num_splits=1, pdl=True)
    assert len(split) == 2 and split[0][3]["PDL_TRIGGER"] is True
    combine_meta = split[1][3]
    assert combine_meta["PDL_WAIT"] == 1 and combine_meta["launch_pdl"] is True
    assert len(one) == 1 and one[0][3]["PDL_TRIGGER"] is False
    _, off = launcher(*args, num_splits=2, pdl=False)
    assert off[0][3]["PDL_TRIGGER"] is False and off[1][3]["PDL_WAIT"] == 0 and "launch_pdl" not in off[1][3]
    _, default = launcher(*args, num_splits=2)  # meta tensors: not a GPU, so not paired
    assert default[0][3]["PDL_TRIGGER"] is False


def test_indexer_scores_trigger_only_when_asked():
    from lowering.triton import indexer as ix

    meta = torch.device("meta")
    q = torch.empty(B, 1, 64, 128, dtype=torch.bfloat16, device=meta)
    w = torch.empty(B, 1, 64, dtype=torch.float32, device=meta)
    keys = torch.empty(B, NC, 128, dtype=torch.bfloat16, device=meta)
    vis = torch.empty(B, 1, dtype=torch.int32, device=meta)
    assert ix.scores_launch(q, w, keys, vis)[1].meta["PDL_TRIGGER"] == 0
    assert ix.scores_launch(q, w, keys, vis, pdl_trigger=True)[1].meta["PDL_TRIGGER"] == 1


# ---- compiled for sm_90 (a subprocess without TRITON_INTERPRET) ----

def _worker():
    import triton
    from triton.backends.compiler import GPUTarget

    sys.path.insert(0, str(ROOT))
    from lowering.gluon.sparse_attention import combine_launch
    from lowering.triton import indexer as ix
    from test_triton_cross_compile import _source

    meta_dev = torch.device("meta")
    target = GPUTarget("cuda", 90, 32)
    ptx = {}

    def compile_(name, kernel, args, meta):
        meta = {k: v for k, v in meta.items() if k != "launch_pdl"}  # a launch option, not a constexpr
        compiled = triton.compile(_source(kernel, args, meta), target=target,
                                  options={"num_warps": meta.get("num_warps", 4), "num_stages": meta.get("num_stages", 3)})
        ptx[name] = compiled.asm["ptx"]

    part_m = torch.empty(B, 2, H, dtype=torch.float32, device=meta_dev)
    part_acc = torch.empty(B, 2, H, D, dtype=torch.float32, device=meta_dev)
    sink = torch.empty(H, dtype=torch.float32, device=meta_dev)
    out = torch.empty(B, 1, H, D, dtype=torch.bfloat16, device=meta_dev)
    for pair in (True, False):
        kernel, _, args, meta = combine_launch(part_m, part_m, part_acc, sink, out, 2, pair)
        compile_(f"combine_pdl{int(pair)}", kernel, args, meta)
    q = torch.empty(B, 1, 64, 128, dtype=torch.bfloat16, device=meta_dev)
    w = torch.empty(B, 1, 64, dtype=torch.float32, device=meta_dev)
    keys = torch.empty(B, NC, 128, dtype=torch.bfloat16, device=meta_dev)
    vis = torch.empty(B, 1, dtype=torch.int32, device=meta_dev)
    for pair in (True, False):
        _, launch = ix.scores_launch(q, w, keys, vis, pdl_trigger=pair)
        compile_(f"scores_pdl{int(pair)}", ix.indexer_scores_kernel, launch.args, launch.meta)
    print(json.dumps(ptx))


@pytest.fixture(scope="module")
def ptx():
    return run_worker(__file__)


def test_combine_waits_before_any_global_access(ptx):
    paired = ptx["combine_pdl1"]
    first_access = GLOBAL_ACCESS.search(paired).start()
    assert paired.count("griddepcontrol.wait") == 1
    assert paired.index("griddepcontrol.wait") < first_access, "the combine reads partials before the wait"
    assert "griddepcontrol" not in ptx["combine_pdl0"]


def test_scores_pass_lets_its_dependent_launch_at_its_start(ptx):
    paired = ptx["scores_pdl1"]
    assert paired.count("griddepcontrol.launch_dependents") == 1
    assert paired.index("griddepcontrol.launch_dependents") < GLOBAL_ACCESS.search(paired).start()
    assert "griddepcontrol" not in ptx["scores_pdl0"]


if __name__ == "__main__":
    _worker()
