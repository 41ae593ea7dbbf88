"""Sampling and stopping in ``generate`` (``sampling.py``, ``generate_args.py``).

The sampler: a top-p / top-k cut keeps exactly the nucleus; seeded draws follow
``softmax(logits / T)`` (chi-square); temperature -> 0 and top_k = 1 are greedy; the compiled
sampler draws exactly the eager tokens and new settings add no graph. ``generate``: seeded runs
repeat, seeds differ, a row that hits its stop id (or its own max_new_tokens) stops there, writes
nothing more to the cache and leaves the other rows' tokens alone; bad keywords raise ValueErrors
naming the argument and its limit. Speculative sampling keeps the target distribution
(chi-square, with a wrong rejection rule as the negative control).

Statistical tests use fixed seeds (deterministic) and reject at p < 1e-4 (a correct sampler
fails one with probability 1e-4; the broken ones here give p < 1e-30)."""
from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

from dsv4_ops import DSV4Config, Generator, sampling, speculative
from dsv4_ops.sampling import SamplingParams
from model_util import random_model
from stats_util import chi_square_p

P_MIN = 1e-4
PROMPTS = [[3, 1, 4, 1, 5], list(range(20)), [7] * 9]
NEW = 8
KW = dict(max_batch_size=4, max_seq_len=64, prefill_chunk=8, compile=False)


def params(B, temperature=1.0, top_k=0, top_p=1.0, seed=0) -> SamplingParams:
    def col(v, dtype):
        return torch.as_tensor(v if isinstance(v, list) else [v] * B, dtype=dtype)

    return SamplingParams(col(temperature, torch.float32), col(top_k, torch.int64), col(top_p, torch.float32),
                          col(seed, torch.int64))


# --------------------------------------------------------------------------------------
# the sampler on hand-made logits
# --------------------------------------------------------------------------------------
def test_top_p_keeps_exactly_the_nucleus() -> None:
    # probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 (tokens 2, 0, 4, 1, 3)
    logits = torch.log(torch.tensor([[0.25, 0.0625, 0.5, 0.0625, 0.125]])).repeat(4, 1)
    top_p = [0.4, 0.6, 0.8, 1.0]  # nucleus: {2}, {2, 0}, {2, 0, 4}, everything
    kept = sampling.filter_logits(logits, params(4, top_p=top_p)).isfinite()
    assert kept.tolist() == [[False, False, True, False, False],
                             [True, False, True, False, False],
                             [True, False, True, False, True],
                             [True, True, True, True, True]]


def test_top_k_keeps_the_k_most_likely_and_top_p_renormalises_after_it() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]]).repeat(3, 1)
    kept = sampling.filter_logits(logits, params(3, top_k=[1, 3, 0])).isfinite()
    assert kept.tolist() == [[False, True, False, False, False], [False, True, True, True, False], [True] * 5]
    # top_k=2 leaves tokens 1, 2 with renormalised probabilities 0.73, 0.27: top_p=0.7 keeps only token 1
    kept = sampling.filter_logits(logits[:1], params(1, top_k=2, top_p=0.7)).isfinite()
    assert kept.tolist() == [[False, True, False, False, False]]


def test_filtering_keeps_ties_with_the_last_kept_token() -> None:
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    assert sampling.filter_logits(logits, params(1, top_k=2)).isfinite().tolist() == [[True, True, True, False]]


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 1.0), (1.3, 4, 0.9)])
def test_seeded_draws_follow_softmax_of_logits_over_temperature(temperature, top_k, top_p) -> None:
    """40000 draws (one seed each) of a 6-token vocabulary: chi-square against the filtered
    ``softmax(logits / T)``."""
    logits = torch.tensor([1.2, -0.3, 0.4, 2.0, -1.5, 0.9])
    N, V = 40000, logits.shape[0]
    p = params(N, temperature, top_k, top_p, seed=torch.arange(N).tolist())
    tokens = sampling.sample(logits.expand(N, V), p, pos=torch.full((N,), 7))
    want = sampling.probs(logits[None], params(1, temperature, top_k, top_p))[0]
    if top_k:
        assert (want > 0).sum() < V  # the cut removed tokens; none of them may be drawn
    assert chi_square_p(torch.bincount(tokens, minlength=V), want) > P_MIN
    # and the test has power: temperature 1 instead of T fails it
    assert chi_square_p(torch.bincount(tokens, minlength=V), torch.softmax(logits, -1)) < 1e-30


