"""``Generator.stream``: one prompt's tokens step by step, on the bundled trained tiny model (eager).

Specification: the streamed steps joined are ``generate([prompt], ...)[0]`` for greedy, seeded
sampling and a stop id, plain (one token a step) and speculative (1 to k+1 tokens a step); the
arguments are checked when ``stream`` is called, before any step.
"""
from __future__ import annotations

import pytest

import dsv4_ops

NEW = 5


@pytest.fixture(scope="module")
def model():
    return dsv4_ops.load_pretrained(dsv4_ops.pretrained.tiny())


@pytest.fixture(scope="module")
def prompt():
    return dsv4_ops.pretrained.tokenizer().encode("def add(a, b):").ids


@pytest.mark.parametrize("spec_steps", [0, 2])
def test_stream_joins_to_generate(model, prompt, spec_steps):
    gen = dsv4_ops.Generator(model, max_batch_size=1, max_seq_len=64, spec_steps=spec_steps, compile=False)
    greedy = gen.generate([prompt], NEW)[0]
    sampling = dict(temperature=0.9, top_k=40, top_p=0.9, seed=3)
    for kw, want in [(dict(), greedy), (sampling, gen.generate([prompt], NEW, **sampling)[0]),
                     (dict(eos_token_id=[greedy[2]]), greedy[:3])]:  # generate keeps the stop id, then stops
        steps = list(gen.stream(prompt, NEW, **kw))
        assert all(1 <= len(s) <= spec_steps + 1 for s in steps)
        assert sum(steps, []) == want, kw
    if spec_steps:
        assert gen.stats["drafted_tokens"] > 0


def test_stream_checks_its_arguments_before_running(model, prompt):
    gen = dsv4_ops.Generator(model, max_batch_size=1, max_seq_len=16, compile=False)
    with pytest.raises(ValueError, match="temperature"):
        gen.stream(prompt, 4, temperature=-1)
    with pytest.raises(ValueError, match="stream: prompts.*max_seq_len 16"):
        gen.stream(prompt, 16)
    assert gen.stats["prefill_steps"] == 0
