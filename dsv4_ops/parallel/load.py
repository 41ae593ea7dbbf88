"""Loading a checkpoint as tensor/expert-parallel shards: every rank reads only its slice, and a
rank that fails makes every rank fail with the same clear error instead of leaving the others
blocked in their first collective.

Each rank streams the checkpoint through the ordinary loader (``checkpoint.load_checkpoint``), which skips
the routed experts other ranks hold and slices the sharded tensors as they are read: a rank
never holds a full copy of a sharded tensor beyond the one being decoded. The ranks then agree:
one ``all_gather_object`` of each rank's error (or ``None``). A rank that died or hangs before
that point is caught by the process group's timeout (``init_process_group(timeout=...)``;
``init_distributed`` sets one).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..checkpoint import load_checkpoint
from .layout import TensorParallel
from .shard import shard_with

__all__ = ["load_pretrained", "ShardLoadError", "raise_if_any_rank_failed"]


class ShardLoadError(RuntimeError):
    """One or more ranks could not load their shard; raised on every rank of the group."""


def raise_if_any_rank_failed(group, error: BaseException | None, what: str) -> None:
    """Collective: every rank of ``group`` passes its own error (or ``None``); if any rank has
    one, every rank raises ``ShardLoadError`` naming each failed rank and its message."""
    errors: list[str | None] = [None] * dist.get_world_size(group)
    mine = None if error is None else f"{type(error).__name__}: {error}"
    dist.all_gather_object(errors, mine, group=group)
    failed = {rank: msg for rank, msg in enumerate(errors) if msg is not None}
    if failed:
        ranks = ", ".join(str(r) for r in failed)
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in failed.items())
        raise ShardLoadError(f"{what}: rank(s) {ranks} of {len(errors)} failed to load their shard; "
                             f"{detail}") from error


def load_pretrained(path: str | os.PathLike, group=None, dtype: torch.dtype | None = None, device=None,
                    max_positions: int | None = None):
    """This rank's shard of the checkpoint at ``path`` (what ``dsv4_ops.load_pretrained`` loads,
    then ``shard_model``), built on the meta device and streamed: only this rank's routed
    experts are read at all, the sharded attention tensors are sliced as they arrive. Call it
    on every rank of ``group`` (default: the world). Any failure on any rank (a missing or
    malformed tensor in its slice, a config whose heads / groups / experts do not divide by the
    group size) raises ``ShardLoadError`` on every rank, with each failed rank's message."""
    tp = TensorParallel.of(group)
    model, error = None, None
    try:
        model = load_checkpoint(path, dtype, device, max_positions, tp, shard=lambda m: shard_with(m, tp))
    except Exception as e:  # noqa: BLE001  (any failure must reach the other ranks)
        error = e
    raise_if_any_rank_failed(tp.group, error, "load_pretrained")
    return model