def test_uniforms_are_deterministic_and_open_interval() -> None:
    seed, pos, tok = torch.arange(1000)[:, None], torch.tensor(5), torch.arange(64)[None]
    u = sampling.hash_uniform(seed, pos, tok, sampling.STREAM_SAMPLE)
    assert torch.equal(u, sampling.hash_uniform(seed, pos, tok, sampling.STREAM_SAMPLE))
    assert 0 < u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01
    assert not torch.equal(u, sampling.hash_uniform(seed, pos, tok, sampling.STREAM_DRAFT))
    assert not torch.equal(u, sampling.hash_uniform(seed, pos + 1, tok, sampling.STREAM_SAMPLE))


def test_uniforms_stay_inside_the_open_interval_at_the_extreme_hashes() -> None:
    """Every 32-bit hash maps strictly inside (0, 1), the largest too (a uniform of exactly 1 is
    an infinite Gumbel noise: it drew tokens outside the top-k on the trained model)."""
    h = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 512, 2**32 - 1])
    u = sampling.uniform_from_bits(h)
    assert u.dtype == torch.float32 and bool(((u > 0) & (u < 1)).all())
    assert u[0] == u[1] and u[-2] == u[-1] < 1 and u[2] < u[3]


def test_greedy_rows_take_the_argmax_and_tiny_temperature_converges_to_it() -> None:
    logits = torch.randn(8, 50)
    greedy = logits.argmax(-1)
    for t, k in [(0.0, 0), (1e-6, 0), (2.0, 1)]:
        assert torch.equal(sampling.sample(logits, params(8, t, top_k=k, seed=3), torch.arange(8)), greedy)


def test_compiled_sampler_draws_the_eager_tokens() -> None:
    """Counter-based uniforms: the Inductor-compiled sampler draws exactly what eager draws."""
    logits, pos = torch.randn(4, 256), torch.tensor([3, 9, 40, 100])
    p = params(4, [0.0, 0.8, 1.0, 1.5], [0, 0, 20, 5], [1.0, 0.9, 1.0, 0.5], [1, 2, 3, 4])
    compiled = torch.compile(sampling.sample, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(logits, p, pos), sampling.sample(logits, p, pos))


# --------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return random_model(DSV4Config.tiny(num_hidden_layers=3, hca_ratio=8), seed=1)


@pytest.fixture(scope="module")
def gen(model):
    return Generator(model, **KW)


@pytest.fixture(scope="module")
def greedy(gen):
    return gen.generate(PROMPTS, max_new_tokens=NEW)


def test_seeded_sampling_repeats_and_seeds_differ(gen, greedy) -> None:
    a = gen.generate(PROMPTS, NEW, temperature=1.0, seed=0)
    assert a == gen.generate(PROMPTS, NEW, temperature=1.0, seed=0)
    assert a != gen.generate(PROMPTS, NEW, temperature=1.0, seed=1) and a != greedy
    # a single seed s seeds prompt i with s + i: prompt 1 alone with seed 1 draws the same tokens
    assert gen.generate(PROMPTS[1:2], NEW, temperature=1.0, seed=1) == a[1:2]
    assert gen.generate(PROMPTS, NEW, temperature=1.0, seed=[0, 1, 2]) == a


