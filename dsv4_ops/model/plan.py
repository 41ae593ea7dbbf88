"""Step metadata for the model: ring sizes and the one ``plan`` call per step (DESIGN.md rule 4).

``ops.plan`` returns a :class:`~dsv4_ops.ops.Plan` with a leading ``[steps]`` dim; a layer reads
one sub-step of it (``Plan.step(i)``, the same type without that dim) together with the
sub-step's first position and the window addressing mode, bundled as :class:`StepMeta`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..config import DSV4Config
from ..ops import Plan  # importing the ops package registers torch.ops.dsv4.*
from ..ops.direct import dsv4

__all__ = ["RingSizes", "ring_sizes", "StepMeta", "plan_steps", "plan_step"]


class RingSizes(NamedTuple):
    window: int  # window-ring slots
    csa: int  # compressor-input ring slots at the CSA rate
    hca: int  # ... at the HCA rate


def ring_sizes(cfg: DSV4Config, lookahead: int = 0) -> RingSizes:
    """Smallest rings that serve steps of up to ``1 + lookahead`` tokens in ring mode.

    Window: ring mode needs ``W + S - 1`` slots. Compressor inputs: the first block a step
    can close starts up to ``2m - 1`` (CSA, overlapping) or ``m - 1`` (HCA) positions
    before the step, so ``2m`` / ``m`` slots hold every old row an emit reads; the
    lookahead term leaves room for speculative tokens that may be rejected.
    """
    return RingSizes(window=cfg.sliding_window + lookahead, csa=2 * cfg.csa_ratio + lookahead,
                     hca=cfg.hca_ratio + lookahead)


class StepMeta(NamedTuple):
    """What every layer reads for one step: the plan (no ``steps`` dim), the first new position
    of each row, how ``plan.win_idx`` addresses the window (True: ``cat(ring, new_kv)``), and
    which of the step's tokens are real (each row's first ``n_new``; the rest pad the bucket)."""

    plan: Plan
    start: Tensor  # [B] int32
    concat: bool
    real: Tensor  # [B, S] bool


def plan_steps(cfg: DSV4Config, lengths: Tensor, n_new: Tensor, num_tokens: int, rings: RingSizes,
               steps: int = 1, concat: bool | None = None) -> list[StepMeta]:
    """ONE ``plan`` call for ``steps`` consecutive sub-steps (sub-step ``i`` starts at
    ``lengths + i * n_new``), split into one :class:`StepMeta` per sub-step. ``concat=None``:
    concat mode iff ``num_tokens > 1``. Calls the raw op: its inputs come from the model's own
    boundary, which has checked them."""
    if concat is None:
        concat = num_tokens > 1
    if not concat and rings.window < cfg.sliding_window + num_tokens - 1:
        raise ValueError(f"ring mode with {num_tokens} tokens needs a window ring of >= "
                         f"{cfg.sliding_window + num_tokens - 1} slots, have {rings.window}")
    lengths, n_new = lengths.to(torch.int32), n_new.to(torch.int32)
    plan = Plan(*dsv4.plan(lengths, n_new, num_tokens, steps, cfg.sliding_window, rings.window, concat,
                           cfg.csa_ratio, rings.csa, cfg.hca_ratio, rings.hca))
    real = torch.arange(num_tokens, device=n_new.device) < n_new.unsqueeze(1)  # once a step, read by every MoE
    return [StepMeta(plan.step(i), lengths + i * n_new, concat, real) for i in range(steps)]


def plan_step(cfg: DSV4Config, lengths: Tensor, n_new: Tensor, num_tokens: int, rings: RingSizes,
              concat: bool | None = None) -> StepMeta:
    """Plan one step for every layer (``plan_steps`` with ``steps=1``)."""
    return plan_steps(cfg, lengths, n_new, num_tokens, rings, 1, concat)[0]

