"""Continuous batching == alone: requests of random lengths that arrive at random steps, greedy
and seeded sampling, each give exactly what ``Generator.generate([prompt])`` gives alone; with
``spec_steps=k`` what ``Generator(spec_steps=k)`` gives alone, drafts accepted included."""
import random

import pytest

from engine_cases import (MAX_LEN, PAGE, alone, alone_spec, engine, random_prompts, run_arriving, text_prompts,
                          text_tokens, tiny_model, trained_model)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _requests(rng, n, spec_steps=0):
    # lengths across 4- (CSA) and 16-token (HCA) boundaries, shorter than the window and longer than a
    # page; the trained model's (speculative cases) window is 64, so its prompts also cross 64 and 128
    if spec_steps:
        fixed = [text_tokens(rng, k) for k in (15, 16, 32, 33, 63, 65, 127, 128, 129)]
        prompts, new = text_prompts(rng, n - len(fixed), (1, 100)) + fixed, (1, 20)
    else:
        fixed = [[rng.randrange(256) for _ in range(k)] for k in (15, 16, 32, 33)]
        prompts, new = random_prompts(rng, n - len(fixed), (1, 100)) + fixed, (1, 14)
    reqs = []
    for i, p in enumerate(prompts):
        kw = dict(prompt_ids=p, max_new_tokens=rng.randint(*new))
        if i % 3 == 1:
            kw.update(temperature=0.8, seed=1000 + i)
        elif i % 3 == 2:
            kw.update(temperature=1.0, top_k=20, top_p=0.9, seed=2000 + i)
        reqs.append(kw)
    return reqs


@pytest.mark.parametrize("spec_steps", [0, 1, 2])
def test_requests_arriving_at_random_steps_get_their_tokens_alone(model, spec_steps):
    rng = random.Random(11)
    model = trained_model() if spec_steps else model
    n = 12 if spec_steps == 2 else 24  # k = 2: what k = 1 does not reach (two drafts, partial acceptance), half the load
    reqs = _requests(rng, n, spec_steps)
    eng = engine(model, max_running=4, num_pages=40, spec_steps=spec_steps)
    got = run_arriving(eng, reqs, rng)
    for i, kw in enumerate(reqs):
        settings = {k: v for k, v in kw.items() if k != "prompt_ids"}
        want, accepted = alone_spec(model, kw["prompt_ids"], spec_steps, **settings)
        tokens, reason, _, got_accepted = got[i]
        assert tokens == want, i
        assert reason == "length"
        assert got_accepted == accepted, i  # each row advanced by its own accepted count, as alone
        if spec_steps and "temperature" not in kw:
            assert tokens == alone(model, kw["prompt_ids"], **settings), i  # greedy: the spec_steps=0 tokens
    s = eng.stats
    assert s["running"] == s["waiting"] == 0 and s["finished"] == n
    assert s["decode_steps"] > 0 and s["prefill_steps"] > 0
    if spec_steps:  # some drafts accepted, some rejected
        assert 0 < s["accepted_tokens"] < s["drafted_tokens"] and 0 < s["acceptance_rate"] < 1
        assert sum(got[i][3] > 0 for i in got) >= len(reqs) // 2


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


