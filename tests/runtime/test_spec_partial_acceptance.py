"""Rows that accept none, some and all drafts in the same step leave exactly the caches of
plain decoding: after EVERY one of >= 100 speculative steps, each row's window ring,
compressor-input rings, compressed pool and indexer keys at its valid positions (positions
below its length; for rings the last ``ring`` of them) equal those of a plain greedy
``Generator(spec_steps=0)`` run on a copy of the model. The MTP block's window ring holds, at
every step, the oracle's entries for (main streams at t, token t+1) at the last W positions.
"""
from __future__ import annotations

import copy

import pytest
import torch

from dsv4_ops import DSV4Config, Generator
from dsv4_ops.reference.mtp_oracle import mtp_forward, mtp_weights
from dsv4_ops.streams import main_streams
from model_util import random_model
from spec_capture import StepLog, force_acceptance, teacher_forced

CFG = DSV4Config.tiny(num_hidden_layers=3, hca_ratio=8)  # sliding, CSA (m=4), HCA (m=8); window 16
PROMPTS = [[3, 1, 4, 1, 5], list(range(40)), [7] * 17, [9, 2, 6]]
K = 3
KW = dict(max_batch_size=4, max_seq_len=192, compile=False, prefill_chunk=16)
RINGS = ("window", "kv_ring", "gate_ring", "idx_kv_ring", "idx_gate_ring")
POOLS = ("pool", "idx_pool")


def cut(step: int, row: int) -> int:
    """Accepted drafts per (step, row): row 0 none, row 1 all, rows 2-3 every count, out of phase."""
    return {0: 0, 1: K}.get(row, (step * (row - 1)) % (K + 1))


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=1)


def plain_truth(model, prompts, seqs, upto):
    """Per main layer and cache tensor, the value plain decoding wrote for each position
    (rings: [B, upto, C], recorded right after the position was written) and its final pools."""
    truth = {}

    def record(gen, n):
        for li, st in enumerate(gen.model.cache_states(len(prompts))):
            for name in RINGS:
                t = getattr(st, name)
                if t is None:
                    continue
                R = t.shape[1]
                buf = truth.setdefault((li, name), torch.full((len(prompts), upto + K + 50, t.shape[2]), float("nan")))
                for b in range(len(prompts)):
                    L = int(gen.lengths[b])
                    ps = torch.arange(max(0, L - R), L)
                    buf[b, ps] = t[b, ps % R]
            for name in POOLS:
                if getattr(st, name) is not None:
                    truth[(li, name)] = getattr(st, name).clone()

    teacher_forced(copy.deepcopy(model), prompts, seqs, upto, KW["max_seq_len"], record)
    return truth


def compare_main_caches(model, truth, lengths, bound):
    cfg, n = model.config, 0
    for li, st in enumerate(model.cache_states(len(lengths))):
        csa = st.idx_pool is not None  # CSA layers have indexer keys; HCA ones only a pool
        ratio = cfg.csa_ratio if csa else cfg.hca_ratio
        for name in RINGS:
            t = getattr(st, name)
            if t is None:
                continue
            R = t.shape[1]
            # rows a query may still read: the window; a CSA block's 2m overlapping inputs; an HCA block's m
            keep = cfg.sliding_window if name == "window" else (2 * ratio if csa else ratio)
            for b, L in enumerate(lengths):
                ps = torch.arange(max(0, L - keep), L)
                torch.testing.assert_close(t[b, ps % R], truth[(li, name)][b, ps], **bound,
                                           msg=lambda s: f"layer {li} {name} row {b} length {L}: {s}")
                n += len(ps)
        for name in POOLS:
            t = getattr(st, name)
            if t is None:
                continue
            for b, L in enumerate(lengths):
                torch.testing.assert_close(t[b, : L // ratio], truth[(li, name)][b, : L // ratio], **bound)
                n += L // ratio
    return n


def test_mixed_acceptance_leaves_plain_decoding_caches(model, tol):
    gen = Generator(model, spec_steps=K, _draft="oracle", **KW)
    inner = gen.spec._oracle_drafts
    step = [0]

    def drafts(st, new_len, active, bonus):  # greedy drafts, made wrong from each row's cut on
        d = inner(st, new_len, active, bonus)
        c = torch.tensor([cut(step[0], b) for b in range(d.shape[0])])
        step[0] += 1
        return torch.where(torch.arange(K)[None] >= c[:, None], (d + 1) % CFG.vocab_size, d)

    gen.spec._oracle_drafts = drafts
    snaps = []
    log = StepLog(gen, after_step=lambda lg, rec: snaps.append(
        ([int(x) for x in rec["after"]], [[t.clone() for t in s.tensors().values()] for s in model.cache_states(4)])))
    want = Generator(copy.deepcopy(model), **KW).generate(PROMPTS, max_new_tokens=101)
    assert gen.generate(PROMPTS, max_new_tokens=101) == want
    assert len(log.steps) >= 100
    seen = {(int(c) - 1) for rec in log.steps[1:] for c, a in zip(rec["counts"], rec["active"]) if a}
    assert seen == set(range(K + 1))
    mixed = [rec for rec in log.steps[1:] if rec["active"].all() and len({int(c) for c in rec["counts"]}) >= 3]
    assert len(mixed) > 10  # steps where rows accepted 0, some and all at once

    seqs = log.sequences(PROMPTS)
    truth = plain_truth(model, PROMPTS, seqs, max(len(s) for s in seqs))
    checked = 0
    for lengths, states in snaps:
        for st, tensors in zip(model.cache_states(4), states):
            for (name, live), saved in zip(st.tensors().items(), tensors):
                live.copy_(saved)  # put the cache back as it was after that step
        checked += compare_main_caches(model, truth, lengths, tol("speculative_cache_entries"))
    print(f"{len(log.steps)} steps, {checked} cache entries compared")


@torch.no_grad()
def test_mtp_ring_holds_the_oracle_entries_under_mixed_acceptance(model, tol):
    gen = Generator(model, spec_steps=K, **KW)
    force_acceptance(gen, cut)
    snaps = []
    log = StepLog(gen, after_step=lambda lg, rec: snaps.append(
        ([int(x) for x in rec["after"]], model.mtp_cache_state(4).window.clone())))
    gen.generate(PROMPTS, max_new_tokens=60)
    w, W = mtp_weights(model), CFG.sliding_window
    checked = 0
    for b, seq in enumerate(log.sequences(PROMPTS)):
        ids = torch.tensor([seq])
        kv = mtp_forward(w, CFG, main_streams(model, ids).double()[:, :-1], ids[:, 1:]).kv[0]  # [T-1, Dh]
        for lengths, ring in snaps:
            L, R = lengths[b], ring.shape[1]
            ps = torch.arange(max(0, L - W), L)  # position L-1 pairs the streams at L-1 with the token at L
            torch.testing.assert_close(ring[b, ps % R].double(), kv[ps], **tol("speculative_cache_entries"))
            checked += len(ps)
    assert checked > 1000
