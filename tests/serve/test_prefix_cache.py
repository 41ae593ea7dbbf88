"""Prefix cache == cold: requests that share a prefix restore its pages and the ring snapshot at
its last page boundary, and give exactly the tokens of ``prefix_cache=False``; hits land where
the pages and a snapshot exist, and nowhere else; pages and refcounts return to their initial
values. With MTP speculative decoding (``spec_steps=1``, the trained model) the snapshot also holds
the MTP block's window and the streams it starts from: a hit then drafts what the cold run drafts
(the same accepted counts, the same sampled tokens)."""
import random
from typing import NamedTuple

import pytest
import torch

from dsv4_ops.serve.prefix_cache import PageAllocator, PrefixCache, page_keys
from dsv4_ops import Generator
from engine_cases import MAX_LEN, PAGE, engine, random_prompts, text_tokens, tiny_model, trained_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(1)


def _case(model, spec_steps):
    """The model and prompt tokens of a case: random weights and ids, or (speculative) the trained
    model on Python source."""
    if spec_steps:
        return trained_model(), text_tokens
    return model, lambda rng, n: [rng.randrange(256) for _ in range(n)]


class Served(NamedTuple):
    tokens: list[int]
    cached: int
    accepted: int  # drafts accepted (speculative)
    mtp: tuple | None  # speculative: the slot's MTP window ring, h_last and draft distributions at the end


def _one_by_one(eng, prompts, **kw) -> list[Served]:
    """Each prompt after the previous one finished (so each runs in slot 0)."""
    out = []
    for p in prompts:
        rid = eng.add_request(p, **kw)
        toks, cached, accepted = [], None, None
        while eng.has_unfinished():
            for o in eng.step():
                assert o.request_id == rid
                toks += o.new_token_ids
                cached, accepted = o.cached_tokens, o.accepted_tokens
        spec = eng.spec
        mtp = None if spec is None else (spec.mtp.rings["window"][0].clone(), spec.h_last[0].clone(),
                                         spec.draft_probs[0].clone())
        out.append(Served(toks, cached, accepted, mtp))
    return out


def _drained(eng):
    eng.cache.flush()
    assert eng.stats["pages_free"] == eng.allocator.num_pages - 1
    assert all(r == 0 for r in eng.allocator.refcount)
    assert len(eng.cache.free_snapshots) == len(eng._snapshots[0])


def _same(hot: list[Served], cold: list[Served], bound: dict | None = None) -> bool:
    """Each request's tokens and drafts accepted, and (speculative) its MTP state: bit for bit
    (``bound=None``) where a hit computes what the cold run computed at every position past the
    boundary (same chunks and step shapes, the MTP window's entries from the restored streams and
    ring included), else within ``bound`` (a snapshot taken while decoding: what verify computed)."""
    if [(h.tokens, h.accepted) for h in hot] != [(c.tokens, c.accepted) for c in cold]:
        return False
    close = torch.equal if bound is None else lambda a, b: torch.allclose(a, b, **bound)
    return all(h.mtp is None or all(close(a, b) for a, b in zip(h.mtp, c.mtp)) for h, c in zip(hot, cold))


@pytest.mark.parametrize("spec_steps", [0, 1])
def test_a_shared_system_prompt_is_served_from_the_cache_with_the_cold_tokens(model, spec_steps):
    rng = random.Random(3)
    model, tokens = _case(model, spec_steps)
    system = tokens(rng, 70)  # two full pages and a part
    prompts = [system + tokens(rng, rng.randint(1, 26)) for _ in range(5)]  # <= 96 tokens: no hit past 64
    cold = _one_by_one(engine(model, prefix_cache=False, spec_steps=spec_steps), prompts, max_new_tokens=8)
    eng = engine(model, spec_steps=spec_steps)
    hot = _one_by_one(eng, prompts, max_new_tokens=8, temperature=0.9, seed=3)
    hot_greedy = _one_by_one(eng, prompts, max_new_tokens=8)
    assert _same(hot_greedy, cold)
    assert [c.cached for c in cold] == [0] * 5
    assert hot[0].cached == 0 and all(h.cached == 64 for h in hot[1:] + hot_greedy)  # the system prompt's 2 full pages
    sampled_cold = _one_by_one(engine(model, prefix_cache=False, spec_steps=spec_steps), prompts, max_new_tokens=8,
                               temperature=0.9, seed=3)
    assert _same(hot, sampled_cold)
    assert eng.stats["prefix_hit_tokens"] == 64 * 9 and eng.stats["prefix_hit_rate"] > 0
    if spec_steps:
        assert eng.stats["accepted_tokens"] > 0
    _drained(eng)