def test_a_prompt_of_max_seq_len_tokens_and_one_new_token_fits_the_smallest_pool(model):
    """Its prompt's token is its last: admission asks for the prompt's pages only (one more would
    exceed what add_request allowed, and the request would wait forever)."""
    eng = engine(model, max_running=1, num_pages=MAX_LEN // PAGE + 1)
    prompt = [i % 256 for i in range(MAX_LEN)]
    got = run_arriving(eng, [dict(prompt_ids=prompt, max_new_tokens=1)], random.Random(0), max_steps=50)
    assert got[0][0] == alone(model, prompt, max_new_tokens=1)
    assert eng.stats["pages_free"] == MAX_LEN // PAGE - eng.stats["pages_cached"]


@pytest.mark.parametrize("spec_steps", [0, 1])
def test_a_request_left_in_a_high_slot_moves_down_and_decodes_at_a_small_bucket(model, spec_steps):
    """Four requests take slots 0-3; as the three short ones end, the long one (slot 3) moves down to
    slot 0 with its device state (also between overlapped steps, its input token with it), so the
    steps after run at decode bucket 1, not 4; every request (greedy and sampled) still gets its
    tokens alone."""
    rng = random.Random(4)
    model, prompts = (trained_model(), text_prompts(rng, 4, (5, 40))) if spec_steps else \
        (model, random_prompts(rng, 4, (5, 40)))
    new, temperature = [3, 4, 5, 30], [0.0, 0.9] * 2
    eng = engine(model, spec_steps=spec_steps)
    got = eng.generate(prompts, max_new_tokens=new, temperature=temperature, seed=3)
    kind = "decode_sample" if spec_steps else "decode"
    assert eng.stats["slot_moves"] >= 1 and any(k[:2] == (kind, 1) for k in eng._calls.keys)
    want = [alone_spec(model, p, spec_steps, max_new_tokens=new[i], temperature=temperature[i], seed=3 + i)[0]
            for i, p in enumerate(prompts)]
    assert got == want


@pytest.mark.parametrize("spec_steps", [0, 1])
def test_a_tiny_pool_preempts_the_newest_request_and_gives_the_same_tokens(model, spec_steps):
    rng = random.Random(1)
    model, prompts = (trained_model(), text_prompts(rng, 6, (40, 70))) if spec_steps else \
        (model, random_prompts(rng, 6, (40, 70)))
    # speculative: sampled and greedy rows; a sampled row preempted while decoding resumes with the
    # drafts it had (with placeholders it would draw other tokens: this case would fail)
    temperature = [0.9, 0.0] * 3 if spec_steps else 0.0
    eng = engine(model, max_running=4, num_pages=9, prefix_cache=False, spec_steps=spec_steps)  # 8 real pages
    got = eng.generate(prompts, max_new_tokens=24, temperature=temperature, seed=7)  # a request takes 3-4
    assert eng.stats["preemptions"] > 0
    want = [alone_spec(model, p, spec_steps, max_new_tokens=24, temperature=temperature[i] if spec_steps else 0.0,
                       seed=7 + i) for i, p in enumerate(prompts)]
    assert got == [w for w, _ in want]
    assert eng.stats["accepted_tokens"] == sum(a for _, a in want)
    assert eng.stats["pages_free"] == 8 and all(r == 0 for r in eng.allocator.refcount)


@pytest.mark.parametrize("spec_steps", [0, 1])
def test_abort_frees_the_pages_and_the_others_finish(model, spec_steps):
    rng = random.Random(4)
    prompts = random_prompts(rng, 3, (30, 50))
    eng = engine(trained_model() if spec_steps else model, prefix_cache=False, num_pages=20, spec_steps=spec_steps)
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


@pytest.mark.parametrize("spec_steps", [0, 1])
def test_admission_waiting_for_free_slots_shares_prefill_steps_and_keeps_the_tokens(model, spec_steps):
    """``admit_wait``: as requests of staggered lengths end one by one, each freed slot waits (a bounded number of
    iterations) for others, so that the next prompts share prefill steps: fewer prefill steps than admitting at
    once, the same tokens (each request's tokens alone, greedy and sampled)."""
    rng = random.Random(8)
    model, prompts = (trained_model(), text_prompts(rng, 24, (5, 16))) if spec_steps else \
        (model, random_prompts(rng, 24, (5, 16)))  # one chunk each
    new = [3 + 3 * i for i in range(16)] + [4] * 8  # the first sixteen end at different steps
    temperature = [0.0, 0.8] * 12
    runs = {}
    for wait in (0, 6):  # 16 slots: an admission waits for 2 free (an eighth of them)
        eng = engine(model, max_running=16, max_prefill_tokens=16 * 16, spec_steps=spec_steps, admit_wait=wait)
        runs[wait] = (eng.generate(prompts, max_new_tokens=new, temperature=temperature, seed=5), eng.stats)
    (got0, s0), (got6, s6) = runs[0], runs[6]
    assert got6 == got0 == [alone_spec(model, p, spec_steps, max_new_tokens=new[i], temperature=temperature[i],
                                       seed=5 + i)[0] for i, p in enumerate(prompts)]
    assert s6["admissions_deferred"] > 0 and s0["admissions_deferred"] == 0
    assert s6["prefill_steps"] < s0["prefill_steps"]
    assert s6["finished"] == 24 and s6["running"] == s6["waiting"] == 0


def test_longest_output_first_admission_ends_with_short_requests_in_fewer_steps_and_keeps_the_tokens(model):
    """``admit_order="longest_output"``: of requests queued at once, the ones with the most tokens to generate take
    the slots first, so the run ends with short ones instead of a long one decoding alone: fewer decode steps than
    first come first served (here the longest arrives last), each request's tokens what it gives alone (greedy and
    sampled), the results in the order of the prompts."""
    rng = random.Random(11)
    prompts = random_prompts(rng, 9, (5, 16))
    new = [3, 4, 2, 3, 4, 2, 3, 4, 24]  # the longest arrives last
    temperature = [0.0, 0.8, 0.0] * 3
    runs = {}
    for order in ("arrival", "longest_output"):
        eng = engine(model, max_running=2, admit_order=order)
        runs[order] = (eng.generate(prompts, max_new_tokens=new, temperature=temperature, seed=3), eng.stats)
    (fifo, s_fifo), (lof, s_lof) = runs["arrival"], runs["longest_output"]
    assert lof == fifo == [alone(model, p, max_new_tokens=new[i], temperature=temperature[i], seed=3 + i)
                           for i, p in enumerate(prompts)]
    # first come: the long one starts after the 8 short ones (4 pairs of ~3 steps) and decodes 23 more steps alone;
    # longest first: the 8 short ones (25 tokens) pass through the other slot while it decodes
    assert s_lof["decode_steps"] <= max(new) and s_fifo["decode_steps"] >= max(new) + 8
    assert s_lof["finished"] == s_fifo["finished"] == 9


def test_admit_order_changed_while_requests_wait_sorts_them_again_and_is_checked(model):
    """Requests queued in arrival order, then ``admit_order`` set to ``"longest_output"`` before the first step: the
    longest of them takes the one slot first; a value that is no order is refused by name and changes nothing."""
    eng = engine(model, max_running=1)
    prompts = random_prompts(random.Random(5), 3, (5, 9))
    ids = [eng.add_request(p, max_new_tokens=n) for p, n in zip(prompts, (2, 3, 6))]
    eng.admit_order = "longest_output"
    with pytest.raises(ValueError, match=r"admit_order must be one of \('arrival', 'longest_output'\), got 'lifo'"):
        eng.admit_order = "lifo"
    assert eng.admit_order == "longest_output"
    finished = []
    while eng.has_unfinished():
        finished += [o.request_id for o in eng.step() if o.finished]
    assert finished == [ids[2], ids[1], ids[0]]


def test_a_freed_slot_waits_at_most_admit_wait_iterations(model):
    """Fifteen long requests decode, a short one ends and frees its slot while two requests wait (one free slot of
    16 is less than the two an admission waits for): with ``admit_wait=3`` the first of them is admitted (its
    prefill runs, its first token comes) in the fourth iteration after the slot freed, after three deferred ones,
    whose decode steps were launched before the last one's tokens were read (an iteration that admits no one)."""
    rng = random.Random(3)
    prompts = random_prompts(rng, 18, (5, 20))
    eng = engine(model, max_running=16, admit_wait=3)
    long_ids = [eng.add_request(p, max_new_tokens=40) for p in prompts[:15]]
    b = eng.add_request(prompts[15], max_new_tokens=2)
    c = eng.add_request(prompts[16], max_new_tokens=3)
    eng.add_request(prompts[17], max_new_tokens=3)
    freed_at = first_at = None
    for it in range(60):
        for o in eng.step():
            if o.request_id == b and o.finished:
                freed_at, early = it, eng.stats["early_steps"]
            if o.request_id == c and o.new_token_ids and first_at is None:
                first_at = it
        if first_at is not None:
            break
    assert freed_at is not None and first_at is not None
    assert first_at - freed_at == 4 and eng.stats["admissions_deferred"] == 3
    assert eng.stats["early_steps"] - early == 2  # the three deferred iterations' steps but the first's (launched before)
    assert all(i in eng._requests for i in long_ids)
