"""Multi-step MTP speculative decoding as ONE tensor program per step (no host syncs, no
data-dependent shapes), so it compiles with ``fullgraph=True`` and replays as one CUDA graph.

Per request the state is its length ``L`` (tokens the main model has processed), the next
token ``last`` (position ``L``, known but not yet processed), the main model's final streams
at position ``L-1`` (``h_last``) and ``k`` drafts for positions ``L+1 .. L+k``. One step:

1. verify  — the main model runs ``[last, d_1..d_k]`` at positions ``L..L+k``; greedy tokens
   ``g_0..g_k``; ``a`` = length of the prefix with ``d_{j+1} == g_j``; the step emits
   ``d_1..d_a, g_a`` (``a + 1`` tokens) and the new length is ``L' = L + a + 1``.
2. extend  — the MTP block runs positions ``L-1 .. L+a`` (``a + 2`` tokens): at position ``t``
   it pairs the main streams at ``t`` with the token at ``t+1``, so its window cache holds
   entries made from the main model's states; its output at ``L+a`` drafts ``d'_1`` (``L'+1``).
3. draft   — ``k-1`` more MTP steps at positions ``L'.. L'+k-2``, each feeding its own output
   streams and the previous draft, drafting ``d'_2 .. d'_k``.

Rejection needs no rollback (DESIGN.md rule 3): everything is addressed by absolute position
and ``L`` only advances by the accepted count; slots written for rejected positions are
rewritten before any query can see them. The ``k-1`` draft steps take their metadata from ONE
``plan`` call with ``steps=k-1`` and the loop runs exactly ``len(plans)`` times — the number of
planned and executed steps is one constant (the off-by-one class of bugs in
dsv4_serving_engines.md §5.2 cannot happen). Extend and verify have their own plan calls.

Sampling (``params`` given: temperature, top-k, top-p, seed per row) is speculative SAMPLING,
which keeps the target distribution exactly: the MTP block samples each draft ``d_j`` from its
own filtered distribution ``q_j`` (kept in ``draft_probs``); verify computes the main model's
``p_j`` and accepts draft ``j`` while ``u_j * q_j(d_j) < p_j(d_j)`` (probability
``min(1, p/q)``); at the first rejection it draws from ``normalize(max(0, p - q))``, and after k
acceptances the bonus token from ``p_k``. Greedy rows use one-hot ``p`` and ``q``, which makes
the rule the greedy one. All randomness is ``sampling.hash_uniform`` of (seed, position, token).

``draft="oracle"`` (tests only) drafts with the main model itself (k greedy decode steps), so
drafts always equal the main model's greedy tokens (full acceptance); ``wrong_rows`` then turns
a row's drafts into ``(g + 1) % vocab`` (zero acceptance).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from . import sampling
from .model.attention import AttentionState
from .model.plan import RingSizes, plan_step, plan_steps
from .sampling import SamplingParams


@dataclasses.dataclass
class SpecState:
    """Everything a speculative step reads and writes, for ``Bk`` rows: the lengths, the next
    token (position ``L``), the drafts, the main model's streams at ``L-1``, the KV pool of the
    main layers and of the MTP block. The generator passes views of its buffers; an exported
    program passes its inputs (whole tensors)."""

    lengths: Tensor  # [Bk] int32
    last_tok: Tensor  # [Bk] int64
    drafts: Tensor  # [Bk, k] int64
    h_last: Tensor  # [Bk, N, D]
    states: list[AttentionState]
    mtp_state: AttentionState | None
    rings: RingSizes
    mtp_rings: RingSizes
    wrong_rows: Tensor | None = None  # oracle drafting (tests): rows whose drafts are made wrong
    draft_probs: Tensor | None = None  # [Bk, k, V] fp32: the distribution each draft was sampled from


class SpeculativeStep:
    """The speculative prefill chunk and step as functions of a :class:`SpecState` (no state of
    their own), so the generator compiles them over its buffers and ``dsv4_ops.export`` exports
    them over program inputs."""

    def __init__(self, model, k: int, draft: str = "mtp") -> None:
        if draft not in ("mtp", "oracle"):
            raise ValueError(f"draft must be 'mtp' or 'oracle' (tests), got {draft!r}")
        if draft == "mtp" and len(model.mtp) == 0:
            raise ValueError("spec_steps > 0 needs the model's MTP block (config.num_nextn_predict_layers >= 1)")
        self.model, self.k, self.draft = model, k, draft
        self.record: list | None = None  # eager-mode metadata log for tests (None = off)

    # ------------------------------------------------------------------ prefill
    def prefill(self, st: SpecState, ids: Tensor, next_ids: Tensor, n_new: Tensor, n_mtp: Tensor) -> Tensor:
        """One prefill chunk for the main model AND the MTP window.

        ids ``[Bk, C]`` at positions ``lengths..``; ``next_ids [Bk, C]`` the token after each
        one; ``n_mtp`` = how many of them have a known next token (not the prompt's last)."""
        model = self.model
        Bk, C = ids.shape
        lengths = st.lengths
        streams = model.hidden_streams(ids, lengths, n_new, model.plan(lengths, n_new, C, rings=st.rings),
                                       st.states)  # [Bk, C, N, D]
        if self.draft == "mtp":
            meta = plan_step(model.config, lengths, n_mtp, C, st.mtp_rings)
            model.mtp[0](streams, model.model.embed_tokens(next_ids), meta, st.mtp_state, next_ids)
        last = (n_new.long() - 1).clamp(min=0)
        picked = streams[torch.arange(Bk, device=ids.device), last]  # [Bk, N, D]
        st.h_last.copy_(torch.where((n_new > 0)[:, None, None], picked, st.h_last))
        lengths.add_(n_new)
        return model.logits(picked[:, None])[:, 0]

    # ------------------------------------------------------------------ the step
    def step(self, st: SpecState, active: Tensor, params: SamplingParams | None = None,
             filtered: bool = False) -> tuple[Tensor, Tensor]:
        """active ``[Bk] int32`` (1 = this row generates) -> (tokens ``[Bk, k+1]`` with ``-1``
        after each row's emitted ones, counts ``[Bk]``). ``params`` (None = greedy) samples;
        ``filtered`` (static) applies their top-k / top-p."""
        model, k = self.model, self.k
        Bk = active.shape[0]
        L, last, drafts, h_last = st.lengths, st.last_tok, st.drafts, st.h_last
        rows = torch.arange(Bk, device=active.device)

        # 1. verify [last, d_1..d_k] at positions L..L+k
        ids = torch.cat([last[:, None], drafts], dim=1)  # [Bk, k+1]
        n_verify = active * (k + 1)
        X = self._main_streams(st, ids, L, n_verify, model.plan(L, n_verify, k + 1, rings=st.rings))  # [Bk, k+1, N, D]
        if params is None:
            g = model.logits(X).argmax(-1)  # [Bk, k+1]
            a = (drafts == g[:, :k]).to(torch.int32).cumprod(dim=1).sum(dim=1).to(torch.int32)  # accepted drafts
            bonus = g[rows, a]
        else:
            a, bonus = accept_drafts(model.logits(X), drafts, st.draft_probs, L, params, filtered)
        j = torch.arange(k + 1, device=active.device)
        padded = torch.cat([drafts, drafts[:, :1]], dim=1)
        tokens = torch.where(j < a[:, None], padded, torch.where(j == a[:, None], bonus[:, None], -1))
        count = active * (a + 1)
        tokens = torch.where(active[:, None] > 0, tokens, -1)
        new_len = L + count
        self._verified(st, X, L, new_len)

        # 2.+3. the next drafts (and, sampling, the distributions they were drawn from)
        if self.draft == "mtp":
            new_drafts, new_q = self._mtp_drafts(st, new_len, active, a, bonus, X, params, filtered)
        else:
            new_drafts = self._oracle_drafts(st, new_len, active, bonus)  # deterministic: one-hot q
            new_q = None if params is None else torch.nn.functional.one_hot(new_drafts, st.draft_probs.shape[-1])

        # commit (inactive rows keep everything)
        act = active > 0
        h_last.copy_(torch.where(act[:, None, None], X[rows, a], h_last))
        last.copy_(torch.where(act, bonus, last))
        drafts.copy_(torch.where(act[:, None], new_drafts, drafts))
        if new_q is not None:
            st.draft_probs.copy_(torch.where(act[:, None, None], new_q, st.draft_probs))
        L.copy_(new_len)
        return tokens, count

    def _main_streams(self, st: SpecState, ids: Tensor, lengths: Tensor, n_new: Tensor, meta) -> Tensor:
        """The main model's final streams of a cached step over ``st``'s pool (the serving engine
        runs its paged pool instead)."""
        return self.model.hidden_streams(ids, lengths, n_new, meta, st.states)

    def _verified(self, st: SpecState, X: Tensor, L: Tensor, new_len: Tensor) -> None:
        """After verify: ``X`` holds the main streams at ``L..L+k`` and rows advance to ``new_len``
        (a hook for state kept beyond ``SpecState``; nothing here)."""

    def _mtp_drafts(self, st: SpecState, new_len, active, a, bonus, X, params=None, filtered=False):
        model, k, blk = self.model, self.k, self.model.mtp[0]
        cfg, Bk = model.config, active.shape[0]
        L, last, drafts, h_last = st.lengths, st.last_tok, st.drafts, st.h_last
        rows = torch.arange(Bk, device=active.device)

        def pick(y, pos):  # draft token at position `pos` from MTP output streams y [Bk, 1, N, D]
            logits = model.lm_head(blk.hidden(y)).float()[:, 0]
            if params is None:
                return logits.argmax(-1), None
            return sampling.sample_with_probs(logits, params, pos.long(), filtered, sampling.STREAM_DRAFT)

        # extend: positions L-1 .. L+a; streams at t, token at t+1
        streams = torch.cat([h_last[:, None], X], dim=1)  # [Bk, k+2, N, D]
        toks = torch.cat([last[:, None], drafts, torch.zeros_like(last)[:, None]], dim=1)
        toks = toks.scatter(1, (a + 1)[:, None].long(), bonus[:, None])
        n_ext = active * (a + 2)
        start = L - 1
        meta = plan_step(cfg, start, n_ext, k + 2, st.mtp_rings, concat=False)
        self._log("extend", meta, n_ext)
        Y = blk(streams, model.model.embed_tokens(toks), meta, st.mtp_state, toks)
        y = Y[rows, a + 1][:, None]  # output at position L+a: drafts position L'+1
        d, q = pick(y, new_len + 1)
        out, qs = [d], [q]
        if k > 1:
            plans = plan_steps(cfg, new_len, active, 1, st.mtp_rings, steps=k - 1, concat=False)
            for i, meta in enumerate(plans):  # draft i+2 at position L' + i + 2: exactly len(plans) == k-1 steps
                self._log("draft", meta, active)
                y = blk(y, model.model.embed_tokens(d[:, None]), meta, st.mtp_state, d[:, None])
                d, q = pick(y, new_len + i + 2)
                out.append(d)
                qs.append(q)
        return torch.stack(out, dim=1), (None if params is None else torch.stack(qs, dim=1))

    def _oracle_drafts(self, st: SpecState, new_len, active, bonus) -> Tensor:
        model, k = self.model, self.k
        plans = plan_steps(model.config, new_len, active, 1, st.rings, steps=k, concat=False)
        d, out = bonus, []
        for meta in plans:  # greedy main-model decode from position L'
            self._log("draft", meta, active)
            d = model.logits(model.hidden_streams(d[:, None], meta.start, active, meta, st.states))[:, 0].argmax(-1)
            out.append(d)
        drafts = torch.stack(out, dim=1)
        return torch.where(st.wrong_rows[:, None], (drafts + 1) % model.config.vocab_size, drafts)

    def _log(self, kind: str, meta, n_new: Tensor) -> None:
        if self.record is not None and not torch.compiler.is_compiling():
            p = meta.plan
            self.record.append((kind, meta.start.clone(), n_new.clone(), p.positions.clone(), p.win_write.clone(),
                                p.win_idx.clone()))


class SpecDecoding(SpeculativeStep):
    """The speculative state of a ``Generator`` with ``spec_steps=k``: its buffers (next token,
    drafts, streams at ``L-1``) and the model's pool, viewed per batch bucket."""

    def __init__(self, gen, k: int, draft: str = "mtp") -> None:
        super().__init__(gen.model, k, draft)
        model = self.model
        self.gen = gen
        B, dev = gen.max_batch_size, gen.device
        N, D = model.config.hc_mult, model.config.hidden_size
        self.last_tok = torch.zeros(B, dtype=torch.long, device=dev)
        self.drafts = torch.zeros(B, k, dtype=torch.long, device=dev)
        self.h_last = torch.zeros(B, N, D, dtype=model.dtype, device=dev)
        self.wrong_rows = torch.zeros(B, dtype=torch.bool, device=dev)  # oracle drafting only
        self.draft_probs: Tensor | None = None  # allocated by the first sampled generate
        for t in (self.last_tok, self.drafts, self.h_last, self.wrong_rows):
            torch._dynamo.mark_static_address(t)

    def state(self, Bk: int) -> SpecState:
        model = self.model
        cc = model.cache_config
        return SpecState(self.gen._lengths[Bk], self.last_tok[:Bk], self.drafts[:Bk], self.h_last[:Bk],
                         model.cache_states(Bk), model.mtp_cache_state(Bk) if cc.mtp else None, cc.rings,
                         cc.mtp_rings, self.wrong_rows[:Bk])

    def prefill_step(self, ids: Tensor, next_ids: Tensor, n_new: Tensor, n_mtp: Tensor) -> Tensor:
        return self.prefill(self.state(ids.shape[0]), ids, next_ids, n_new, n_mtp)

    def spec_step(self, active: Tensor, params: SamplingParams | None = None,
                  filtered: bool = False) -> tuple[Tensor, Tensor]:
        st = self.state(active.shape[0])
        if params is not None:
            st.draft_probs = self.draft_probs[: active.shape[0]]
        return self.step(st, active, params, filtered)

    def start(self, first: Tensor, sampling: bool = False) -> None:
        """After prefill: ``first [B]`` (the token after each prompt) is the next token; the first
        drafts are placeholders, which verify simply rejects unless they happen to be right.
        Sampling, a placeholder is a draft from a one-hot ``q``, which the rejection rule handles
        exactly (accepted with probability ``p(d)``, else a draw from ``p`` without ``d``)."""
        start_drafts(self.last_tok, self.drafts, first)
        if sampling:
            if self.draft_probs is None:  # only sampling needs the drafts' distributions: [B, k, V]
                B, V = self.last_tok.shape[0], self.model.config.vocab_size
                self.draft_probs = torch.zeros(B, self.k, V, dtype=torch.float32, device=first.device)
                torch._dynamo.mark_static_address(self.draft_probs)
            B = first.shape[0]
            self.draft_probs[:B].copy_(torch.nn.functional.one_hot(self.drafts[:B], self.draft_probs.shape[-1]))


def start_drafts(last_tok: Tensor, drafts: Tensor, first: Tensor) -> None:
    """The state after prefill: ``first`` is each row's next token; the drafts are placeholders."""
    B = first.shape[0]
    last_tok[:B].copy_(first)
    drafts[:B].copy_(first[:, None].expand(B, drafts.shape[1]))


def accept_drafts(logits: Tensor, drafts: Tensor, draft_probs: Tensor, L: Tensor, params: SamplingParams,
                  filtered: bool) -> tuple[Tensor, Tensor]:
    """The rejection-sampling rule of speculative sampling, for verify logits ``[Bk, k+1, V]`` at
    positions ``L..L+k`` (index ``j`` predicts position ``L+j+1``), drafts ``d [Bk, k]`` for
    positions ``L+1..L+k`` drawn from ``draft_probs q [Bk, k, V]``. Returns (accepted count
    ``a [Bk] int32``, the token at position ``L+a+1``): draft ``j`` is accepted with probability
    ``min(1, p_j(d_j) / q_j(d_j))`` while all before it were; the next token comes from
    ``normalize(max(0, p_a - q_a))`` after a rejection, from ``p_k`` after k acceptances."""
    Bk, k1, V = logits.shape
    k = k1 - 1
    p = sampling.probs(logits.reshape(Bk * k1, V), params.repeat_rows(k1), filtered).view(Bk, k1, V)
    pos = L.long()[:, None] + torch.arange(1, k1, device=L.device)  # draft j's position
    p_d = p[:, :k].gather(-1, drafts[..., None])[..., 0]
    q_d = draft_probs.gather(-1, drafts[..., None])[..., 0]
    u = sampling.hash_uniform(params.seed[:, None], pos, drafts, sampling.STREAM_ACCEPT)
    ok = u * q_d < p_d  # u < p / q without dividing by q
    a = ok.to(torch.int32).cumprod(dim=1).sum(dim=1).to(torch.int32)
    rows = torch.arange(Bk, device=L.device)
    q_next = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)[rows, a]  # 0 after k accepts
    p_next = p[rows, a]
    residual = (p_next - q_next).clamp(min=0)
    # all-zero only when p == q up to rounding, where a rejection has probability ~0: fall back to p
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)
    token = sampling.draw_from_probs(residual, params.seed, L.long() + a + 1, sampling.STREAM_RESIDUAL)
    return a, token
