"""Continuous batching == alone: requests of random lengths that arrive at random steps, greedy
and seeded sampling, each give exactly what ``Generator.generate([prompt])`` gives alone."""
import random

import pytest

from engine_cases import alone, engine, random_prompts, run_arriving, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _requests(rng, n):
    # lengths across 4- (CSA) and 16-token (HCA, window) boundaries, shorter than the window and longer than a page
    prompts = random_prompts(rng, n - 4, (1, 100)) + [[rng.randrange(256) for _ in range(k)] for k in (15, 16, 32, 33)]
    reqs = []
    for i, p in enumerate(prompts):
        kw = dict(prompt_ids=p, max_new_tokens=rng.randint(1, 14))
        if i % 3 == 1:
            kw.update(temperature=0.8, seed=1000 + i)
        elif i % 3 == 2:
            kw.update(temperature=1.0, top_k=20, top_p=0.9, seed=2000 + i)
        reqs.append(kw)
    return reqs


def test_requests_arriving_at_random_steps_get_their_tokens_alone(model):
    rng = random.Random(11)
    reqs = _requests(rng, 24)
    eng = engine(model, max_running=4, num_pages=40)
    got = run_arriving(eng, reqs, rng)
    for i, kw in enumerate(reqs):
        want = alone(model, kw["prompt_ids"], **{k: v for k, v in kw.items() if k != "prompt_ids"})
        tokens, reason, _ = got[i]
        assert tokens == want, i
        assert reason == "length"
    s = eng.stats
    assert s["running"] == s["waiting"] == 0 and s["finished"] == 24
    assert s["decode_steps"] > 0 and s["prefill_steps"] > 0


def test_stop_ids_end_a_request_with_reason_stop_and_the_others_run_on(model):
    rng = random.Random(5)
    prompts = random_prompts(rng, 3, (5, 40))
    free = [alone(model, p, max_new_tokens=10) for p in prompts]
    stop = free[0][3]  # the first request's 4th token
    eng = engine(model)
    ids = [eng.add_request(p, max_new_tokens=10, eos_token_id=stop if i == 0 else None) for i, p in enumerate(prompts)]
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            toks, _ = outs.get(o.request_id, ([], None))
            outs[o.request_id] = (toks + o.new_token_ids, o.finish_reason)
    assert outs[ids[0]] == (free[0][: free[0].index(stop) + 1], "stop")
    assert [outs[i] for i in ids[1:]] == [(f, "length") for f in free[1:]]


def test_generate_returns_what_generator_returns(model):
    rng = random.Random(2)
    prompts = random_prompts(rng, 6, (1, 60))
    got = engine(model, max_running=2).generate(prompts, max_new_tokens=6, temperature=0.7, seed=40)
    assert got == [alone(model, p, max_new_tokens=6, temperature=0.7, seed=40 + i) for i, p in enumerate(prompts)]


def test_a_tiny_pool_preempts_the_newest_request_and_gives_the_same_tokens(model):
    rng = random.Random(9)
    prompts = random_prompts(rng, 6, (40, 70))
    eng = engine(model, max_running=4, num_pages=9, prefix_cache=False)  # 8 real pages; a request takes 3-4
    got = eng.generate(prompts, max_new_tokens=24)
    assert eng.stats["preemptions"] > 0
    assert got == [alone(model, p, max_new_tokens=24) for p in prompts]
    assert eng.stats["pages_free"] == 8 and all(r == 0 for r in eng.allocator.refcount)


def test_abort_frees_the_pages_and_the_others_finish(model):
    rng = random.Random(4)
    prompts = random_prompts(rng, 3, (30, 50))
    eng = engine(model, prefix_cache=False, num_pages=20)
    ids = [eng.add_request(p, max_new_tokens=8) for p in prompts]
    eng.step()
    eng.step()
    eng.abort(ids[1])
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    assert [o.finish_reason for o in outs[ids[1]]] == ["abort"]
    assert sum(len(o.new_token_ids) for o in outs[ids[0]]) > 0
    assert eng.stats["pages_free"] == 19 and all(r == 0 for r in eng.allocator.refcount)
    assert eng.stats["aborted"] == 1
