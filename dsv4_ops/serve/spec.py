"""MTP speculative decoding in the engine (``Engine(spec_steps=k)``): what a slot keeps for
drafting, the prefill chunk that also fills the MTP block's window, and the speculative step
over slots ``0..B-1`` (``speculative.SpeculativeStep``'s verify / extend / draft, on the paged pool).

Per slot (serving_design.md §7.1, "MTP state"): the MTP block's window ring (ring mode for
``k + 2`` extend tokens: ``ring_sizes(cfg, k + 1)``), ``h_last`` (the main model's final streams
at ``length - 1``), the next token ``last_tok`` (position ``length``), the ``k`` drafts and the
distributions they were drawn from (``draft_probs``, read by speculative sampling). Each row of a
step advances by its own accepted count; ``slot_len`` is a row's only scalar, as in ``Generator``.

In prefill the MTP window runs one position behind the main model: a chunk at ``[s, s+n)``
gives the MTP block positions ``[s-1, s+n-1)``, pairing the main streams at ``t`` (``h_last`` for
``s-1``) with token ``t+1``, which the chunk itself holds. So the MTP entry at a page boundary's
``H-1`` is made by the chunk that starts at ``H``, from the request's own token ``H``: a prefix
snapshot at ``H`` (main + MTP rings, streams at ``H-1``) suits any request whose tokens below ``H``
match, whatever its token ``H`` is. A row's first chunk has no position ``-1`` and gives ``[0, n-1)``.

Snapshots are taken after the step that reaches a boundary ``H``; a speculative step may pass it,
so ``h_page`` keeps the streams at ``H-1`` of the last boundary each row reached (``page_streams``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import sampling
from ..model.attention import AttentionState
from ..model.plan import plan_step, ring_sizes
from ..sampling import SamplingParams
from ..speculative import SpecState, SpeculativeStep
from .pool import PagedKVPool, layer_pages
from .step import paged_streams, slot_rows

__all__ = ["SpecSlots", "page_streams"]


class SpecSlots(SpeculativeStep):
    """The drafting state of ``pool.slots`` slots and the engine's two speculative steps over it."""

    def __init__(self, model, pool: PagedKVPool, k: int, page_size: int) -> None:
        super().__init__(model, k)
        cfg, dev, S = model.config, model.device, pool.slots
        N, D = cfg.hc_mult, cfg.hidden_size
        self.pool, self.page_size = pool, page_size
        self.mtp_rings = ring_sizes(cfg, k + 1)
        self.mtp = layer_pages(model.mtp[0].self_attn, S, 1, page_size, pool.fp8, pool.dtype, dev, self.mtp_rings)
        self.last_tok = torch.zeros(S, dtype=torch.long, device=dev)
        self.drafts = torch.zeros(S, k, dtype=torch.long, device=dev)
        self.h_last = torch.zeros(S, N, D, dtype=model.dtype, device=dev)
        self.h_page = torch.zeros_like(self.h_last)
        self.draft_probs = torch.zeros(S, k, cfg.vocab_size, dtype=torch.float32, device=dev)
        for t in self.buffers():
            torch._dynamo.mark_static_address(t)

    def buffers(self) -> list[Tensor]:
        return [*self.mtp.rings.values(), self.last_tok, self.drafts, self.h_last, self.h_page, self.draft_probs]

    def snapshot_tensors(self, restore: bool) -> list[Tensor]:
        """What a prefix snapshot adds to the main rings: the MTP window ring and the streams at
        ``H-1``, saved from ``h_page`` and restored into ``h_last``."""
        return [*self.mtp.rings.values(), self.h_last if restore else self.h_page]

    # ------------------------------------------------------------------ host side (no syncs)
    def save(self, slot: int) -> tuple[Tensor, Tensor]:
        """A preempted decoding request's drafts and their distributions (device copies), so that
        it resumes drafting exactly where it stopped."""
        return self.drafts[slot].clone(), self.draft_probs[slot].clone()

    def resume(self, slot: int, last: int, saved: tuple[Tensor, Tensor] | None) -> None:
        """A resumed request's next token and drafts (the saved ones, else placeholders)."""
        self.last_tok[slot].fill_(last)  # fill_: a kernel; `t[i] = int` waits for the GPU (a host copy)
        if saved is None:
            self.drafts[slot].fill_(last)
            self.draft_probs[slot] = torch.nn.functional.one_hot(self.drafts[slot], self.draft_probs.shape[-1])
        else:
            self.drafts[slot].copy_(saved[0])
            self.draft_probs[slot].copy_(saved[1])

    # ------------------------------------------------------------------ the compiled steps
    @torch.no_grad()
    def prefill_chunk(self, ids: Tensor, rows: Tensor, n_new: Tensor, starts: Tensor, params: SamplingParams,
                      filtered: bool) -> tuple[Tensor, Tensor]:
        """``pool_step``'s prefill plus the MTP window one position behind, ``h_last`` / ``h_page``,
        and for rows with ``starts`` (a prompt ended: the token drawn here is the next one) the
        first, placeholder drafts."""
        model, pool, cfg = self.model, self.pool, self.model.config
        B, C = ids.shape
        lengths, table = slot_rows(pool, rows, B)
        X = paged_streams(model, pool, ids, rows, plan_step(cfg, lengths, n_new, C, pool.rings, C > 1), table)
        h = self.h_last[rows]
        first = lengths == 0
        mtp_x = torch.where(first[:, None, None, None], X, torch.cat([h[:, None], X[:, :-1]], dim=1))
        mtp_ids = torch.where(first[:, None], torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1), ids)
        n_mtp = torch.where(first, (n_new - 1).clamp(min=0), n_new)
        meta = plan_step(cfg, torch.where(first, lengths, lengths - 1), n_mtp, C, self.mtp_rings, C > 1)
        state = self.mtp.state(rows, B, table)
        model.mtp[0](mtp_x, model.model.embed_tokens(mtp_ids), meta, state, mtp_ids)
        self.mtp.write_back(state, rows)

        end = lengths + n_new
        picked = X[torch.arange(B, device=ids.device), (n_new.long() - 1).clamp(min=0)]
        self.h_last.index_copy_(0, rows, torch.where((n_new > 0)[:, None, None], picked, h))
        self.h_page.index_copy_(0, rows, page_streams(self.h_page[rows], X, lengths, end, self.page_size))
        pool.slot_len.index_add_(0, rows, n_new)
        logits = model.logits(picked[:, None])[:, 0]
        tokens = sampling.sample(logits, params, end.long(), filtered)
        self._start(rows, starts, tokens)
        return tokens, logits

    def _start(self, rows: Tensor, starts: Tensor, first: Tensor) -> None:
        """``speculative.start_drafts`` for the ``starts`` rows: ``first`` is the next token and
        the drafts are placeholders from a one-hot ``q`` (verify rejects them unless right)."""
        k, V = self.k, self.draft_probs.shape[-1]
        s = starts[:, None]
        self.last_tok.index_copy_(0, rows, torch.where(starts, first, self.last_tok[rows]))
        self.drafts.index_copy_(0, rows, torch.where(s, first[:, None].expand(-1, k), self.drafts[rows]))
        q = torch.nn.functional.one_hot(first, V).to(torch.float32)[:, None].expand(-1, k, -1)
        self.draft_probs.index_copy_(0, rows, torch.where(s[..., None], q, self.draft_probs[rows]))

    @torch.no_grad()
    def decode(self, active: Tensor, params: SamplingParams | None = None, filtered: bool = False
               ) -> tuple[Tensor, Tensor]:
        """One speculative step for slots ``0..B-1`` (``active [B] int32``: 1 = the slot decodes)
        -> ``(tokens [B, k+1]`` with ``-1`` after each row's emitted ones, ``counts [B])``.
        ``params=None``: every row is greedy (no distributions computed)."""
        B = active.shape[0]
        st = SpecState(self.pool.slot_len[:B], self.last_tok[:B], self.drafts[:B], self.h_last[:B], [],
                       AttentionState(**{k: t[:B] for k, t in self.mtp.rings.items()}), self.pool.rings,
                       self.mtp_rings, draft_probs=None if params is None else self.draft_probs[:B])
        return self.step(st, active, params, filtered)

    def _main_streams(self, st: SpecState, ids: Tensor, lengths: Tensor, n_new: Tensor, meta) -> Tensor:
        B = ids.shape[0]
        return paged_streams(self.model, self.pool, ids, None, meta, self.pool.block_table[:B])

    def _verified(self, st: SpecState, X: Tensor, L: Tensor, new_len: Tensor) -> None:
        B = X.shape[0]
        self.h_page[:B].copy_(page_streams(self.h_page[:B], X, L, new_len, self.page_size))


def page_streams(h_page: Tensor, X: Tensor, start: Tensor, end: Tensor, page_size: int) -> Tensor:
    """Per row, the streams at ``P - 1`` for the last page boundary ``P`` in ``(start, end]`` (what a
    snapshot at ``P`` restores as ``h_last``), or ``h_page`` where the row reached none. ``X [B, S,
    N, D]`` holds the streams of positions ``start..``."""
    P = end // page_size * page_size
    idx = (P - 1 - start).clamp(0, X.shape[1] - 1).long()
    picked = X[torch.arange(X.shape[0], device=X.device), idx]
    return torch.where((P > start)[:, None, None], picked, h_page)
