"""Overlap: while every running request decodes, the engine launches the next decode step from the
current one's unread tokens. Every request still gets its tokens alone, exactly those of
``overlap=False``: requests that stop on a stop id while an early step runs for them, sampled
requests, shared prefixes whose pages and snapshots an early step must not touch, aborts between
steps; and the pool ends as it began."""
import random

import pytest

from engine_cases import PAGE, alone, engine, random_prompts, run_arriving, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _requests(model, rng: random.Random, n: int) -> list[dict]:
    """Random lengths, half behind a shared 1.5-page prefix (prompts of under two pages: their
    snapshot is at the shared page's end); a third sampled; of the greedy ones, half stop on a stop
    id taken from their own continuation."""
    shared = [rng.randrange(256) for _ in range(PAGE + PAGE // 2)]
    reqs = []
    for i, tail in enumerate(random_prompts(rng, n, (1, PAGE // 2))):
        kw = dict(prompt_ids=(shared + tail) if i % 2 else tail, max_new_tokens=rng.randint(2, 40))
        if i % 3 == 1:
            kw.update(temperature=0.8, seed=300 + i)
        elif i % 3 == 0:
            free = alone(model, kw["prompt_ids"], max_new_tokens=kw["max_new_tokens"])
            if len(free) >= 4:
                kw["eos_token_id"] = free[rng.randrange(1, len(free) - 2)]
        reqs.append(kw)
    return reqs


def test_early_steps_give_every_request_its_tokens_alone(model):
    rng = random.Random(3)
    reqs = _requests(model, rng, 18)
    got, stats = {}, {}
    for overlap in (True, False):
        eng = engine(model, max_running=4, num_pages=40, overlap=overlap)
        got[overlap], stats[overlap] = run_arriving(eng, reqs, random.Random(9)), eng.stats
        eng.cache.flush()
        assert eng.stats["pages_free"] == 39 and all(r == 0 for r in eng.allocator.refcount)
        assert len(eng.cache.free_snapshots) == len(eng._snapshots[0])
    on, off = stats[True], stats[False]
    assert on["early_steps"] > on["decode_steps"] // 3 and off["early_steps"] == 0
    assert on["early_rows_dropped"] > 0  # requests stopped while an early step ran for them
    assert on["prefix_hit_tokens"] > 0
    for i, kw in enumerate(reqs):
        settings = {k: v for k, v in kw.items() if k != "prompt_ids"}
        assert got[True][i][:2] == got[False][i][:2], i  # tokens, finish reason
        assert got[True][i][0] == alone(model, kw["prompt_ids"], **settings), i
    assert sum(got[True][i][1] == "stop" for i in got[True]) >= 3


def test_an_abort_between_steps_drops_its_early_row_and_frees_its_pages(model):
    rng = random.Random(6)
    prompts = random_prompts(rng, 3, (10, 40))
    eng = engine(model, prefix_cache=False, num_pages=20)
    ids = [eng.add_request(p, max_new_tokens=12) for p in prompts]
    outs: dict[int, list] = {}
    while eng.stats["early_steps"] == 0:
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    eng.abort(ids[1])  # its row is in the decode step launched early
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    assert outs[ids[1]][-1].finish_reason == "abort" and eng.stats["early_rows_dropped"] >= 1
    for i in (0, 2):
        assert sum((o.new_token_ids for o in outs[ids[i]]), []) == alone(model, prompts[i], max_new_tokens=12)
    assert eng.stats["pages_free"] == 19 and all(r == 0 for r in eng.allocator.refcount)