def test_greedy_limits_of_sampling_are_greedy(gen, greedy) -> None:
    assert gen.generate(PROMPTS, NEW, temperature=0) == greedy
    assert gen.generate(PROMPTS, NEW, temperature=1.5, top_k=1, seed=4) == greedy
    assert gen.generate(PROMPTS, NEW, temperature=1e-6, seed=4) == greedy
    mixed = gen.generate(PROMPTS, NEW, temperature=[0.0, 1.0, 0.0], seed=4)  # per-row temperatures
    assert mixed[0] == greedy[0] and mixed[2] == greedy[2] and mixed[1] != greedy[1]


def cache_rows(model, row: int) -> list[torch.Tensor]:
    return [t[row].clone() for st in model.cache_states() for t in st.tensors().values()]


def test_a_row_stops_at_its_stop_id_and_writes_nothing_after_it(model, gen, greedy, tol) -> None:
    stop = greedy[0][3]
    assert stop not in greedy[0][:3] and stop not in greedy[1] + greedy[2]  # only row 0 hits it
    for t in [t for st in model.cache_states() for t in st.tensors().values()]:
        t.zero_()
    out = gen.generate(PROMPTS, NEW, eos_token_id=stop)
    assert out == [greedy[0][:4], greedy[1], greedy[2]]  # the stop id is included; the others go on
    # row 0 processed its prompt and 3 generated tokens (the 4th, the stop id, is never fed)
    assert gen.lengths[:3].tolist() == [len(PROMPTS[0]) + 3, len(PROMPTS[1]) + NEW - 1, len(PROMPTS[2]) + NEW - 1]
    batch_cache = cache_rows(model, 0)
    for t in [t for st in model.cache_states() for t in st.tensors().values()]:
        t.zero_()
    assert gen.generate(PROMPTS[:1], 4) == [greedy[0][:4]]  # row 0 alone, 4 tokens
    for a, b in zip(batch_cache, cache_rows(model, 0)):  # nothing written past its stop
        torch.testing.assert_close(a, b, **tol("batch_row_vs_alone"))


def test_sampled_rows_stop_independently_and_keep_their_tokens(gen) -> None:
    seeds = [10, 11, 12]
    full = gen.generate(PROMPTS, NEW, temperature=1.0, seed=seeds)
    stop = full[1][2]
    out = gen.generate(PROMPTS, NEW, temperature=1.0, seed=seeds, eos_token_id=[[], [stop], None])
    assert out == [full[0], full[1][: full[1].index(stop) + 1], full[2]]
    alone = [gen.generate([p], NEW, temperature=1.0, seed=s) for p, s in zip(PROMPTS, seeds)]
    assert out[0] == alone[0][0] and out[2] == alone[2][0]


def test_per_request_max_new_tokens(gen, greedy) -> None:
    out = gen.generate(PROMPTS, max_new_tokens=[3, NEW, 1])
    assert out == [greedy[0][:3], greedy[1], greedy[2][:1]]
    assert gen.lengths[:3].tolist() == [len(PROMPTS[0]) + 2, len(PROMPTS[1]) + NEW - 1, len(PROMPTS[2])]


def test_all_rows_stopped_ends_the_loop_early(gen, greedy) -> None:
    steps = gen.stats["decode_steps"]
    out = gen.generate(PROMPTS, 40, eos_token_id=sorted({r[0] for r in greedy}))  # every row stops at once
    assert out == [r[:1] for r in greedy]
    assert gen.stats["decode_steps"] - steps == 8  # the done flag is read every 8 steps


