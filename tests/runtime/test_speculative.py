"""Multi-step MTP speculative decoding is exact: greedy ``generate`` with ``spec_steps`` in
{1, 2, 3, 4} returns exactly the tokens of ``spec_steps=0`` — with random MTP weights (low
acceptance), with drafts that always equal the main model's greedy tokens (full acceptance),
and with a mix of rows that accept everything and rows that accept nothing — for ragged
batches generating past the window and across CSA and HCA block boundaries. Every draft
step's metadata is checked against the position it writes (no stale per-step metadata)."""
from __future__ import annotations

import pytest
import torch

from dsv4_ops import DSV4Config, Generator
from model_util import random_model
from spec_case import CFG, KW, NEW, PROMPTS


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=1)


@pytest.fixture(scope="module")
def greedy(model):
    return Generator(model, **KW).generate(PROMPTS, max_new_tokens=NEW)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_mtp_drafts_give_exactly_the_greedy_tokens(model, greedy, k):
    gen = Generator(model, spec_steps=k, **KW)
    assert gen.generate(PROMPTS, max_new_tokens=NEW) == greedy
    s = gen.stats
    assert s["spec_steps_run"] == len(gen.spec_history) > 0
    assert 0.0 <= s["acceptance_rate"] <= 1.0 and s["drafted_tokens"] > 0


@pytest.mark.parametrize("k", [1, 3])
def test_full_acceptance_when_drafts_equal_greedy(model, greedy, k):
    gen = Generator(model, spec_steps=k, _draft="oracle", **KW)
    assert gen.generate(PROMPTS, max_new_tokens=NEW) == greedy
    hist = gen.spec_history
    # the first step verifies placeholder drafts; afterwards every draft is accepted until a row
    # is done (a row's last step may emit past max_new_tokens: the extra tokens are cut)
    done = [1] * len(PROMPTS)
    for step, counts in enumerate(hist):
        for b, c in enumerate(counts):
            if done[b] >= NEW:
                assert c == 0  # finished rows sit out
                continue
            if step > 0:
                assert c == k + 1, (step, b, counts)
            done[b] += c
    assert gen.stats["acceptance_rate"] > 0.8


def test_rows_that_accept_all_and_rows_that_accept_none(model, greedy):
    k = 2
    gen = Generator(model, spec_steps=k, _draft="oracle", **KW)
    gen.spec.wrong_rows[1] = True  # row 1's drafts are always wrong
    assert gen.generate(PROMPTS, max_new_tokens=NEW) == greedy
    for step, counts in enumerate(gen.spec_history[1:], start=1):
        assert counts[1] == 1, (step, counts)  # bonus token only
        assert all(c in (0, k + 1) for b, c in enumerate(counts) if b != 1), (step, counts)


def test_real_hca_rate_128():
    cfg = DSV4Config.tiny(num_hidden_layers=3)
    cfg = cfg.replace(hca_ratio=128)
    model = random_model(cfg, seed=2)
    prompts = [list(range(100, 220)), [5, 6]]  # the first row crosses position 127 -> 128
    kw = dict(KW, max_seq_len=192)
    want = Generator(model, **kw).generate(prompts, max_new_tokens=20)
    assert Generator(model, spec_steps=3, **kw).generate(prompts, max_new_tokens=20) == want
    assert Generator(model, spec_steps=2, _draft="oracle", **kw).generate(prompts, max_new_tokens=20) == want


def test_every_draft_step_plans_the_position_it_writes(model):
    """Stale-metadata guard: draft step i of a speculative step must be planned for position
    L' + i (L' = the new length after acceptance), write its window slot there and see the
    window ending there; the extend step must start one position before the verified ones."""
    k = 3
    gen = Generator(model, spec_steps=k, **KW)
    gen.prefill(PROMPTS)
    R = model.cache_config.mtp_rings.window
    W = CFG.sliding_window
    for _ in range(6):
        L = gen.lengths[:4].clone()
        gen.spec.record = []
        active = torch.tensor([1, 1, 1, 0], dtype=torch.int32)
        _, counts = gen._run("spec", 4, gen.spec.spec_step, active)
        log, gen.spec.record = gen.spec.record, None
        kinds = [e[0] for e in log]
        assert kinds == ["extend"] + ["draft"] * (k - 1)  # planned steps == executed steps
        _, start, n_ext, pos, _, _ = log[0]
        assert torch.equal(start, L - 1)
        assert torch.equal(n_ext, active * (counts + 1))
        new_len = L + counts
        assert torch.equal(gen.lengths[:4], new_len)
        for i, (_, start, n_new, pos, win_write, win_idx) in enumerate(log[1:]):
            act = active.bool()
            want = new_len + i
            assert torch.equal(start[act], want[act].to(start.dtype))
            assert torch.equal(pos[act, 0], want[act].to(pos.dtype))
            assert torch.equal(win_write[act, 0], (want[act] % R).to(win_write.dtype))
            # the window of the query: positions want-W+1 .. want (oldest first), -1 before 0
            for b in torch.nonzero(act).flatten().tolist():
                p = int(want[b])
                expect = [(q % R) if q >= 0 else -1 for q in range(p - W + 1, p + 1)]
                assert win_idx[b, 0].tolist() == expect
            assert (pos[~act] == -1).all() and (win_write[~act] == -1).all()


def test_spec_generator_rejects_decode_and_bad_arguments(model):
    gen = Generator(model, spec_steps=2, **KW)
    gen.prefill(PROMPTS)
    with pytest.raises(ValueError, match="spec_steps > 0; use generate"):
        gen.decode(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="spec_steps must be an int >= 0"):
        Generator(model, spec_steps=-1, **KW)
    no_mtp = random_model(CFG.replace(num_nextn_predict_layers=0), seed=3)
    with pytest.raises(ValueError, match="MTP block"):
        Generator(no_mtp, spec_steps=2, **KW)
