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


@pytest.mark.parametrize("spec_steps", [0, 2])
def test_chunk_buckets_replay_for_new_prompt_lengths_and_give_the_eager_tokens(spec_steps):
    """The default prefill, chunk buckets (here 8 / 32 / 128), replayed as CUDA graphs: once each
    chunk bucket has run, prompts of new lengths compile nothing and skip no graph, and plain and
    speculative decoding give the eager tokens of a fixed 32-token chunk."""
    from torch._dynamo.utils import counters

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = DSV4Config.tiny(num_hidden_layers=3, hca_ratio=8)
    model = random_model(cfg, dtype=torch.float32, device="cuda")
    kw = dict(max_batch_size=4, max_seq_len=192)
    # 3 prompts a batch (bucket 4); the longest decides each step's chunk
    warm = [[[3, 1, 4, 1, 5], [7] * 2, [9]],  # 8
            [list(range(20)), [2] * 3, [1]],  # 32
            [list(range(150)), [7] * 17, [4, 4]]]  # 128 + 32
    others = [[[6] * 7, [1, 2], [5]],  # 8
              [list(range(60, 0, -1)), [8] * 30, [3]],  # 128
              [[5, 4, 3, 2, 1] * 28, [9] * 60, [2] * 9]]  # 140: 128 + 32
    eager = Generator(model, compile=False, prefill_chunk=32, **kw)
    want = [eager.generate(p, max_new_tokens=8) for p in warm + others]

    # a graph another test of this process compiled for a model of the same shapes would serve this one
    torch._dynamo.reset()
    gen = Generator(model, compile=True, cuda_graphs=True, spec_steps=spec_steps, _chunk_buckets=(8, 32, 128), **kw)
    counters.clear()
    got = [gen.generate(p, max_new_tokens=8) for p in warm]  # compile + record
    graphs = dict(gen._graphs)
    kind = "spec_prefill" if spec_steps else "prefill"
    assert {key for key in graphs if key[0] == kind} == {(kind, 4, 8), (kind, 4, 32), (kind, 4, 128)}
    with torch.compiler.set_stance("fail_on_recompile"):
        got += [gen.generate(p, max_new_tokens=8) for p in others]
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert gen._graphs == graphs and gen.stats["recompiles"] == 0 and gen.stats["graph_breaks"] == 0
    assert gen.stats["cuda_graph_replays"] > 0
    assert got == want


def test_a_decode_loop_never_syncs_the_stream_and_a_bad_id_still_raises(tol):
    """``decode`` launches its step before it reads the ids' range back (through an event), so a loop
    of ``decode(logits.argmax(-1))`` keeps the GPU busy: the sync debug mode flags no stream sync
    (one known sync shows that it is on), the logits are the eager ones, and an out-of-range id
    still raises in its own call and leaves the state as it was."""
    from cuda_syncs import counted_syncs

    torch.backends.cuda.matmul.allow_tf32 = False
    model = random_model(DSV4Config.tiny(num_hidden_layers=3, hca_ratio=8), dtype=torch.float32, device="cuda")
    prompts = [[3, 1, 4, 1, 5], list(range(20))]
    eager = Generator(model, compile=False, max_batch_size=2, max_seq_len=64, prefill_chunk=16)
    want = [eager.prefill(prompts)]
    for _ in range(8):
        want.append(eager.decode(want[-1].argmax(-1)))
    gen = Generator(model, compile=True, cuda_graphs=True, max_batch_size=2, max_seq_len=64, prefill_chunk=16)
    got = [gen.prefill(prompts)]
    got.append(gen.decode(got[-1].argmax(-1)))  # compiles and records
    got.append(gen.decode(got[-1].argmax(-1)))
    with counted_syncs() as syncs:
        for _ in range(6):
            got.append(gen.decode(got[-1].argmax(-1)))
    assert not syncs, syncs  # where each one came from
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol("compiled_generator_vs_eager"))
    bad = got[-1].argmax(-1)
    bad[1] = model.config.vocab_size
    with pytest.raises(ValueError, match=r"next_ids\[1\] = .* is outside"):
        gen.decode(bad)
    want.append(eager.decode(want[-1].argmax(-1)))
    torch.testing.assert_close(gen.decode(got[-1].argmax(-1)), want[-1], **tol("compiled_generator_vs_eager"))
