"""``dsv4::plan``: per-row lengths -> every metadata tensor the layers read (DESIGN.md rule 4)."""
from typing import NamedTuple

import torch
from torch import Tensor
from torch.library import wrap_triton

from ..lowering.triton import plan as pl
from ..lowering.triton.plan import plan_kernel
from ..reference import ops as ref
from . import validate as v
from ._backend import check, use_triton
from .direct import dsv4


@torch.library.triton_op("dsv4::plan", mutates_args=())
def _plan(
    lengths: Tensor, n_new: Tensor, num_tokens: int, steps: int, window: int, win_ring: int, win_concat: bool,
    csa_ratio: int, csa_ring: int, hca_ratio: int, hca_ring: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    # Also the fake: shape checks, then a static device branch (see _backend.py). CUDA/ROCm:
    # all nine tensors from one Triton launch.
    check(lengths.dim() == 1, lambda: f"plan: lengths must be [B], got {lengths.dim()}-d")
    check(n_new.dim() == 1, lambda: f"plan: n_new must be [B], got {n_new.dim()}-d")
    check(n_new.shape[0] == lengths.shape[0], lambda: "plan: n_new and lengths must have the same B")
    check(csa_ratio > 0 and hca_ratio > 0, lambda: "plan: ratios must be > 0")  # emit widths S/m
    args = (lengths, n_new, num_tokens, steps, window, win_ring, win_concat, csa_ratio, csa_ring, hca_ratio,
            hca_ring)
    if use_triton(lengths):
        out, spec = pl.plan_launch(*args)
        if spec is not None:
            wrap_triton(plan_kernel)[spec.grid](*spec.args, **spec.meta)
        return out
    return tuple(t.contiguous() for t in ref.plan(*args))


class Plan(NamedTuple):
    """Every tensor is ``int32`` with a leading ``[steps]`` dim; ``-1`` means none."""

    positions: Tensor  # [steps, B, S]    absolute position of each query, -1 = padding
    win_write: Tensor  # [steps, B, S]    window-ring slot each new kv goes to, -1 = skip
    win_idx: Tensor    # [steps, B, S, W] window entries each query attends, oldest first
    csa_len: Tensor    # [steps, B, S]    visible compressed entries (t+1)//m, 0 for padding
    csa_emit: Tensor   # [steps, B, ceil(S/m)] blocks the new tokens complete, -1 pad
    csa_write: Tensor  # [steps, B, S]    compressor-ring slot of each new token, -1 = skip
    hca_len: Tensor
    hca_emit: Tensor
    hca_write: Tensor

    def step(self, i: int) -> "Plan":
        """Sub-step ``i`` of a multi-step plan: the same fields without the ``[steps]`` dim."""
        return Plan(*(t[i] for t in self))


def plan(
    lengths: Tensor, n_new: Tensor, num_tokens: int, steps: int, window: int, win_ring: int, win_concat: bool,
    csa_ratio: int, csa_ring: int, hca_ratio: int, hca_ring: int,
) -> Plan:
    """Plan ``steps`` sub-steps of ``num_tokens`` padded query slots per row.

    Args:
        lengths: ``[B] int32`` tokens already cached per row (= first new position), ``>= 0``.
        n_new: ``[B] int32`` new tokens per row, ``0 <= n_new <= num_tokens`` (0 = padding row).
            Sub-step ``i`` covers positions ``[lengths + i*n_new, lengths + (i+1)*n_new)``.
        num_tokens: static ``S >= 0``, the padded query width.
        steps: ``>= 1`` sub-steps (1 for prefill/decode/verify; k for the MTP draft loop).
        window: ``W >= 1`` window entries per query, the query itself included.
        win_ring: window ring slots ``R``. ``win_concat=False`` (ring mode: ``win_idx`` are ring
            slots, read after writing the new kv) needs ``R >= W + S - 1``; ``win_concat=True``
            (``win_idx`` index ``cat(ring_before_write, new_kv)``: older positions at their ring
            slot, new position ``p`` at ``R + p - start``) needs ``R >= max(1, W - 1)``.
        csa_ratio / hca_ratio: compression rates ``m >= 1`` (CSA pools with overlap, HCA without).
        csa_ring / hca_ring: compressor-input ring slots, ``>= 2 * csa_ratio`` and ``>= hca_ratio``:
            enough for ``compress`` to re-read the open block (and, for CSA, the previous one)
            when it runs before this step's ring write. Speculative decoding that may reject
            drafts needs ``+ lookahead`` more slots (DESIGN.md rule 3).

    Returns a :class:`Plan`. Sentinels: ``-1`` for padding queries and skipped writes,
    ``win_idx`` entries at negative positions, unused emit slots; ``*_len`` is 0 for padding.
    A new token's ring write is skipped when a later token of the same step lands on the same
    slot, so slots of one row are always distinct.

    The raw op ``torch.ops.dsv4.plan`` checks shapes only; on every backend it counts negative
    ``lengths`` / ``n_new`` as 0. This wrapper rejects them (and every other bad value) instead.
    """
    v.once_per_signature(_check_arguments, lengths, n_new, num_tokens, steps, window, win_ring, win_concat,
                         csa_ratio, csa_ring, hca_ratio, hca_ring)
    if v.checks_op_values(lengths, n_new):
        op = "plan"
        last = lengths.long() + steps * n_new.long()
        v.run_value_checks(v.in_range_check(op, "n_new", n_new, 0, num_tokens, f"num_tokens={num_tokens}"),
                           v.in_range_check(op, "lengths", lengths, 0, 2**31 - 1, "int32"),
                           v.in_range_check(op, "lengths + steps * n_new", last, 0, 2**31 - 1,
                                            "the int32 position range"))
    return Plan(*dsv4.plan(lengths, n_new, num_tokens, steps, window, win_ring, win_concat,
                           csa_ratio, csa_ring, hca_ratio, hca_ring))


def _check_arguments(
    lengths: Tensor, n_new: Tensor, num_tokens: int, steps: int, window: int, win_ring: int, win_concat: bool,
    csa_ratio: int, csa_ring: int, hca_ratio: int, hca_ring: int,
) -> None:
    """The metadata checks of :func:`plan` (ranks, dtypes, devices, the static sizes)."""
    op = "plan"
    v.rank(op, "lengths", lengths, "[B]")
    v.rank(op, "n_new", n_new, "[B]")
    v.dtype(op, "lengths", lengths, torch.int32)
    v.dtype(op, "n_new", n_new, torch.int32)
    v.dim(op, "n_new", n_new, 0, lengths.shape[0], "B of lengths")
    v.same_device(op, lengths=lengths, n_new=n_new)
    v.at_least(op, "num_tokens", num_tokens, 0)
    v.at_least(op, "steps", steps, 1)
    v.at_least(op, "window", window, 1)
    v.at_least(op, "csa_ratio", csa_ratio, 1)
    v.at_least(op, "hca_ratio", hca_ratio, 1)
    if win_concat:
        v.at_least(op, "win_ring", win_ring, max(1, window - 1), f"(concat mode: window - 1 = {window - 1})")
    else:
        v.at_least(op, "win_ring", win_ring, window + num_tokens - 1,
                   f"(ring mode: window + num_tokens - 1 = {window} + {num_tokens} - 1)")
    v.at_least(op, "csa_ring", csa_ring, 2 * csa_ratio, f"(2 * csa_ratio = 2 * {csa_ratio})")
    v.at_least(op, "hca_ring", hca_ring, hca_ratio, f"(hca_ratio = {hca_ratio})")
