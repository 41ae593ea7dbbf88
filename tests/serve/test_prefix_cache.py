"""Prefix cache == cold: requests that share a prefix restore its pages and the ring snapshot at
its last page boundary, and give exactly the tokens of ``prefix_cache=False``; hits land where
the pages and a snapshot exist, and nowhere else; pages and refcounts return to their initial
values."""
import random

import pytest

from dsv4_ops.serve.prefix_cache import PageAllocator, PrefixCache, page_keys
from engine_cases import PAGE, engine, random_prompts, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(1)


def _one_by_one(eng, prompts, **kw):
    """Each prompt after the previous one finished: ``[(tokens, cached_tokens)]``."""
    out = []
    for p in prompts:
        rid = eng.add_request(p, **kw)
        toks, cached = [], None
        while eng.has_unfinished():
            for o in eng.step():
                assert o.request_id == rid
                toks += o.new_token_ids
                cached = o.cached_tokens
        out.append((toks, cached))
    return out


def _drained(eng):
    eng.cache.flush()
    assert eng.stats["pages_free"] == eng.allocator.num_pages - 1
    assert all(r == 0 for r in eng.allocator.refcount)
    assert len(eng.cache.free_snapshots) == len(eng._snapshots[0])


def test_a_shared_system_prompt_is_served_from_the_cache_with_the_cold_tokens(model):
    rng = random.Random(3)
    system = [rng.randrange(256) for _ in range(70)]  # two full pages and a part
    prompts = [system + q for q in random_prompts(rng, 5, (1, 30))]
    cold = _one_by_one(engine(model, prefix_cache=False), prompts, max_new_tokens=8)
    eng = engine(model)
    hot = _one_by_one(eng, prompts, max_new_tokens=8, temperature=0.9, seed=3)
    hot_greedy = _one_by_one(eng, prompts, max_new_tokens=8)
    assert [t for t, _ in hot_greedy] == [t for t, _ in cold]
    assert [c for _, c in cold] == [0] * 5
    assert hot[0][1] == 0 and all(c == 64 for _, c in hot[1:] + hot_greedy)  # the system prompt's 2 full pages
    sampled_cold = _one_by_one(engine(model, prefix_cache=False), prompts, max_new_tokens=8, temperature=0.9, seed=3)
    assert [t for t, _ in hot] == [t for t, _ in sampled_cold]
    assert eng.stats["prefix_hit_tokens"] == 64 * 9 and eng.stats["prefix_hit_rate"] > 0
    _drained(eng)


@pytest.mark.parametrize("n", [PAGE - 1, PAGE, PAGE + 1, 2 * PAGE, 2 * PAGE + 1, 3 * PAGE])
def test_prompts_around_page_boundaries_hit_the_last_boundary_below_them(model, n):
    rng = random.Random(n)
    prompt = [rng.randrange(256) for _ in range(n)]
    cold = _one_by_one(engine(model, prefix_cache=False), [prompt], max_new_tokens=6)[0][0]
    eng = engine(model)
    (first, c0), (again, c1) = _one_by_one(eng, [prompt, prompt], max_new_tokens=6)
    assert first == again == cold
    # at least one token is computed: the hit ends at the last boundary at or below n - 1
    assert c0 == 0 and c1 == (n - 1) // PAGE * PAGE
    _drained(eng)


def test_a_multi_turn_conversation_resumes_at_the_last_boundary_it_reached(model):
    rng = random.Random(8)
    turn1 = [rng.randrange(256) for _ in range(40)]
    eng = engine(model)
    (reply, _), = _one_by_one(eng, [turn1], max_new_tokens=30)
    turn2 = turn1 + reply + [rng.randrange(256) for _ in range(9)]
    (got, cached), = _one_by_one(eng, [turn2], max_new_tokens=8)
    (want, _), = _one_by_one(engine(model, prefix_cache=False), [turn2], max_new_tokens=8)
    assert got == want
    assert cached == (40 + 30 - 1) // PAGE * PAGE  # the rolling snapshot taken while decoding
    _drained(eng)


