"""Shared by the engine tests: a tiny model, random prompts, and a driver that lets requests
arrive at random steps. Speculative cases (``spec_steps > 0``) run the bundled trained tiny model
on Python source, whose MTP block's drafts are accepted often but not always (random weights
accept almost none, which would leave partial acceptance untested)."""
import functools
import inspect
import json.decoder
import random
import textwrap

import torch

from dsv4_ops import DSV4Config, DeepseekV4ForCausalLM, Generator, load_pretrained, pretrained
from dsv4_ops.serve import Engine

PAGE, CHUNK = 32, 16  # the tiny config's rates are 4 and 16: a 32-position page holds 8 CSA / 2 HCA blocks
MAX_LEN = 256


def tiny_model(seed: int = 0, **config) -> DeepseekV4ForCausalLM:
    """A random-weight ``DSV4Config.tiny(**config)`` model."""
    torch.manual_seed(seed)
    return DeepseekV4ForCausalLM(DSV4Config.tiny(**config)).eval()


def engine(model, **kw) -> Engine:
    args = dict(max_running=4, max_seq_len=MAX_LEN, page_size=PAGE, prefill_chunk=CHUNK, compile=False)
    return Engine(model, **{**args, **kw})


@functools.cache
def trained_model() -> DeepseekV4ForCausalLM:
    """The bundled trained tiny model (window 64, rates 4 and 16, vocab 2048), loaded once."""
    return load_pretrained(pretrained.tiny()).eval()


def alone(model, prompt, spec_steps: int = 0, **kw) -> list[int]:
    """What ``Generator.generate([prompt])`` gives, the engine's oracle (same prefill chunk)."""
    return alone_spec(model, prompt, spec_steps, **kw)[0]


def alone_spec(model, prompt, spec_steps: int, **kw) -> tuple[list[int], int]:
    """``Generator(spec_steps=k).generate([prompt])`` -> (tokens, drafts accepted)."""
    gen = Generator(model, max_batch_size=1, max_seq_len=MAX_LEN, compile=False, prefill_chunk=CHUNK,
                    spec_steps=spec_steps)
    return gen.generate([prompt], **kw)[0], gen.stats["accepted_tokens"]


def random_prompts(rng: random.Random, n: int, lengths=(1, 100)) -> list[list[int]]:
    return [[rng.randrange(256) for _ in range(rng.randint(*lengths))] for _ in range(n)]


@functools.cache
def _source_tokens() -> list[int]:
    text = inspect.getsource(json.decoder) + inspect.getsource(textwrap)
    return pretrained.tokenizer().encode(text).ids


def text_tokens(rng: random.Random, n: int) -> list[int]:
    """``n`` consecutive tokens of Python source from a random place (the trained model's prompts)."""
    ids = _source_tokens()
    start = rng.randrange(len(ids) - n)
    return ids[start:start + n]


def text_prompts(rng: random.Random, n: int, lengths=(1, 100)) -> list[list[int]]:
    return [text_tokens(rng, rng.randint(*lengths)) for _ in range(n)]


def run_arriving(eng: Engine, requests: list[dict], rng: random.Random, max_steps: int = 10_000) -> dict:
    """Add ``requests`` (``add_request`` keyword dicts) at random steps; run until all finish.
    Returns ``{index: (tokens, finish_reason, cached_tokens, accepted_tokens)}``."""
    pending = list(enumerate(requests))
    ids, out = {}, {}
    for _ in range(max_steps):
        while pending and (not eng.has_unfinished() or rng.random() < 0.3):
            i, kw = pending.pop(0)
            ids[eng.add_request(**kw)] = i
        for o in eng.step():
            tokens = out.get(ids[o.request_id], ([],))[0]
            out[ids[o.request_id]] = (tokens + o.new_token_ids, o.finish_reason, o.cached_tokens, o.accepted_tokens)
        if not pending and not eng.has_unfinished():
            return out
    raise AssertionError("the engine did not finish")