@pytest.mark.parametrize("n, spec_steps", [(n, 0) for n in (PAGE - 1, PAGE, PAGE + 1, 2 * PAGE, 2 * PAGE + 1, 3 * PAGE)]
                         + [(n, 1) for n in (PAGE - 1, PAGE, PAGE + 1)])
def test_prompts_around_page_boundaries_hit_the_last_boundary_below_them(model, n, spec_steps):
    rng = random.Random(n)
    model, tokens = _case(model, spec_steps)
    prompt = tokens(rng, n)
    cold = _one_by_one(engine(model, prefix_cache=False, spec_steps=spec_steps), [prompt], max_new_tokens=6)
    eng = engine(model, spec_steps=spec_steps)
    first, again = _one_by_one(eng, [prompt, prompt], max_new_tokens=6)
    assert _same([first], cold) and _same([again], cold)
    # at least one token is computed: the hit ends at the last boundary at or below n - 1
    assert first.cached == 0 and again.cached == (n - 1) // PAGE * PAGE
    _drained(eng)


@pytest.mark.parametrize("n", [2 * PAGE - 1, 2 * PAGE, 2 * PAGE + 1, 4 * PAGE + 3, 5 * PAGE])
def test_chunks_of_two_pages_hit_the_same_prompt_at_its_last_boundary_and_a_next_turn_at_a_chunk_end(model, n):
    """``prefill_chunk`` a multiple of the page: a chunk also ends at the prompt's last page boundary,
    and snapshots sit only where chunks end, so a hit resumes where a cold run cuts the prompt and
    gives its tokens (and ``Generator``'s with that chunk): the same prompt again at its last
    boundary, a longer one (the next turn) at the last chunk multiple it shares."""
    rng = random.Random(n)
    prompt = [rng.randrange(256) for _ in range(n)]
    kw = dict(prefill_chunk=2 * PAGE, max_prefill_tokens=4 * PAGE)
    cold = _one_by_one(engine(model, prefix_cache=False, **kw), [prompt], max_new_tokens=6)
    eng = engine(model, **kw)
    first, again = _one_by_one(eng, [prompt, prompt], max_new_tokens=6)
    assert _same([first], cold) and _same([again], cold)
    assert first.cached == 0 and again.cached == (n - 1) // PAGE * PAGE
    gen = Generator(model, max_batch_size=1, max_seq_len=MAX_LEN, compile=False, prefill_chunk=2 * PAGE)
    assert cold[0].tokens == gen.generate([prompt], max_new_tokens=6)[0]
    # the next turn: it resumes at the prompt's last chunk end below n, or where decoding passed one
    turn2 = prompt + first.tokens + [rng.randrange(256) for _ in range(5)]
    hot = _one_by_one(eng, [turn2], max_new_tokens=6)
    assert _same(hot, _one_by_one(engine(model, prefix_cache=False, **kw), [turn2], max_new_tokens=6))
    C, computed = 2 * PAGE, n + 6 - 1  # positions in the cache when the first turn ended
    passed = computed // C * C
    assert hot[0].cached == max((n - 1) // C * C, passed if passed > n else 0)
    _drained(eng)


def test_without_a_prefix_cache_a_chunk_is_not_cut_at_the_prompts_last_boundary(model):
    """The cut at a prompt's last page boundary serves prefix hits only: without a cache a prompt of
    3 pages + 5 tokens takes one 4-page chunk instead of two steps, with the same tokens."""
    rng = random.Random(11)
    prompt = [rng.randrange(256) for _ in range(3 * PAGE + 5)]
    kw = dict(prefill_chunk=4 * PAGE, max_prefill_tokens=4 * PAGE)
    steps, tokens = {}, {}
    for cached in (True, False):
        eng = engine(model, prefix_cache=cached, **kw)
        tokens[cached] = _one_by_one(eng, [prompt], max_new_tokens=4)[0].tokens
        steps[cached] = eng.stats["prefill_steps"]
    assert steps == {True: 2, False: 1} and tokens[True] == tokens[False]


def test_a_step_of_short_chunks_runs_at_a_narrower_width_and_a_hit_pays_only_for_its_tail(model):
    """A chunk of 8 pages (256 tokens) compiles prefill widths 64 and 256: a prompt's 256-token chunk
    runs at 256 and its 44-token tail at 64; a request that hits the first chunk runs only a 64-wide
    step. The tokens are the cold run's and ``Generator``'s with that chunk."""
    rng = random.Random(3)
    system = [rng.randrange(256) for _ in range(8 * PAGE)]
    prompts = [system + [rng.randrange(256) for _ in range(n)] for n in (44, 20)]
    kw = dict(max_seq_len=512, prefill_chunk=8 * PAGE, max_prefill_tokens=8 * PAGE, num_pages=40)
    eng = engine(model, **kw)
    assert eng.prefill_widths == [64, 8 * PAGE]
    widths = []
    for p in prompts:
        eng._calls.keys.clear()
        got = _one_by_one(eng, [p], max_new_tokens=6)
        widths.append(sorted(key[1][1] for key in eng._calls.keys if key[0] == "prefill"))
    assert widths == [[64, 8 * PAGE], [64]] and eng.stats["prefix_hit_tokens"] == 8 * PAGE
    assert _same(got, _one_by_one(engine(model, prefix_cache=False, **kw), prompts[1:], max_new_tokens=6))
    gen = Generator(model, max_batch_size=1, max_seq_len=512, compile=False, prefill_chunk=8 * PAGE)
    assert got[0].tokens == gen.generate(prompts[1:], max_new_tokens=6)[0]
    _drained(eng)


@pytest.mark.parametrize("spec_steps", [0, 1])
def test_a_multi_turn_conversation_resumes_at_the_last_boundary_it_reached(model, spec_steps, tol):
    rng = random.Random(8)
    model, tokens = _case(model, spec_steps)
    turn1 = tokens(rng, 40)
    eng = engine(model, spec_steps=spec_steps)
    reply = _one_by_one(eng, [turn1], max_new_tokens=30)[0].tokens
    turn2 = turn1 + reply + tokens(rng, 9)
    hot = _one_by_one(eng, [turn2], max_new_tokens=8)
    cold = _one_by_one(engine(model, prefix_cache=False, spec_steps=spec_steps), [turn2], max_new_tokens=8)
    assert _same(hot, cold, tol("speculative_cache_entries"))
    # the rolling snapshot taken while decoding (speculative: by the step that passed the boundary)
    assert hot[0].cached == (40 + 30 - 1) // PAGE * PAGE
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
    from dsv4_ops import DSV4Config, DeepseekV4ForCausalLM, Generator

    torch.manual_seed(5)
    model = DeepseekV4ForCausalLM(DSV4Config.tiny(head_dim=144, num_hidden_layers=3, hca_ratio=8)).eval()
    rng = random.Random(14)
    system = [rng.randrange(256) for _ in range(70)]
    prompts = [system + q for q in random_prompts(rng, 3, (1, 20))]
    eng = engine(model, kv_cache_dtype="fp8")
    hot = _one_by_one(eng, prompts, max_new_tokens=6)
    gen = Generator(model, max_batch_size=1, max_seq_len=256, compile=False, prefill_chunk=16, kv_cache_dtype="fp8")
    assert [h.tokens for h in hot] == [gen.generate([p], max_new_tokens=6)[0] for p in prompts]
    assert [h.cached for h in hot] == [0, 64, 64]
    _drained(eng)
