"""Test helpers that watch a speculative ``Generator`` step by step (eager, ``compile=False``).

``StepLog`` wraps the generator's ``_spec_step`` and records, per step, what the step saw and
left behind: which rows were active, the lengths before and after, the emitted tokens, the
token at the new length (``last_tok``) and the drafts for the positions after it; the
MTP drafter's normed hidden states (one per draft, hooked on ``mtp.0.norm``) give its logits.

``force_acceptance`` makes verify accept a chosen number of drafts per row and step (it adds
a large bonus to the draft tokens in the main model's verify logits) — the drafts themselves,
the MTP cache and everything the step writes stay real, so acceptance patterns 0, partial
and full can be produced on purpose with a random-weight drafter. The emitted tokens are then
no longer greedy: compare caches against a run fed the same tokens (``teacher_forced``).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


class StepLog:
    def __init__(self, gen, after_step: Callable | None = None) -> None:
        self.gen, self.after_step = gen, after_step
        self.steps: list[dict] = []
        self.first: Tensor | None = None  # the token after each prompt (greedy of the prefill)
        self._hidden: list[Tensor] = []
        self._inner = gen._spec_step
        gen._spec_step = self._step
        if gen.spec.draft == "mtp":
            gen.model.mtp[0].norm.register_forward_hook(lambda mod, args, out: self._hidden.append(out.detach()))

    def _step(self, active: Tensor, *sampling):
        spec, gen = self.gen.spec, self.gen
        Bk = active.shape[0]
        if self.first is None:
            self.first = spec.last_tok[:Bk].clone()
        before = gen.lengths[:Bk].clone()
        self._hidden.clear()
        tokens, counts = self._inner(active, *sampling)
        rec = dict(active=active.clone().bool(), before=before, after=gen.lengths[:Bk].clone(), tokens=tokens.clone(),
                   counts=counts.clone(), last_tok=spec.last_tok[:Bk].clone(), drafts=spec.drafts[:Bk].clone())
        if self._hidden:  # one [Bk, 1, D] hidden state per draft (inference tensors of an eager step: no autograd)
            with torch.no_grad():
                rec["draft_logits"] = torch.stack([gen.model.lm_head(h).float()[:, 0] for h in self._hidden], dim=1)
        self.steps.append(rec)
        if self.after_step is not None:
            self.after_step(self, rec)
        return tokens, counts

    def sequences(self, prompts) -> list[list[int]]:
        """Per row: prompt + every token the steps emitted (also past max_new_tokens), so that
        ``seq[L]`` is the token at position ``L`` for every length the run reached."""
        out = [list(p) + [int(self.first[b])] for b, p in enumerate(prompts)]
        for rec in self.steps:
            for b in range(len(prompts)):
                out[b] += rec["tokens"][b, : int(rec["counts"][b])].tolist()
        return out


def force_acceptance(gen, cuts: Callable[[int, int], int]) -> list[int]:
    """From now on verify accepts ``cuts(step, row)`` drafts of each row (at least; more if the
    main model's own greedy token happens to equal a later draft). Returns the step counter."""
    model, k, step = gen.model, gen.spec_steps, [0]
    real = type(model).logits.__get__(model)

    def logits(streams: Tensor) -> Tensor:
        out = real(streams)
        if streams.dim() == 4 and streams.shape[1] == k + 1:  # the verify of a speculative step
            Bk = streams.shape[0]
            cut = torch.tensor([cuts(step[0], b) for b in range(Bk)])
            take = torch.arange(k)[None] < cut[:, None]  # [Bk, k]: verify position j accepts draft j+1
            rows, cols = torch.nonzero(take, as_tuple=True)
            out = out.clone()
            out[rows, cols, gen.spec.drafts[rows, cols]] += 1e4
            step[0] += 1
        return out

    model.logits = logits
    return step


def teacher_forced(model_copy, prompts, sequences, upto: int, max_seq_len: int, record: Callable) -> None:
    """Run ``Generator(model_copy, spec_steps=0)`` over ``sequences`` (prompt first, then one
    decode step per token, every row fed its own next token until ``upto`` positions), calling
    ``record(gen, n)`` after the prefill (n = None) and after each decode step (n = step index)."""
    from dsv4_ops import Generator

    gen = Generator(model_copy, max_batch_size=len(prompts), max_seq_len=max_seq_len, compile=False,
                    prefill_chunk=16)
    gen.prefill(prompts)
    record(gen, None)
    P = [len(p) for p in prompts]
    for n in range(upto - min(P)):
        nxt = [s[p + n] if p + n < len(s) else 0 for s, p in zip(sequences, P)]
        gen.decode(torch.tensor(nxt))
        record(gen, n)
