"""``Generator`` API (eager, ``compile=False``): greedy ``generate`` equals greedy decoding with the
cache-free ``model(input_ids)``; bucket padding and batch reuse never change a row's tokens;
``stats``; and every kind of bad input raises a ValueError naming the problem while leaving the
generator usable. Weights come from a fully randomised HF model (never zeros)."""
from __future__ import annotations

import copy
import pytest
import torch

pytest.importorskip("transformers")

from dsv4_ops import DSV4Config, Generator  # noqa: E402

from hf_util import hf_and_ours, random_prompts  # noqa: E402

VOCAB = 256
MAX_BATCH, MAX_SEQ = 3, 48


@pytest.fixture(scope="module")
def model():
    return hf_and_ours(DSV4Config.tiny(), seed=5)[1]


def greedy_cache_free(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by recomputing ``model(input_ids)`` on the whole growing sequence."""
    seq, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            tok = int(model(torch.tensor([seq]))[0, -1].argmax())
            out.append(tok)
            seq.append(tok)
    return out


# --------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------
def test_generate_equals_cache_free_greedy(model) -> None:
    # 20 new tokens after prompts of 3 and 20: crosses the window (16) and HCA / CSA blocks
    prompts = random_prompts([3, 20], VOCAB, seed=1)
    gen = Generator(model, max_batch_size=2, max_seq_len=64, compile=False, prefill_chunk=8)
    out = gen.generate(prompts, max_new_tokens=20)
    assert isinstance(out, list) and all(isinstance(r, list) for r in out)
    assert [len(r) for r in out] == [20, 20]  # new tokens only
    assert all(type(t) is int and 0 <= t < VOCAB for r in out for t in r)
    assert out == [greedy_cache_free(model, p, 20) for p in prompts]
    assert len(set(out[0] + out[1])) > 3  # not a degenerate constant stream


def test_generate_one_new_token_is_the_prefill_argmax(model) -> None:
    prompts = random_prompts([7, 1], VOCAB, seed=2)
    gen = Generator(model, max_batch_size=2, max_seq_len=16, compile=False)
    logits = Generator(model, max_batch_size=2, max_seq_len=16, compile=False).prefill(prompts)
    assert gen.generate(prompts, max_new_tokens=1) == [[t] for t in logits.argmax(-1).tolist()]


def test_bucket_padding_and_batch_reuse_give_each_prompt_its_own_tokens(model, tol) -> None:
    """Batches of 3, 2 and 1 prompts (buckets 4, 2, 1 of max_batch_size 4), run one after the
    other on the same generator: every row's tokens equal the prompt run alone."""
    prompts = random_prompts([1, 17, 30], VOCAB, seed=3)
    alone = Generator(model, max_batch_size=1, max_seq_len=MAX_SEQ, compile=False)
    want = [alone.generate([p], max_new_tokens=12)[0] for p in prompts]
    gen = Generator(model, max_batch_size=4, max_seq_len=MAX_SEQ, compile=False)
    assert gen.buckets == [1, 2, 4]
    assert gen.generate(prompts, max_new_tokens=12) == want  # bucket 4, one padding row
    assert gen.generate(prompts[1:], max_new_tokens=12) == want[1:]  # bucket 2, rows reused
    assert gen.generate(prompts[2:], max_new_tokens=12) == want[2:]  # bucket 1
    assert gen.generate(prompts[::-1], max_new_tokens=12) == want[::-1]  # rows swapped
    # the logits too, not just the argmax
    a = Generator(model, max_batch_size=4, max_seq_len=MAX_SEQ, compile=False).prefill(prompts)
    for b, p in enumerate(prompts):
        torch.testing.assert_close(a[b], alone.prefill([p])[0], **tol("batch_row_vs_alone"))


@pytest.mark.parametrize("n_prompts, spec_steps", [(1, 0), (3, 0), (1, 2)])
def test_prefill_chunks_have_the_same_strides_for_every_prompt_length(model, n_prompts, spec_steps) -> None:
    """Dynamo guards on strides: every chunk a step receives must look the same whatever the
    prompt length, or a compiled step recompiles per length (bucket 1 did: a ``[1, C]`` slice of
    the long id tensor kept the long tensor's row stride)."""
    gen = Generator(model, max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ, compile=False, prefill_chunk=8,
                    spec_steps=spec_steps)
    seen, run = set(), gen._run

    def spy(kind, bucket, fn, *args, **kwargs):
        seen.add(tuple((tuple(a.shape), a.stride()) for a in args if isinstance(a, torch.Tensor)))
        return run(kind, bucket, fn, *args, **kwargs)

    gen._run = spy
    for n in (5, 8, 30, MAX_SEQ - 4):  # 1, 1, 4 and 6 chunks
        gen.prefill([list(range(n))] * n_prompts)
    assert len(seen) == 1, seen
    (args,) = seen
    assert args[0] == ((n_prompts, 8), (8, 1))  # bucket = n_prompts (1 or 3)


def test_eager_steps_run_in_inference_mode_and_return_tensors_the_caller_may_update(model) -> None:
    """Eager (``compile=False``) steps run in inference mode, so each op call skips the dispatcher's
    autograd and view-tracking layers; the logits they return are ordinary tensors (copies), which
    a caller may update in place."""
    seen = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda *_: seen.append(torch.is_inference_mode_enabled()))
    try:
        gen = Generator(model, max_batch_size=1, max_seq_len=MAX_SEQ, compile=False)
        logits = gen.prefill([[1, 2, 3]])
        logits = torch.cat([logits, gen.decode(logits.argmax(-1))])
    finally:
        hook.remove()
    assert seen and all(seen)
    assert not logits.is_inference()
    logits.mul_(2)  # an inference tensor would raise here


