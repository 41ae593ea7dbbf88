"""The compiled engine: one graph per (step kind, bucket); over hundreds of steps with requests
joining and leaving, no recompiles and no graph breaks, and the compiled tokens are the eager ones."""
import random

import pytest
import torch

from cuda_syncs import counted_syncs
from engine_cases import CHUNK, PAGE, engine, random_prompts, run_arriving, text_prompts, tiny_model, trained_model


@pytest.mark.parametrize("spec_steps", [0, 1])
def test_requests_joining_and_leaving_add_no_graphs_over_200_compiled_steps(spec_steps):
    torch._dynamo.reset()
    # sliding + CSA + HCA, one layer each: every layer kind is in the graphs, with less to compile
    # than the default config's four layers (its fourth is a second CSA layer)
    model = tiny_model(2, num_hidden_layers=3)
    rng = random.Random(21)
    reqs = [dict(prompt_ids=p, max_new_tokens=rng.randint(10, 30)) for p in random_prompts(rng, 24, (1, 60))]
    # two slots, one prefill row: the graphs are prefill [1, CHUNK] and decode [1, 1] / [2, 1] (speculative:
    # verify [1 + k] tokens a row, MTP extend and drafts, in one graph per bucket)
    eng = engine(model, max_running=2, max_prefill_tokens=CHUNK, compile=True, num_pages=20, spec_steps=spec_steps)
    got = run_arriving(eng, reqs, random.Random(0))
    s = eng.stats
    assert s["steps"] >= 200
    assert s["recompiles"] == 0 and s["graph_breaks"] == 0
    assert sorted(eng._graphs) == [("decode", 1, False), ("decode", 2, False), ("prefill", (1, CHUNK), False)]
    assert all(n == 1 for n in eng._graphs.values())
    want = run_arriving(engine(model, max_running=2, max_prefill_tokens=CHUNK, num_pages=20, spec_steps=spec_steps),
                        reqs, random.Random(0))
    assert [got[i][0] for i in range(len(reqs))] == [want[i][0] for i in range(len(reqs))]


@pytest.mark.parametrize("spec_steps", [0, 1])
def test_warm_up_runs_every_step_shape_a_load_can_take(spec_steps):
    """``warm_up`` runs each (step kind, bucket, filtered) once, so a server that warms up before it
    reports ready never compiles or records a graph while it serves: a load of 1 to 4 requests at
    once, greedy, sampled and top-p sampled, runs only shapes the warm-up ran, and the warm-up
    leaves no pages, slots or cached prefixes behind."""
    model = trained_model() if spec_steps else tiny_model(3)
    eng = engine(model, max_running=4, max_prefill_tokens=2 * CHUNK, num_pages=40, spec_steps=spec_steps)
    initial = {k: eng.stats[k] for k in ("pages_free", "pages_cached", "running", "waiting")}
    eng.warm_up(filtered=False)  # greedy and plain sampling: no top-k / top-p shape
    assert not any(filtered for _, _, filtered in eng._calls.keys)
    info = eng.warm_up()
    warmed = set(eng._calls.keys)
    decode = {("decode", b, False) for b in (1, 2, 4)}
    decode |= ({("decode_sample", b, f) for b in (1, 2, 4) for f in (False, True)} if spec_steps else
               {("decode", b, True) for b in (1, 2, 4)})
    assert warmed == decode | {("prefill", (b, CHUNK), f) for b in (1, 2) for f in (False, True)}
    assert info["keys"] == len(warmed) and {k: eng.stats[k] for k in initial} == initial

    rng = random.Random(8)
    sampling = [dict(), dict(temperature=0.9, seed=1), dict(temperature=0.7, top_p=0.8, top_k=20, seed=2)]
    prompts = text_prompts(rng, 12, (1, 70)) if spec_steps else random_prompts(rng, 12, (1, 70))
    reqs = [dict(prompt_ids=p, max_new_tokens=rng.randint(3, 10), **sampling[i % 3]) for i, p in enumerate(prompts)]
    eng._calls.keys.clear()
    eng.generate([r["prompt_ids"] for r in reqs[:4]], 6)  # 4 at once: the largest bucket
    run_arriving(eng, reqs, rng)
    assert ("decode", 4, False) in eng._calls.keys and len(eng._calls.keys) >= 5
    assert eng._calls.keys <= warmed


def test_warm_up_runs_every_prefill_width_and_caches_no_prefix():
    """With chunks of 8 pages, prefill steps take widths 64 and 256: the warm-up runs both at every
    prefill bucket (its long prompts are not cached), and prompts of any length then run only those."""
    eng = engine(tiny_model(3), max_running=2, max_seq_len=512, prefill_chunk=8 * PAGE, num_pages=40)
    initial = {k: eng.stats[k] for k in ("pages_free", "pages_cached", "running", "waiting")}
    eng.warm_up(filtered=False)
    warmed = set(eng._calls.keys)
    assert {k[1] for k in warmed if k[0] == "prefill"} == {(b, w) for b in (1, 2) for w in (64, 8 * PAGE)}
    assert {k: eng.stats[k] for k in initial} == initial
    rng = random.Random(2)
    eng._calls.keys.clear()
    run_arriving(eng, [dict(prompt_ids=p, max_new_tokens=4) for p in random_prompts(rng, 8, (1, 400))], rng)
    assert eng._calls.keys <= warmed and eng.stats["prefill_steps"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_replay_after_warm_up_and_requests_coming_and_going_record_none():
    """... and no iteration synchronises the stream: its inputs go to the device without a wait and
    its tokens come back through an event that waits for their copy only, so the host schedules while
    a step launched after them still runs (the sync debug mode flags stream and device syncs; one
    known sync shows that it is on)."""
    torch._dynamo.reset()
    model = tiny_model(4).cuda()
    rng = random.Random(5)
    reqs = [dict(prompt_ids=p, max_new_tokens=rng.randint(8, 20)) for p in random_prompts(rng, 12, (1, 60))]
    eng = engine(model, max_running=2, max_prefill_tokens=CHUNK, compile=True, num_pages=20)
    assert eng.cuda_graphs
    eng.warm_up(filtered=False)  # every (kind, bucket) graph compiled and recorded
    assert eng.stats["cuda_graph_recordings"] >= len(eng._graphs) > 0
    graphs, replays, recordings = dict(eng._graphs), eng.stats["cuda_graph_replays"], eng.stats["cuda_graph_recordings"]
    with counted_syncs() as syncs:
        got = run_arriving(eng, reqs, random.Random(2))
    assert not syncs, syncs  # where each one came from
    assert eng.stats["early_steps"] > 0
    assert eng._graphs == graphs and eng.stats["recompiles"] == 0 and eng.stats["graph_breaks"] == 0
    assert eng.stats["cuda_graph_replays"] - replays >= eng.stats["steps"] // 2
    assert eng.stats["cuda_graph_recordings"] == recordings
    want = run_arriving(engine(model, max_running=2, max_prefill_tokens=CHUNK, num_pages=20), reqs, random.Random(2))
    assert [got[i][0] for i in range(len(reqs))] == [want[i][0] for i in range(len(reqs))]