BAD = {
    "negative temperature": (dict(temperature=-0.5), r"temperature must be a finite number >= 0.*got -0.5"),
    "top_p zero": (dict(temperature=1.0, top_p=0.0), r"top_p must be a number in \(0, 1\].*got 0.0"),
    "top_p above one": (dict(top_p=1.5), r"top_p must be a number in \(0, 1\].*got 1.5"),
    "negative top_k": (dict(top_k=-1), r"top_k must be an int >= 0.*got -1"),
    "float top_k": (dict(top_k=2.5), r"top_k must be an int >= 0"),
    "short temperature list": (dict(temperature=[1.0, 1.0]), r"temperature has 2 entries; pass one per prompt \(3\)"),
    "long max_new_tokens list": (dict(max_new_tokens=[1, 2, 3, 4]), r"max_new_tokens has 4 entries.*\(3\)"),
    "zero max_new_tokens entry": (dict(max_new_tokens=[1, 0, 3]), r"max_new_tokens\[1\] must be an int >= 1, got 0"),
    "eos outside vocab": (dict(eos_token_id=256), r"eos_token_id: token id 256 is outside \[0, vocab_size=256\)"),
    "negative eos in list": (dict(eos_token_id=[1, -2]), r"token id -2 is outside \[0, vocab_size=256\)"),
    "per-row eos outside vocab": (dict(eos_token_id=[[1], None, [999]]), r"eos_token_id\[2\]: token id 999"),
    "negative seed": (dict(temperature=1.0, seed=-1), r"seed must be an int in \[0, 2\*\*63\)"),
    "per-row max_new past max_seq_len": (dict(max_new_tokens=[1, 50, 1]), r"prompts\[1\].*> max_seq_len 64"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_bad_keywords_raise_clear_errors(gen, greedy, case) -> None:
    kwargs, message = BAD[case]
    kwargs = {"max_new_tokens": NEW, **kwargs}
    steps = gen.stats["prefill_steps"]
    with pytest.raises(ValueError, match=message):
        gen.generate(PROMPTS, **kwargs)
    assert gen.stats["prefill_steps"] == steps  # rejected before anything ran


# --------------------------------------------------------------------------------------
# compiled sampling: tokens equal eager, new settings add no graph
# --------------------------------------------------------------------------------------
def test_compiled_generate_samples_the_eager_tokens_and_new_settings_add_no_graph(model, gen) -> None:
    """The sampler compiles once per bucket (twice with top-k / top-p: the sort is a static
    choice) and takes its settings as tensors. The model's step runs eagerly here: compiling it
    on a 2-core CPU costs a minute and ``test_compile_model.py`` covers it (its graphs take
    ``n_new`` as an input already, so stopped rows change no graph)."""
    compiled = Generator(model, **dict(KW, compile=True), cuda_graphs=False)
    compiled._forward = model  # only the sampler compiles (see the docstring)
    runs = [dict(temperature=1.0, seed=0), dict(temperature=0.6, seed=[5, 6, 7]),
            dict(temperature=1.0, top_p=0.9, seed=1),
            dict(temperature=[0.3, 2.0, 0.0], top_k=[5, 0, 0], top_p=0.5, seed=2)]
    for kwargs in runs[:1] + runs[2:3]:  # warm-up: both sampler graphs of bucket 4
        compiled.generate(PROMPTS, 6, **kwargs)
    graphs = dict(compiled._graphs)
    assert graphs == {("sample", 4): 1, ("sample_filtered", 4): 1}
    with torch.compiler.set_stance("fail_on_recompile"):
        for kwargs in runs:
            assert compiled.generate(PROMPTS, 6, eos_token_id=[[], [1], []], **kwargs) == gen.generate(
                PROMPTS, 6, eos_token_id=[[], [1], []], **kwargs)
    assert compiled._graphs == graphs and compiled.stats["recompiles"] == 0 and compiled.stats["graph_breaks"] == 0


# --------------------------------------------------------------------------------------
# speculative sampling
# --------------------------------------------------------------------------------------
def spec_draws(logits_p: torch.Tensor, logits_q: torch.Tensor, N: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One speculative step for N rows (seeds 0..N-1) whose drafts come from ``q`` and whose
    verifier has ``p`` at every position: returns (first token, second token or -1)."""
    V = logits_p.shape[-1]
    prm = params(N, seed=torch.arange(N).tolist())
    L = torch.full((N,), 10, dtype=torch.int32)
    drafts, qs = [], []
    for j in range(k):
        d, q = sampling.sample_with_probs(logits_q.expand(N, V), prm, L.long() + 1 + j, stream=sampling.STREAM_DRAFT)
        drafts.append(d)
        qs.append(q)
    drafts, q = torch.stack(drafts, 1), torch.stack(qs, 1)
    a, token = speculative.accept_drafts(logits_p.expand(N, k + 1, V), drafts, q, L, prm, filtered=True)
    emitted = torch.cat([drafts, token[:, None]], 1)
    emitted = torch.where(torch.arange(k + 1) < a[:, None], emitted, token[:, None])  # position a: the new token
    return emitted[:, 0], torch.where(a >= 1, emitted[:, 1], -1)


def test_rejection_rule_keeps_the_target_distribution() -> None:
    """The rule alone (context-free p and q, 40000 rows, k = 2): every emitted token follows p,
    however different q is; accepting every draft would emit q's distribution."""
    logits_p = torch.tensor([0.5, 1.5, -1.0, 0.0, 1.0, -0.5])
    logits_q = torch.tensor([2.0, -1.0, 1.0, 0.0, -2.0, 1.5])
    p = torch.softmax(logits_p, -1)
    first, second = spec_draws(logits_p, logits_q, 40000, k=2)
    assert chi_square_p(torch.bincount(first, minlength=6), p) > P_MIN
    second = second[second >= 0]
    assert len(second) > 10000 and chi_square_p(torch.bincount(second, minlength=6), p) > P_MIN
    assert chi_square_p(torch.bincount(first, minlength=6), torch.softmax(logits_q, -1)) < 1e-30


SPEC_CFG = DSV4Config.tiny(num_hidden_layers=1, vocab_size=8)
SPEC_PROMPT = [1, 2, 3]
SPEC_SAMPLING = dict(temperature=0.9, top_k=6)


def exact_marginals(model, n: int) -> list[torch.Tensor]:
    """The exact distribution of generated tokens 0..n-1 under SPEC_SAMPLING: every path of n-1
    tokens through the cache-free model, weighted by its probability."""
    V = SPEC_CFG.vocab_size
    dev = model.device
    paths = torch.tensor(list(itertools.product(range(V), repeat=n - 1)), device=dev)  # [V^(n-1), n-1]
    ids = torch.cat([torch.tensor(SPEC_PROMPT, device=dev).expand(len(paths), -1), paths], 1)
    with torch.no_grad():
        logits = model(ids)[:, len(SPEC_PROMPT) - 1:]  # [paths, n, V]: position j predicts token j
    P = len(paths)
    prm = SamplingParams(*(t.to(dev) for t in params(P * n, **SPEC_SAMPLING)))
    probs = sampling.probs(logits.reshape(P * n, V), prm).view(P, n, V)
    weight = torch.ones(P, dtype=torch.float64, device=dev)
    out = []
    for j in range(n):
        out.append((weight[:, None] * probs[:, j].double()).sum(0) / V ** (n - 1 - j))
        if j < n - 1:
            weight = weight * probs[torch.arange(P, device=dev), j, paths[:, j]].double()
    return out


def spec_tokens(spec_model, N: int, B: int) -> tuple[torch.Tensor, dict]:
    gen = Generator(spec_model, max_batch_size=B, max_seq_len=8, spec_steps=2, compile=False, prefill_chunk=4)
    out = [gen.generate([SPEC_PROMPT] * B, 3, seed=list(range(s, s + B)), **SPEC_SAMPLING) for s in range(0, N, B)]
    return torch.tensor([row for batch in out for row in batch]), gen.stats


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_speculative_sampling_keeps_the_distribution_of_plain_sampling(device, monkeypatch) -> None:
    """A 1-layer model with 8 tokens, spec_steps = 2 with its (random, so often wrong) MTP
    drafts: sampled continuations of one prompt, 20480 on the GPU box, 4096 on a 2-core CPU
    (the rule itself gets 40000 draws above). Tokens 1 and 2 come out of speculative steps
    (token 2 often from verifying real MTP drafts); each follows the exact distribution of
    plain sampling. Accepting every draft breaks it."""
    spec_model = random_model(SPEC_CFG, seed=7, device=device)
    n, n_bad = (20480, 4096) if device == "cuda" else (4096, 2048)
    want = [w.cpu() for w in exact_marginals(spec_model, 3)]
    tokens, stats = spec_tokens(spec_model, n, 512)
    assert stats["accepted_tokens"] > 0 and stats["acceptance_rate"] < 0.9  # drafts were judged, not waved through
    for j in range(3):
        assert chi_square_p(torch.bincount(tokens[:, j], minlength=8), want[j]) > P_MIN, j
    # negative control: accept every draft (then tokens follow the MTP block's q, not p)

    def accept_all(logits, drafts, draft_probs, L, params, filtered):
        Bk, k1, V = logits.shape
        p = sampling.probs(logits.reshape(-1, V), params.repeat_rows(k1), filtered).view(Bk, k1, V)
        a = torch.full((Bk,), k1 - 1, dtype=torch.int32, device=logits.device)
        return a, sampling.draw_from_probs(p[:, -1], params.seed, L.long() + k1, sampling.STREAM_RESIDUAL)

    monkeypatch.setattr(speculative, "accept_drafts", accept_all)
    bad, _ = spec_tokens(spec_model, n_bad, 512)
    assert min(chi_square_p(torch.bincount(bad[:, j], minlength=8), want[j]) for j in (1, 2)) < P_MIN


def test_tokens_per_step_per_row(model) -> None:
    gen = Generator(model, spec_steps=2, _draft="oracle", **KW)
    gen.spec.wrong_rows[1] = True  # row 1's drafts are always wrong: one token per step
    gen.generate(PROMPTS, NEW)
    per_row = gen.stats["tokens_per_step_per_row"]
    assert len(per_row) == 3 and per_row[1] == 1.0 and per_row[0] > 2.0 and per_row[2] > 2.0
    assert gen.stats["cuda_graph_replays"] == 0  # no CUDA graphs on CPU


# --------------------------------------------------------------------------------------
# GPU box
# --------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("spec_steps", [0, 2])
def test_cuda_graphs_sample_the_eager_tokens_and_count_real_replays(spec_steps) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    m = random_model(DSV4Config.tiny(num_hidden_layers=3, hca_ratio=8), dtype=torch.float32, device="cuda")
    kw = dict(max_batch_size=4, max_seq_len=96, prefill_chunk=16, spec_steps=spec_steps)
    sample_kw = dict(temperature=0.8, top_p=0.9, seed=[1, 2, 3], eos_token_id=[[], [7], []])
    want = Generator(m, compile=False, **kw).generate(PROMPTS, 40, **sample_kw)
    gen = Generator(m, compile=True, cuda_graphs=True, **kw)
    gen.generate(PROMPTS, 3, **sample_kw)  # warm-up: compile + record
    before = gen.stats["cuda_graph_replays"]
    with torch.compiler.set_stance("fail_on_recompile"):
        out = gen.generate(PROMPTS, 40, **sample_kw)
        assert gen.generate(PROMPTS, 40, **dict(sample_kw, temperature=1.3, top_p=0.5)) is not None
    assert out == want
    replays = gen.stats["cuda_graph_replays"] - before
    steps = gen.stats["spec_steps_run"] if spec_steps else gen.stats["decode_steps"]
    assert replays > 0 and gen.stats["recompiles"] == 0
    # every decode (or spec) step and every sample call replays one graph: never more than that
    assert replays <= 2 * steps + 10
    # a call that only warms up or records replays nothing
    fresh = Generator(m, compile=True, cuda_graphs=True, **dict(kw, max_batch_size=2))
    fresh.generate(PROMPTS[:1], 1)
    assert fresh.stats["cuda_graph_replays"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("spec_steps", [0, 2])
def test_cuda_graph_replays_sample_the_tokens_of_the_same_compiled_steps_without_graphs(spec_steps) -> None:
    """The same Inductor kernels with and without CUDA graphs: the replays must give the same bits (the
    eager comparison above also spans Inductor's fusions, whose float rounding differs from eager's)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    m = random_model(DSV4Config.tiny(num_hidden_layers=3, hca_ratio=8), dtype=torch.float32, device="cuda")
    kw = dict(max_batch_size=4, max_seq_len=96, prefill_chunk=16, spec_steps=spec_steps, compile=True)
    sample_kw = dict(temperature=0.8, top_p=0.9, seed=[1, 2, 3], eos_token_id=[[], [7], []])
    want = Generator(m, cuda_graphs=False, **kw).generate(PROMPTS, 40, **sample_kw)
    gen = Generator(m, cuda_graphs=True, **kw)
    gen.generate(PROMPTS, 3, **sample_kw)  # warm-up: compile + record
    before = gen.stats["cuda_graph_replays"]
    assert gen.generate(PROMPTS, 40, **sample_kw) == want
    assert gen.stats["cuda_graph_replays"] > before


@pytest.mark.parametrize("device, compiled", [("cpu", False), pytest.param("cuda", False, marks=pytest.mark.gpu),
                                              pytest.param("cuda", True, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("spec_steps", [0, 2])
@pytest.mark.parametrize("filtering", [dict(temperature=1.0, top_p=1.0), dict(temperature=0.8, top_p=0.9)],
                         ids=["unfiltered", "top_p"])
def test_nan_left_in_the_pool_changes_no_sampled_token(device, compiled, spec_steps, filtering) -> None:
    """Slots a request does not own may hold anything: after NaN fills the KV pool (every float
    buffer of the main layers and of the MTP block), the draft distributions and the speculative
    streams of every row (the bucket's padding row included), a generator samples the tokens it
    sampled before, on the reference ops and on the GPU kernels (eager, where fresh allocations hold
    NaN too, and compiled with CUDA graphs). Unfiltered sampling at temperature 1 with drafts: the
    setting whose GPU tokens once depended on what ran before them; top-p 0.9 at temperature 0.8:
    the CUDA-graph tests' setting, whose last row's GPU tokens part on H100s (results/latest)."""
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    m = random_model(DSV4Config.tiny(num_hidden_layers=3, hca_ratio=8), device=device)
    gen = Generator(m, max_batch_size=4, max_seq_len=96, prefill_chunk=16, spec_steps=spec_steps, compile=compiled,
                    cuda_graphs=compiled)
    skw = dict(filtering, seed=[1, 2, 3], eos_token_id=[[], [7], []])
    want = gen.generate(PROMPTS, 40, **skw)
    states = m.cache_states() + ([m.mtp_cache_state()] if spec_steps else [])
    poisoned = [t for st in states for t in st.tensors().values() if t.is_floating_point()]
    if spec_steps:
        poisoned += [gen.spec.draft_probs, gen.spec.h_last]
    assert len(poisoned) >= 3 * 3
    for t in poisoned:
        t.fill_(float("nan"))
    # eager: every torch.empty scratch and output starts as NaN too (compiled, the flag would recompile the steps)
    with uninitialized_memory_as_nan() if not compiled else contextlib.nullcontext():
        assert gen.generate(PROMPTS, 40, **skw) == want


@contextlib.contextmanager
def uninitialized_memory_as_nan():
    """``torch.empty`` and friends return NaN (float) / the largest int (PyTorch's deterministic
    mode fills uninitialised memory; ``warn_only``: its other checks only warn)."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = before[2]