def test_stats(model) -> None:
    gen = Generator(model, max_batch_size=2, max_seq_len=32, compile=False, prefill_chunk=8)
    s = gen.stats
    for key in ("graph_breaks", "recompiles", "cuda_graph_replays", "accepted_tokens", "decode_tokens_per_s",
                "prefill_steps", "decode_steps", "tokens_generated", "compile_time_s"):
        assert key in s, key
    assert s["decode_tokens_per_s"] == 0.0 and s["tokens_generated"] == 0
    gen.generate(random_prompts([3, 10], VOCAB, seed=4), max_new_tokens=5)
    s = gen.stats
    assert s["graph_breaks"] == s["recompiles"] == s["cuda_graph_replays"] == 0  # eager: nothing compiled
    assert s["accepted_tokens"] == 0  # no speculative decoding
    assert s["prefill_steps"] == 2 and s["decode_steps"] == 4  # 10 tokens in chunks of 8; 5 - 1 decodes
    assert s["tokens_generated"] == 10 and s["decode_tokens_per_s"] > 0
    s["decode_steps"] = -1  # a copy: the generator's own counters are untouched
    assert gen.stats["decode_steps"] == 4


def test_stats_count_prefill_and_decode_called_directly(model) -> None:
    """Users who drive prefill / decode themselves get token counts and a decode rate too."""
    gen = Generator(model, max_batch_size=2, max_seq_len=32, compile=False, prefill_chunk=8)
    logits = gen.prefill(random_prompts([3, 10], VOCAB, seed=4))
    assert gen.stats["tokens_generated"] == 2 and gen.stats["decode_tokens"] == 0
    for _ in range(3):
        logits = gen.decode(logits.argmax(-1))
    s = gen.stats
    assert s["tokens_generated"] == 2 + 3 * 2 and s["decode_tokens"] == 6 and s["decode_steps"] == 3
    assert s["decode_time_s"] > 0 and s["decode_tokens_per_s"] == pytest.approx(6 / s["decode_time_s"])


# --------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------
VALID = [[5, 6, 7], [9] * 12]


@pytest.fixture(scope="module")
def fresh_tokens(model):
    return Generator(model, max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ, compile=False).generate(VALID, 6)


