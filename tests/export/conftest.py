"""One exported package for every export test (a CPU AOTInductor compile takes a minute or two
per program on a 2-core machine): the tiny model's prefill + decode programs and its speculative
programs, and the tokens the eager ``Generator`` makes for a ragged batch, which every way of
running the package must match."""
from __future__ import annotations

import pytest

from dsv4_ops import Generator
from model_util import random_model

from package_case import CFG, LIMITS, NEW_TOKENS, PACKAGE_CHUNKS, PROMPTS, SPEC_STEPS


@pytest.fixture(scope="session")
def tiny_model():
    return random_model(CFG, seed=21)


@pytest.fixture(scope="session")
def eager_tokens(tiny_model):
    gen = Generator(tiny_model, compile=False, **LIMITS)
    return gen.generate(PROMPTS, max_new_tokens=NEW_TOKENS)


@pytest.fixture(scope="session")
def tiny_package(tiny_model, tmp_path_factory):
    import dsv4_ops

    path = tmp_path_factory.mktemp("pkg") / "tiny.pt2"
    return str(dsv4_ops.export(tiny_model, path, spec_steps=SPEC_STEPS, **{**LIMITS, "prefill_chunk": PACKAGE_CHUNKS}))
