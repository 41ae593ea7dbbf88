"""Chunk buckets, ``Generator``'s default prefill (``prefill_chunk=None``): every prefill step takes the
smallest of a few chunk sizes (64, 256, 1024, 2048, 4096 tokens a row) that holds the longest remaining part of
any row, within ``max_prefill_tokens`` a step (batch bucket x chunk). Its logits equal one-token and
fixed-chunk prefill across the window, CSA and HCA block boundaries and past the largest bucket; greedy
and speculative tokens equal ``prefill_chunk=64``'s; compiled, prompts of new lengths add no graph beyond
one per (batch bucket, chunk bucket); and the budget caps every step.

The model tests run smaller chunk buckets (``_chunk_buckets``) so that short prompts span them on the CPU:
90 is no multiple of 4 or 16, so a batch's second step starts mid-block, and the 90..180 chunk closes the
blocks at 92, 96, ..., 176 (CSA 4, HCA 16) and the 128-multiple inside it."""
from __future__ import annotations

import copy

import pytest
import torch

from dsv4_ops import DSV4Config, Generator
from dsv4_ops.generation_loop import chunk_buckets, chunk_schedule, chunks_within
from model_util import random_model

CFG = DSV4Config.tiny()  # sliding, CSA (rate 4), HCA (rate 16), CSA; window 16; an MTP block
SMALL = (7, 30, 90)  # chunk buckets for the CPU
LENGTHS = [1, 3, 5, 16, 17, 45, 129, 200]  # below the window, on / past block edges, past the largest bucket


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=7)


def spy_steps(gen: Generator) -> list[tuple]:
    """Record ``(kind, graph key's chunk, ids shape, ids stride)`` of every prefill step ``gen`` runs."""
    steps, run = [], gen._run

    def spy(kind, bucket, fn, *args, **kwargs):
        if "prefill" in kind:
            steps.append((kind, kwargs.get("chunk"), tuple(args[0].shape), args[0].stride()))
        return run(kind, bucket, fn, *args, **kwargs)

    gen._run = spy
    return steps


# --------------------------------------------------------------------------------------
# the chunk each step takes
# --------------------------------------------------------------------------------------
def test_chunk_buckets_and_the_chunk_each_step_takes(model) -> None:
    buckets = chunk_buckets(4096)
    assert buckets == [64, 256, 1024, 2048, 4096]
    assert chunk_buckets(3000) == [64, 256, 1024, 2048, 3000]  # capped at max_seq_len
    assert chunk_buckets(200) == [64, 200] and chunk_buckets(48) == [48]
    assert chunk_schedule(4096, buckets) == [4096]  # a 4K prompt reads the experts' weights once
    assert chunk_schedule(8192, buckets) == [4096, 4096] and chunk_schedule(4097, buckets) == [4096, 64]
    assert chunk_schedule(3000, buckets) == [4096] and chunk_schedule(2000, buckets) == [2048]
    assert chunk_schedule(100, buckets) == [256]
    assert chunk_schedule(64, buckets) == [64] and chunk_schedule(65, buckets) == [256]
    assert chunk_schedule(130, [8]) == [8] * 17  # one fixed chunk: ceil(130 / 8) steps, as before
    # the default budget, 8192 tokens a step: the largest chunk each batch bucket may take
    largest = {rows: max(chunks_within(buckets, 8192, rows)) for rows in (1, 2, 4, 8, 16, 32, 64, 128)}
    assert largest == {1: 4096, 2: 4096, 4: 2048, 8: 1024, 16: 256, 32: 256, 64: 64, 128: 64}
    assert chunks_within(buckets, 8192, 256) == [32]  # below the smallest bucket: the one chunk that fits
    assert chunks_within(buckets, 3, 4) == [1]  # at least one token a row
    # the Generator's defaults
    gen = Generator(model, max_batch_size=64, compile=False)
    assert gen.prefill_chunk is None and gen.max_prefill_tokens == 8192 and gen.chunk_buckets == buckets
    assert gen._step_chunks(2) == buckets and gen._step_chunks(4) == buckets[:-1] and gen._step_chunks(64) == [64]
    fixed = Generator(model, max_batch_size=64, compile=False, prefill_chunk=64)
    assert fixed.chunk_buckets == [64] and fixed.max_prefill_tokens is None and fixed._step_chunks(64) == [64]


def test_the_token_budget_caps_every_prefill_step(model) -> None:
    """``max_prefill_tokens=100`` with chunk buckets 4, 16, 64: one row takes 64-token chunks, 2 or 4 rows
    16 (64 would be 128 or 256 tokens), 8 rows 4; every step's ids are a contiguous ``[bucket, chunk]``."""
    gen = Generator(model, max_batch_size=8, max_seq_len=64, compile=False, max_prefill_tokens=100,
                    _chunk_buckets=(4, 16, 64))
    steps = spy_steps(gen)
    for n_prompts, want in [(1, [64]), (3, [16, 16, 16]), (5, [4] * 10)]:
        steps.clear()
        gen.prefill(prompts_of([40] + [9] * (n_prompts - 1), seed=n_prompts))
        bucket = next(b for b in gen.buckets if b >= n_prompts)
        assert [s[1] for s in steps] == want, n_prompts  # 40 tokens: the chunks the loop ran
        assert all(s[2] == (bucket, c) and s[3] == (c, 1) for s, c in zip(steps, want))
        assert all(bucket * c <= 100 for c in want)


