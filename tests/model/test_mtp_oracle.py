"""The MTP drafter drafts what DeepSeek-V4's MTP block computes (dsv4_architecture.md §10).

After every speculative step of a ``Generator(model, spec_steps=k)`` — new length ``L'``, the
token at ``L'`` known, drafts for ``L'+1 .. L'+k`` — each draft equals the argmax of the
independent float64 oracle (``dsv4_ops.reference.mtp_oracle``) fed exactly what the real MTP
cache holds:

* draft 1: the oracle over positions ``0 .. L'-1``, position ``t`` pairing the main model's
  final streams at ``t`` (cache-free forward of the emitted sequence) with the token at ``t+1``;
  its output at ``L'-1`` drafts ``L'+1``;
* draft ``i+1``: the same sequence extended by recursive positions ``L' .. L'+i-1``, each
  pairing the oracle's own output streams at the previous position with the previous draft.

The drafter's logits match the oracle's within ``mtp_drafter_vs_float64`` (conftest.TOLERANCES);
argmaxes match exactly except where the oracle's top two logits are within it (counted; expected
never). Acceptance patterns 0, partial and full are forced per row and step
(``force_acceptance``), with prompts and generation crossing window (16) and compression (4, 8)
boundaries, for k = 1 and k = 3.
"""
from __future__ import annotations

import pytest
import torch

from dsv4_ops import Generator
from dsv4_ops.reference.mtp_oracle import mtp_forward, mtp_weights
from dsv4_ops.streams import main_streams
from model_util import random_model
from spec_capture import StepLog, force_acceptance
from spec_case import CFG, KW, NEW, PROMPTS


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=1)


def cuts_all_patterns(k: int):
    """Row 0 never accepts, row 1 accepts everything, row 2 cycles through 0..k (so every step
    mixes zero, full and partial acceptance, and rows drift across window boundaries at
    different phases)."""
    return lambda step, row: {0: 0, 1: k}.get(row, step % (k + 1))


@torch.no_grad()
def check_drafts(model, log: StepLog, prompts, bound: float) -> dict:
    """Every active row of every step: drafted logits vs the oracle, within ``bound``. Returns counts."""
    w = mtp_weights(model)
    seqs = log.sequences(prompts)
    stats = dict(drafts=0, near_ties=0, max_err=0.0, accepted=set())
    for b, seq in enumerate(seqs):
        ids = torch.tensor([seq])
        X = main_streams(model, ids).double()  # [1, T, N, D]
        main = mtp_forward(w, CFG, X[:, :-1], ids[:, 1:])  # position t: (streams t, token t+1)
        for rec in log.steps:
            if not rec["active"][b]:
                continue
            L = int(rec["after"][b])
            stats["accepted"].add(int(rec["counts"][b]) - 1)
            assert int(rec["last_tok"][b]) == seq[L]
            drafts, real = rec["drafts"][b], rec["draft_logits"][b].double()  # [k], [k, vocab]
            # recursive steps only need the last W positions of main inputs (one attention layer)
            lo = max(0, L - CFG.sliding_window)
            streams, toks = X[:, lo:L].clone(), ids[:, lo + 1:L + 1]
            out_streams, logits = main.streams[:, L - 1], main.logits[0, L - 1]
            for i in range(len(drafts)):
                if i > 0:  # recursive position L'+i-1: own output at the previous position + previous draft
                    streams = torch.cat([streams, out_streams[:, None]], dim=1)
                    toks = torch.cat([toks, drafts[i - 1].view(1, 1)], dim=1)
                    out = mtp_forward(w, CFG, streams, toks, start=lo)
                    out_streams, logits = out.streams[:, -1], out.logits[0, -1]
                err = float((real[i] - logits).abs().max())
                stats["max_err"] = max(stats["max_err"], err)
                assert err < bound, (b, L, i, err)
                top2 = logits.topk(2).values
                if int(drafts[i]) != int(logits.argmax()):
                    assert float(top2[0] - top2[1]) < bound, (b, L, i)
                    stats["near_ties"] += 1
                stats["drafts"] += 1
    return stats


@pytest.mark.parametrize("k", [1, 3])
def test_every_draft_equals_the_oracle_under_forced_acceptance(model, k, tol):
    gen = Generator(model, spec_steps=k, **KW)
    log = StepLog(gen)
    force_acceptance(gen, cuts_all_patterns(k))
    gen.generate(PROMPTS, max_new_tokens=NEW)
    stats = check_drafts(model, log, PROMPTS, tol("mtp_drafter_vs_float64")["atol"])
    print(f"k={k}: {stats['drafts']} drafts, max |logit err| {stats['max_err']:.2e}, "
          f"near ties {stats['near_ties']}, accepted counts seen {sorted(stats['accepted'])}")
    assert stats["accepted"] == set(range(k + 1))  # zero, partial and full acceptance all happened
    assert stats["near_ties"] <= stats["drafts"] // 100
    assert max(int(s["after"].max()) for s in log.steps) > 2 * CFG.sliding_window + 40


def test_drafts_equal_the_oracle_in_plain_greedy_generation(model, tol):
    """Unforced: the random-weight drafter is (almost) always rejected, and every draft it
    makes is still the oracle's, while the tokens stay exactly greedy."""
    k = 2
    want = Generator(model, **KW).generate(PROMPTS, max_new_tokens=NEW)
    gen = Generator(model, spec_steps=k, **KW)
    log = StepLog(gen)
    assert gen.generate(PROMPTS, max_new_tokens=NEW) == want
    stats = check_drafts(model, log, PROMPTS, tol("mtp_drafter_vs_float64")["atol"])
    assert stats["drafts"] > 100 and stats["near_ties"] == 0