def test_eviction_under_a_small_pool_keeps_the_tokens_of_a_cold_run(model):
    rng = random.Random(6)
    prefixes = [[rng.randrange(256) for _ in range(66)] for _ in range(3)]
    prompts = [prefixes[i % 3] + [rng.randrange(256) for _ in range(5)] for i in range(9)]
    eng = engine(model, num_pages=7, max_running=2)  # 6 real pages: three cached prefixes do not fit
    hot = eng.generate(prompts, max_new_tokens=5)
    cold = engine(model, prefix_cache=False, num_pages=7, max_running=2).generate(prompts, max_new_tokens=5)
    assert hot == cold
    assert eng.stats["prefix_evictions"] > 0 and eng.stats["prefix_hit_tokens"] > 0
    _drained(eng)


def test_concurrent_requests_share_a_prefix_only_once_it_is_published(model):
    rng = random.Random(12)
    system = [rng.randrange(256) for _ in range(40)]
    prompts = [system + [rng.randrange(256) for _ in range(3)] for _ in range(3)]
    eng = engine(model, max_running=4)
    ids = [eng.add_request(p, max_new_tokens=4) for p in prompts]
    cached = {}
    while eng.has_unfinished():
        for o in eng.step():
            cached[o.request_id] = o.cached_tokens
    assert [cached[i] for i in ids] == [0, 0, 0]  # all admitted before the first finished
    late = eng.add_request(prompts[0], max_new_tokens=4)
    while eng.has_unfinished():
        for o in eng.step():
            cached[o.request_id] = o.cached_tokens
    assert cached[late] == PAGE
    _drained(eng)


def test_page_keys_chain_every_earlier_token_and_the_extra_key():
    a = list(range(64))
    b = [1000] + a[1:]
    assert page_keys(a, 32)[1] != page_keys(b, 32)[1]  # page 2 of b differs only through page 1
    assert page_keys(a, 32) != page_keys(a, 32, b"fp8")
    assert len(page_keys(a[:63], 32)) == 1


def test_locked_entries_are_never_evicted_and_leaves_go_first():
    alloc = PageAllocator(5)
    cache = PrefixCache(alloc, 4, num_snapshots=2)
    pages = [alloc.take() for _ in range(3)]
    cache.publish(list(range(12)), pages, {3: 0})
    for p in pages:
        alloc.unref(p)
    chain, snap = cache.match(list(range(13)))
    assert snap == 0 and [e.page for e in chain] == pages
    assert cache.take_page() not in pages  # the one free page
    with pytest.raises(Exception):
        cache.take_page()  # every cached page is in use by the match
    cache.release(chain)
    assert cache.take_page() == pages[2]  # the deepest (leaf) first


def test_the_fp8_cache_serves_prefix_hits_with_the_tokens_generator_gives_alone():
    import torch

    from dsv4_ops import DSV4Config, DeepseekV4ForCausalLM, Generator

    torch.manual_seed(5)
    model = DeepseekV4ForCausalLM(DSV4Config.tiny(head_dim=144, num_hidden_layers=3, hca_ratio=8)).eval()
    rng = random.Random(14)
    system = [rng.randrange(256) for _ in range(70)]
    prompts = [system + q for q in random_prompts(rng, 3, (1, 20))]
    eng = engine(model, kv_cache_dtype="fp8")
    hot = _one_by_one(eng, prompts, max_new_tokens=6)
    gen = Generator(model, max_batch_size=1, max_seq_len=256, compile=False, prefill_chunk=16, kv_cache_dtype="fp8")
    assert [t for t, _ in hot] == [gen.generate([p], max_new_tokens=6)[0] for p in prompts]
    assert [c for _, c in hot] == [0, 64, 64]
    _drained(eng)