# --------------------------------------------------------------------------------------
# numerics and tokens
# --------------------------------------------------------------------------------------
def test_default_prefill_logits_equal_one_token_and_fixed_chunk_prefill(model, tol) -> None:
    """A ragged batch (8 rows) prefilled in chunk buckets 7 / 30 / 90 (200 tokens: 90 + 90 + 30) and in
    the default buckets (capped at max_seq_len: 64, 256) gives the logits of 16-token chunks and, for the
    prompts of up to 17 tokens (the window and CSA / HCA block edges), of one token a step; 8 decode
    steps after it agree too (the cache the prefill left, across the window and new blocks)."""
    prompts = prompts_of(LENGTHS, seed=1)
    fed = torch.tensor(prompts_of([8] * len(LENGTHS), seed=2))  # decode tokens [B, 8]

    def run(**kw) -> tuple[torch.Tensor, list]:  # [9, B, vocab] prefill + decode logits; step chunks
        gen = Generator(model, max_batch_size=8, max_seq_len=256, compile=False, **kw)
        steps = spy_steps(gen)
        out = [gen.prefill(prompts)]
        out += [gen.decode(fed[:, t]) for t in range(fed.shape[1])]
        return torch.stack(out), [s[1] for s in steps]

    want, chunks = run(prefill_chunk=16)
    assert chunks == [None] * 13  # a fixed chunk: 13 steps, graphs keyed as before (no chunk)
    for kw, want_chunks in [(dict(_chunk_buckets=SMALL), [90, 90, 30]), (dict(), [256])]:
        got, chunks = run(**kw)
        assert chunks == want_chunks, kw
        torch.testing.assert_close(got, want, **tol("prefill_chunking_fp32"))
    short = [p for p in prompts if len(p) <= 17]
    one = Generator(model, max_batch_size=8, max_seq_len=256, compile=False, prefill_chunk=1).prefill(short)
    got = Generator(model, max_batch_size=8, max_seq_len=256, compile=False, _chunk_buckets=SMALL).prefill(short)
    torch.testing.assert_close(got, one, **tol("prefill_chunking_fp32"))


def test_greedy_and_speculative_tokens_equal_fixed_chunk_64(model) -> None:
    """Greedy ``generate`` in the default buckets and in 7 / 30 / 90 equals ``prefill_chunk=64``; so does
    ``spec_steps=2``, whose prefill steps (main model and MTP window) take 90, 90 and 7 tokens."""
    prompts = prompts_of([5, 70, 187], seed=3)
    kw = dict(max_batch_size=4, max_seq_len=224, compile=False)
    want = Generator(model, prefill_chunk=64, **kw).generate(prompts, max_new_tokens=24)
    assert len({t for row in want for t in row}) > 3  # not a degenerate constant stream
    assert Generator(model, **kw).generate(prompts, max_new_tokens=24) == want
    assert Generator(model, _chunk_buckets=SMALL, **kw).generate(prompts, max_new_tokens=24) == want
    spec = Generator(model, spec_steps=2, _chunk_buckets=SMALL, **kw)
    steps = spy_steps(spec)
    assert spec.generate(prompts, max_new_tokens=24) == want
    assert [(s[0], s[1]) for s in steps] == [("spec_prefill", 90), ("spec_prefill", 90), ("spec_prefill", 7)]
    assert spec.stats["drafted_tokens"] > 0


# --------------------------------------------------------------------------------------
# compiled: graphs
# --------------------------------------------------------------------------------------
def test_compiled_prompts_of_new_lengths_add_no_graphs_and_steps_stay_in_budget(tol) -> None:
    """Compiled (CPU, no CUDA graphs), chunk buckets 4 / 16 / 64 and a budget of 16 tokens a step:
    single prompts of 8 lengths up to 150 compile one graph per chunk bucket the budget allows at batch
    bucket 1 (4 and 16, never 64), a batch of 3 (bucket 4) only 4-token steps; then prompts of other
    lengths, at both batch buckets, compile nothing (``fail_on_recompile``) and give the eager logits."""
    model = random_model(DSV4Config.tiny(num_hidden_layers=2), seed=11)
    kw = dict(max_batch_size=4, max_seq_len=160, max_prefill_tokens=16, _chunk_buckets=(4, 16, 64))
    gen = Generator(model, compile=True, cuda_graphs=False, **kw)
    eager = Generator(copy.deepcopy(model), compile=False, **kw)  # the pool belongs to the model: a copy
    for n in (1, 4, 5, 16, 17, 33, 64, 150):  # chunks 4; 4; 16; 16; 16 + 4; 16 + 16 + 4; 4 x 16; 10 x 16
        gen.prefill(prompts_of([n], seed=n))
    gen.prefill(prompts_of([40, 3, 9], seed=5))  # 4 rows x 16 > 16: ten 4-token steps
    graphs = dict(gen._graphs)
    assert graphs == {("prefill", 1, 4): 1, ("prefill", 1, 16): 1, ("prefill", 4, 4): 1}
    assert all(bucket * chunk <= 16 for _, bucket, chunk in graphs)
    assert gen.stats["recompiles"] == 0 and gen.stats["graph_breaks"] == 0
    with torch.compiler.set_stance("fail_on_recompile"):
        for lengths in ([2], [9], [33], [100], [130], [3, 60, 11], [31, 8, 14, 22]):
            prompts = prompts_of(lengths, seed=sum(lengths))
            torch.testing.assert_close(gen.prefill(prompts), eager.prefill(prompts),
                                       **tol("compiled_generator_vs_eager"))
    assert gen._graphs == graphs and gen.stats["recompiles"] == 0 and gen.stats["graph_breaks"] == 0
