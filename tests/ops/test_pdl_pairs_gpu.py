"""On an sm_90 GPU, the PDL pairs (``lowering/pdl.py``) give the unpaired launches' bits: the
indexer's scores pass with its CUDA top-k (rows of 8192 and 32768 scores: the register and the
list kernel) and the split Gluon attention with its combine, eager and replayed in a CUDA graph
on fresh inputs. A dependent that read before the wait would read the previous call's scores or
partials (the graph reuses the buffers), which fresh inputs make differ."""
import pytest
import torch

import dsv4_ops  # noqa: F401  (registers the ops)
from dsv4_ops.ops import topk_cuda
from lowering import pdl

SM90 = torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not SM90, reason="PDL pairs run on sm_90 GPUs")]
I32 = torch.int32


@pytest.fixture
def pairing(monkeypatch):
    def set_(on: bool):
        monkeypatch.setattr(pdl, "_enabled", on)
        assert pdl.enabled(torch.device("cuda")) is on
    return set_


def indexer_inputs(seed, B, N):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, 1, 64, 128, generator=g, device="cuda").bfloat16()
    w = torch.randn(B, 1, 64, generator=g, device="cuda") * 0.1
    keys = torch.randn(B, N, 128, generator=g, device="cuda").bfloat16()
    visible = torch.randint(N // 2, N + 1, (B, 1), generator=g, device="cuda", dtype=I32)
    return [q, w, keys, visible]


def replays_equal_unpaired(call, make_args, pairing, replays=4):
    """``call(*args)`` captured paired in a CUDA graph, replayed on fresh inputs copied in: each
    replay equals the unpaired eager call on those inputs, bit for bit."""
    static = make_args(100)
    pairing(True)
    call(*static)  # warm-up (builds, first launches) before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(*static)
    for seed in range(replays):
        fresh = make_args(seed)
        for s, f in zip(static, fresh):
            if isinstance(s, torch.Tensor):
                s.copy_(f)
        graph.replay()
        pairing(False)
        want = call(*fresh)
        pairing(True)
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"replay {seed}"


@pytest.mark.parametrize("N", [8192, 32768])
def test_indexer_topk_pair_gives_the_unpaired_picks(pairing, N):
    args = indexer_inputs(0, 64, N)
    assert topk_cuda.applies((64, 1, N), args[0].device, 512), "the op must take the CUDA top-k here"
    pairing(False)
    want = torch.ops.dsv4.indexer_topk(*args, 512)
    pairing(True)
    before = topk_cuda.stats["launches"]
    got = torch.ops.dsv4.indexer_topk(*args, 512)
    assert topk_cuda.stats["launches"] == before + 1
    assert torch.equal(got, want)
    replays_equal_unpaired(lambda *a: torch.ops.dsv4.indexer_topk(*a, 512),
                           lambda seed: indexer_inputs(seed, 64, N), pairing)


def attention_inputs(seed, B=64, N=256, Nc=8192, W=128, K=512):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, 1, 64, 512, generator=g, device="cuda").bfloat16()
    kv = torch.randn(B, N, 512, generator=g, device="cuda").bfloat16()
    cmp = torch.randn(B, Nc, 512, generator=g, device="cuda").bfloat16()
    kv_idx = torch.randint(-1, N, (B, 1, W), generator=g, device="cuda", dtype=I32)
    cmp_idx = torch.randint(-1, Nc, (B, 1, K), generator=g, device="cuda", dtype=I32)
    cmp_len = torch.zeros(B, 1, device="cuda", dtype=I32)
    sink = torch.randn(64, generator=g, device="cuda")
    return [q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, 512 ** -0.5]


def test_split_gluon_attention_pair_gives_the_unpaired_output(pairing):
    from lowering.gluon.sparse_attention import gluon_launch, sparse_attention_gluon

    def call(*args):
        return sparse_attention_gluon(*args, num_splits=2)

    args = attention_inputs(0)
    assert gluon_launch(*args, num_splits=2, pdl=True)[1][1][3]["launch_pdl"] is True
    pairing(False)
    want = call(*args)
    pairing(True)
    assert torch.equal(call(*args), want)
    replays_equal_unpaired(call, attention_inputs, pairing)
