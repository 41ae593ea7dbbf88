"""GPU box: the compiled generator replays as CUDA graphs (Inductor cudagraph trees) with
zero cudagraph skips, no recompiles after warm-up within a batch bucket, and exactly the
eager tokens (fp32, so the comparison is exact; bf16 rounding differs between fused and
unfused kernels)."""
from __future__ import annotations

import pytest
import torch

from dsv4_ops import DSV4Config, Generator
from model_util import random_model

pytestmark = pytest.mark.gpu


def test_cuda_graph_tokens_equal_eager_zero_skips():
    from torch._dynamo.utils import counters

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = DSV4Config.tiny(num_hidden_layers=3, hca_ratio=8)
    model = random_model(cfg, dtype=torch.float32, device="cuda")
    kw = dict(max_batch_size=4, max_seq_len=192, prefill_chunk=32)
    prompts = [[3, 1, 4, 1, 5], list(range(40)), [7] * 17]
    others = [[9] * 60, [1, 2], [5, 4, 3, 2, 1] * 7]  # other lengths, same bucket (3 prompts -> 4)
    eager = Generator(model, compile=False, **kw)
    want, want_other = eager.generate(prompts, max_new_tokens=70), eager.generate(others, max_new_tokens=8)

    gen = Generator(model, compile=True, cuda_graphs=True, **kw)
    counters.clear()
    gen.generate(prompts, max_new_tokens=3)  # warm-up: compile + record
    graphs = dict(gen._graphs)
    with torch.compiler.set_stance("fail_on_recompile"):
        out = gen.generate(prompts, max_new_tokens=70)  # 69 decode steps across window + HCA blocks
        other = gen.generate(others, max_new_tokens=8)
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert gen._graphs == graphs and gen.stats["recompiles"] == 0 and gen.stats["graph_breaks"] == 0
    assert gen.stats["cuda_graph_replays"] >= 69
    assert out == want
    assert other == want_other


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_step_replays_as_one_cuda_graph(k):
    """The whole speculative step (verify, accept, MTP extend, k-1 drafts) is one compiled
    graph replayed as a CUDA graph: zero skips, no recompiles, exactly the greedy tokens."""
    from torch._dynamo.utils import counters

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = DSV4Config.tiny(num_hidden_layers=3, hca_ratio=8)
    model = random_model(cfg, dtype=torch.float32, device="cuda")
    kw = dict(max_batch_size=4, max_seq_len=192, prefill_chunk=32)
    prompts = [[3, 1, 4, 1, 5], list(range(40)), [7] * 17]
    want = Generator(model, compile=False, **kw).generate(prompts, max_new_tokens=70)
    gen = Generator(model, compile=True, cuda_graphs=True, spec_steps=k, **kw)
    counters.clear()
    gen.generate(prompts, max_new_tokens=3)
    graphs = dict(gen._graphs)
    with torch.compiler.set_stance("fail_on_recompile"):
        out = gen.generate(prompts, max_new_tokens=70)
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert gen._graphs == graphs and gen.stats["recompiles"] == 0 and gen.stats["graph_breaks"] == 0
    assert gen.stats["cuda_graph_replays"] >= 64
    assert out == want