def prefilled(gen: Generator, n: int = 2, length: int = 4) -> Generator:
    gen.prefill([[1] * length] * n)
    return gen


BAD = {
    "prompt_longer_than_max_seq_len": (
        lambda g: g.prefill([[1] * (MAX_SEQ + 1)]), r"prompts\[0\] has 49 tokens > max_seq_len 48"),
    "generate_past_max_seq_len": (
        lambda g: g.generate([[1] * 40], max_new_tokens=10), r"max_new_tokens \(10\).*> max_seq_len 48"),
    "more_prompts_than_max_batch_size": (
        lambda g: g.prefill([[1]] * (MAX_BATCH + 1)), r"4 prompts > max_batch_size 3"),
    "token_id_equal_to_vocab": (
        lambda g: g.prefill([[1, 2], [3, VOCAB, 4]]), r"prompts\[1\] has token id 256 .*vocab_size=256"),
    "negative_token_id": (lambda g: g.prefill([[1, -1]]), r"prompts\[0\] has token id -1 .*vocab_size"),
    "float_token_id": (lambda g: g.prefill([[1, 2.5]]), r"prompts\[0\] must be a list of int token ids"),
    "flat_prompt_list": (lambda g: g.prefill([1, 2, 3]), r"prompts must be a list of token-id lists, got a flat list of ints"),
    "empty_prompt": (lambda g: g.prefill([[1, 2], []]), r"prompts\[1\] is empty"),
    "empty_prompt_list": (lambda g: g.prefill([]), r"prompts is empty"),
    "generate_empty_prompt_list": (lambda g: g.generate([], max_new_tokens=3), r"prompts is empty"),
    "max_new_tokens_zero": (lambda g: g.generate(VALID, max_new_tokens=0), r"max_new_tokens must be an int >= 1, got 0"),
    "decode_before_prefill": (lambda g: g.decode(torch.tensor([1])), r"call prefill first"),
    "decode_too_many_ids": (
        lambda g: prefilled(g).decode(torch.tensor([1, 2, 3])), r"next_ids must have shape \[2\].*got \(3,\)"),
    "decode_too_few_ids": (lambda g: prefilled(g).decode(torch.tensor([1])), r"next_ids must have shape \[2\]"),
    "decode_2d_ids": (lambda g: prefilled(g).decode(torch.tensor([[1], [2]])), r"next_ids must have shape \[2\]"),
    "decode_id_equal_to_vocab": (
        lambda g: prefilled(g).decode(torch.tensor([1, VOCAB])), r"next_ids\[1\] = 256 is outside \[0, vocab_size=256\)"),
    "decode_negative_id": (lambda g: prefilled(g).decode(torch.tensor([-3, 1])), r"next_ids\[0\] = -3 is outside"),
    "decode_float_ids": (
        lambda g: prefilled(g).decode(torch.tensor([1.0, 2.0])), r"next_ids must hold integer token ids"),
    "decode_past_max_seq_len": (
        lambda g: prefilled(g, 1, MAX_SEQ).decode(torch.tensor([1])), r"would exceed max_seq_len 48"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_clear_error_and_generator_stays_usable(model, fresh_tokens, case: str) -> None:
    call, message = BAD[case]
    gen = Generator(model, max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ, compile=False)
    with pytest.raises(ValueError, match=message):
        call(gen)
    assert gen.generate(VALID, 6) == fresh_tokens


def test_decode_right_up_to_max_seq_len(model) -> None:
    gen = Generator(model, max_batch_size=1, max_seq_len=20, compile=False)
    out = gen.generate([[3] * 10], max_new_tokens=11)  # the last new token is never fed: 10 + 10 = 20
    assert len(out[0]) == 11
    gen.prefill([[3] * 19])
    gen.decode(torch.tensor([1]))  # position 19, the last one
    with pytest.raises(ValueError, match="max_seq_len 20"):
        gen.decode(torch.tensor([1]))


def test_rejected_decode_does_not_advance_the_state(model) -> None:
    prompts = random_prompts([4, 9], VOCAB, seed=6)
    # the pool belongs to the model: interleaved generators need a model each
    ref = Generator(copy.deepcopy(model), max_batch_size=2, max_seq_len=32, compile=False)
    gen = Generator(model, max_batch_size=2, max_seq_len=32, compile=False)
    ref.prefill(prompts), gen.prefill(prompts)
    ref.decode(torch.tensor([1, 2])), gen.decode(torch.tensor([1, 2]))
    for bad in (torch.tensor([3]), torch.tensor([3, VOCAB]), torch.tensor([0.5, 1.0])):
        with pytest.raises(ValueError):
            gen.decode(bad)
    with pytest.raises(ValueError):
        gen.prefill([[1], [2], [3], [4]])  # a rejected prefill leaves the running batch alone too
    torch.testing.assert_close(gen.decode(torch.tensor([3, 4])), ref.decode(torch.tensor([3, 4])), rtol=0, atol=0)


def test_constructor_rejects_bad_arguments(model) -> None:
    with pytest.raises(ValueError, match="prefill_chunk must be an int >= 1, got 0"):
        Generator(model, compile=False, prefill_chunk=0)
    with pytest.raises(ValueError, match="prefill_chunk must be an int >= 1, got -64"):
        Generator(model, compile=False, prefill_chunk=-64)
    with pytest.raises(ValueError, match="prefill_chunk must be an int >= 1, got 64.0"):
        Generator(model, compile=False, prefill_chunk=64.0)
    for bad in (0, -1, 8192.0, "8192", True):
        with pytest.raises(ValueError, match=f"max_prefill_tokens must be an int >= 1, got {bad!r}"):
            Generator(model, compile=False, max_prefill_tokens=bad)
    with pytest.raises(ValueError, match="max_prefill_tokens=4096 bounds the steps of chunk buckets .* "
                                         "prefill_chunk=64 .* pass one or the other"):
        Generator(model, compile=False, prefill_chunk=64, max_prefill_tokens=4096)
    with pytest.raises(ValueError, match="max_batch_size must be an int >= 1"):
        Generator(model, max_batch_size=0, compile=False)
    with pytest.raises(ValueError, match="max_seq_len must be an int >= 1"):
        Generator(model, max_seq_len=0, compile=False)
    with pytest.raises(ValueError, match="cuda_graphs=True needs compile=True"):
        Generator(model, max_seq_len=8, compile=False, cuda_graphs=True)
    with pytest.raises(ValueError, match="compile must be True or False, got 'yes'"):
        Generator(model, max_seq_len=8, compile="yes")
    with pytest.raises(ValueError, match="spec_steps must be an int >= 0, got True"):
        Generator(model, max_seq_len=8, compile=False, spec_steps=True)
    with pytest.raises(ValueError, match="cuda_graphs must be True, False or None"):
        Generator(model, max_seq_len=8, compile=False, cuda_graphs="auto")


def test_decode_ids_are_viewed_when_full_and_standard_else_padded():
    """``pad_rows``: a full int64 batch with stride (1,) is the step's input as it is (no copy per
    decode call); a strided column, another dtype or a partial batch get a fresh [rows, 1] copy
    with standard strides (dynamo guards on strides)."""
    from dsv4_ops.generation_loop import pad_rows
    ids = torch.tensor([7, 8, 9])
    assert pad_rows(ids, 3).data_ptr() == ids.data_ptr() and pad_rows(ids, 3).stride() == (1, 1)
    column = torch.tensor([[5, 9], [6, 9]])[:1, 0]  # contiguous by is_contiguous(), stride (2,)
    for got, want in ((pad_rows(column, 1), [[5]]), (pad_rows(ids.int(), 3), [[7], [8], [9]]),
                      (pad_rows(ids[:2], 3), [[7], [8], [0]])):
        assert got.dtype == torch.long and got.stride() == (1, 1) and got.tolist() == want
    assert pad_rows(column, 1).data_ptr() != column.data_ptr()
