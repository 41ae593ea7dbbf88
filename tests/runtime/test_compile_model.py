"""The generator's steps compile with fullgraph=True, never recompile after warm-up (64+
decode steps, new prompts of other lengths within the bucket), and the compiled tokens equal
the eager tokens. One Generator per module: compiling on CPU costs tens of seconds."""
from __future__ import annotations

import copy

import pytest
import torch

from dsv4_ops import DSV4Config, Generator
from model_util import random_model


@pytest.fixture(scope="module")
def setup():
    # sliding + CSA + HCA layers; small HCA rate so 64+ decode steps cross its blocks
    cfg = DSV4Config.tiny(num_hidden_layers=3, hca_ratio=8)
    model = random_model(cfg)
    kw = dict(max_batch_size=4, max_seq_len=192, prefill_chunk=32)
    eager = Generator(model, compile=False, **kw)
    compiled = Generator(model, compile=True, cuda_graphs=False, **kw)
    prompts = [[3, 1, 4, 1, 5], list(range(40)), [7] * 17]
    warm = compiled.generate(prompts, max_new_tokens=4)  # compiles prefill + decode (bucket 4)
    return eager, compiled, prompts, warm


def test_compiled_tokens_equal_eager(setup):
    eager, compiled, prompts, warm = setup
    assert warm == eager.generate(prompts, max_new_tokens=4)
    assert compiled.stats["graph_breaks"] == 0


def test_no_recompiles_over_64_decode_steps_and_new_prompt_lengths(setup):
    eager, compiled, _, _ = setup
    graphs = dict(compiled._graphs)
    assert graphs == {("prefill", 4): 1, ("decode", 4): 1}
    # 50 and 100 tokens: more prefill chunks (of 32) than the warm-up's 2, same bucket
    new_prompts = [[11] * 3, list(range(70, 20, -1)), [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4], [9] * 100]
    with torch.compiler.set_stance("fail_on_recompile"):
        out = compiled.generate(new_prompts, max_new_tokens=70)  # crosses window 16 and HCA rate 8
        out2 = compiled.generate(new_prompts[:3], max_new_tokens=5)  # 3 prompts: same bucket 4
    assert compiled._graphs == graphs
    assert compiled.stats["recompiles"] == 0
    assert out == eager.generate(new_prompts, max_new_tokens=70)
    assert out2 == [o[:5] for o in out[:3]]


def test_speculative_step_compiles_once_and_stays_exact(setup):
    """The whole speculative step (verify k+1 tokens, accept, MTP extend, k-1 MTP drafts) is one
    fullgraph compile; >= 64 steps and new prompt lengths in the same bucket never recompile."""
    eager, _, _, _ = setup
    model = eager.model
    kw = dict(max_batch_size=4, max_seq_len=192, prefill_chunk=32)
    gen = Generator(model, spec_steps=2, compile=True, cuda_graphs=False, **kw)
    gen.generate([[1, 2, 3], [4] * 9], max_new_tokens=3)  # warm-up: compiles spec_prefill + spec (bucket 2)
    graphs = dict(gen._graphs)
    assert set(graphs) == {("spec_prefill", 2), ("spec", 2)} and all(g == 1 for g in graphs.values())
    prompts = [list(range(30, 130)), [5, 9, 2]]  # 100 tokens: 4 prefill chunks vs 1 at warm-up
    steps_before = gen.stats["spec_steps_run"]
    with torch.compiler.set_stance("fail_on_recompile"):
        out = gen.generate(prompts, max_new_tokens=70)
    assert gen.stats["spec_steps_run"] - steps_before >= 64  # random MTP weights: ~1 token per step
    assert gen._graphs == graphs and gen.stats["recompiles"] == 0 and gen.stats["graph_breaks"] == 0
    assert out == eager.generate(prompts, max_new_tokens=70)


def test_single_prompt_bucket_prefills_new_lengths_without_recompiling(setup, tol):
    """Bucket 1 (one request), the common serving case: prompts with more prefill chunks than
    the warm-up reuse the compiled prefill step (it once recompiled per prompt length there), and
    decode takes a token column view (a strided [1] tensor) without recompiling (it once did)."""
    eager, _, _, _ = setup
    # the pool belongs to the model: the eager side runs on a copy, so the two never share it
    eager = Generator(copy.deepcopy(eager.model), max_batch_size=1, max_seq_len=192, prefill_chunk=32, compile=False)
    gen = Generator(setup[0].model, max_batch_size=1, max_seq_len=192, prefill_chunk=32, compile=True,
                    cuda_graphs=False)
    gen.decode(gen.prefill([[4, 2]]).argmax(-1))  # warm-up: one chunk, one decode step
    assert gen._graphs == {("prefill", 1): 1, ("decode", 1): 1}
    column = torch.tensor([[5, 9], [6, 9]])[:1, 0]  # shape [1], stride (2,)
    assert column.shape == (1,) and column.stride() == (2,)
    with torch.compiler.set_stance("fail_on_recompile"):
        for n in (33, 100, 150):  # 2, 4 and 5 chunks
            logits = gen.prefill([list(range(n))])
            torch.testing.assert_close(logits, eager.prefill([list(range(n))]), **tol("compiled_generator_vs_eager"))
            torch.testing.assert_close(gen.decode(column), eager.decode(column), **tol("compiled_generator_vs_eager"))
    assert gen._graphs == {("prefill", 1): 1, ("decode", 1): 1} and gen.stats["recompiles"] == 0


def test_each_new_step_shape_of_a_compiled_generator_is_announced_once(setup, monkeypatch, capsys):
    """With the notice at 0 s every first call of a shape says so (by default only one that runs past 5 s)."""
    from dsv4_ops import compiled_steps

    _, compiled, prompts, _ = setup
    monkeypatch.setattr(compiled_steps, "COMPILE_NOTICE_S", 0.0)
    before = set(compiled._calls.keys)
    batch = next(b for b in (1, 2) if not any(k[1] == b for k in before))  # a batch bucket not run yet
    capsys.readouterr()
    compiled.generate(prompts[:batch], max_new_tokens=3)
    compiled.generate(prompts[:batch], max_new_tokens=3)
    err = capsys.readouterr().err
    new = set(compiled._calls.keys) - before
    assert new and {k[0] for k in new} == {"prefill", "decode"}
    started = [line for line in err.splitlines() if line.endswith(" ...")]  # then each one's "done in" line
    assert len(started) == len(new)
    for key in new:
        assert sum(f"compiling the {' / '.join(map(str, key))} step" in line for line in started) == 1, key
