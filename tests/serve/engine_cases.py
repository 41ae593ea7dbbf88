"""Shared by the engine tests: a tiny model, random prompts, and a driver that lets requests
arrive at random steps."""
import random

import torch

from dsv4_ops import DSV4Config, DeepseekV4ForCausalLM, Generator
from dsv4_ops.serve import Engine

PAGE, CHUNK = 32, 16  # the tiny config's rates are 4 and 16: a 32-position page holds 8 CSA / 2 HCA blocks
MAX_LEN = 256


def tiny_model(seed: int = 0) -> DeepseekV4ForCausalLM:
    torch.manual_seed(seed)
    return DeepseekV4ForCausalLM(DSV4Config.tiny()).eval()


def engine(model, **kw) -> Engine:
    args = dict(max_running=4, max_seq_len=MAX_LEN, page_size=PAGE, prefill_chunk=CHUNK, compile=False)
    return Engine(model, **{**args, **kw})


def alone(model, prompt, **kw) -> list[int]:
    """What ``Generator.generate([prompt])`` gives, the engine's oracle (same prefill chunk)."""
    gen = Generator(model, max_batch_size=1, max_seq_len=MAX_LEN, compile=False, prefill_chunk=CHUNK)
    return gen.generate([prompt], **kw)[0]


def random_prompts(rng: random.Random, n: int, lengths=(1, 100)) -> list[list[int]]:
    return [[rng.randrange(256) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def run_arriving(eng: Engine, requests: list[dict], rng: random.Random, max_steps: int = 10_000) -> dict:
    """Add ``requests`` (``add_request`` keyword dicts) at random steps; run until all finish.
    Returns ``{index: (tokens, finish_reason, cached_tokens)}``."""
    pending = list(enumerate(requests))
    ids, out = {}, {}
    for _ in range(max_steps):
        while pending and (not eng.has_unfinished() or rng.random() < 0.3):
            i, kw = pending.pop(0)
            ids[eng.add_request(**kw)] = i
        for o in eng.step():
            tokens, _, _ = out.get(ids[o.request_id], ([], None, 0))
            out[ids[o.request_id]] = (tokens + o.new_token_ids, o.finish_reason, o.cached_tokens)
        if not pending and not eng.has_unfinished():
            return out
    raise AssertionError("the engine did not finish")
