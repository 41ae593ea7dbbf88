"""``generate``'s per-request keywords, checked at the Python boundary (DESIGN.md rule 7) and laid
out as device tensors for the steps: ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``,
``seed`` and ``eos_token_id``. Each is one value for every prompt or a list with one per prompt.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from .sampling import SamplingParams

__all__ = ["GenerateArgs", "parse_generate_args"]

_SEED_LIMIT = 2**63


class GenerateArgs(NamedTuple):
    """One entry per prompt, all checked."""

    max_new: list[int]
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    seed: list[int]
    eos: list[list[int]]  # each row's stop ids (may be empty)

    @property
    def sampling(self) -> bool:
        """Does any row sample (temperature > 0)? Otherwise every row is greedy."""
        return any(t > 0 for t in self.temperature)

    @property
    def filtered(self) -> bool:
        """Does any sampling row cut its distribution (top-k or top-p)? Picks the sort-free graph if not."""
        return any(t > 0 and (k > 0 or p < 1) for t, k, p in zip(self.temperature, self.top_k, self.top_p))

    @property
    def stops_early(self) -> bool:
        """Can a row finish before the others (a stop id, or its own max_new_tokens)?"""
        return any(self.eos) or len(set(self.max_new)) > 1

    def params(self, bucket: int, device) -> SamplingParams:
        """The settings as ``[bucket]`` tensors; padding rows are greedy."""
        def col(values, fill, dtype):
            return torch.tensor(values + [fill] * (bucket - len(values)), dtype=dtype).to(device)

        return SamplingParams(col(self.temperature, 0.0, torch.float32), col(self.top_k, 0, torch.int64),
                              col(self.top_p, 1.0, torch.float32), col(self.seed, 0, torch.int64))

    def eos_table(self, bucket: int, device) -> Tensor:
        """``[bucket, E]`` int64 stop ids per row, ``-1`` where a row has fewer (never matches a token)."""
        E = max(1, max(len(e) for e in self.eos))
        table = torch.full((bucket, E), -1, dtype=torch.int64)
        for i, ids in enumerate(self.eos):
            table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        return table.to(device)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _per_request(name: str, value, B: int, check: Callable[[str, object], object]) -> list:
    """``value`` for every prompt, or a list/tuple with one entry per prompt; ``check(label, v)``
    validates one entry (raising a ValueError) and returns its normalised value."""
    if isinstance(value, (list, tuple)):
        if len(value) != B:
            raise ValueError(f"generate: {name} has {len(value)} entries; pass one per prompt ({B}) or a "
                             "single value for all")
        return [check(f"generate: {name}[{i}]", v) for i, v in enumerate(value)]
    return [check(f"generate: {name}", value)] * B


def _max_new(label: str, v) -> int:
    if not _is_int(v) or v < 1:
        raise ValueError(f"{label} must be an int >= 1, got {v!r}")
    return v


def _optional(default, ok: Callable[[object], bool], what: str, cast=lambda v: v) -> Callable[[str, object], object]:
    """The check of a keyword whose None means ``default``: ``cast(v)`` when ``ok(v)``, else a ValueError."""
    def check(label: str, v):
        if v is None:
            return default
        if not ok(v):
            raise ValueError(f"{label} must be {what}, got {v!r}")
        return cast(v)
    return check


_temperature = _optional(0.0, lambda v: _is_number(v) and v >= 0, "a finite number >= 0 (0 or None = greedy)", float)
_top_k = _optional(0, lambda v: _is_int(v) and v >= 0, "an int >= 0 (0 or None = no top-k cut)")
_top_p = _optional(1.0, lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1] (1 or None = no top-p cut)", float)
_seed = _optional(None, lambda v: _is_int(v) and 0 <= v < _SEED_LIMIT, "an int in [0, 2**63) or None (random)")


def _stop_ids(label: str, v, vocab_size: int) -> list[int]:
    ids = [] if v is None else [v] if _is_int(v) else v
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"{label} must be an int token id, a list of them, or None, got {type(v).__name__}")
    for t in ids:
        if not _is_int(t):
            raise ValueError(f"{label} must hold int token ids, got {t!r}")
        if not 0 <= t < vocab_size:
            raise ValueError(f"{label}: token id {t} is outside [0, vocab_size={vocab_size})")
    return list(ids)


def parse_generate_args(B: int, vocab_size: int, max_new_tokens, temperature, top_k, top_p, seed,
                        eos_token_id) -> GenerateArgs:
    """Check and normalise ``generate``'s keywords for ``B`` prompts.

    ``seed``: a single int ``s`` gives prompt ``i`` the seed ``s + i`` (so two equal prompts in one
    batch still draw different tokens, and prompt ``i`` run alone with seed ``s + i`` draws the
    same ones); None draws seeds from torch's global generator (``torch.manual_seed`` makes it
    repeatable). ``eos_token_id``: an int or a list of ints stops every row at any of them; a
    list with one entry per prompt where entries are lists (or None) gives each row its own."""
    max_new = _per_request("max_new_tokens", max_new_tokens, B, _max_new)
    temps = _per_request("temperature", temperature, B, _temperature)
    ks = _per_request("top_k", top_k, B, _top_k)
    ps = _per_request("top_p", top_p, B, _top_p)
    if isinstance(seed, (list, tuple)):
        seeds = _per_request("seed", seed, B, _seed)
    else:
        first = _seed("generate: seed", seed)
        seeds = None if first is None else [(first + i) % _SEED_LIMIT for i in range(B)]
    if (seeds is None or None in seeds) and any(t > 0 for t in temps):  # greedy never touches torch's RNG
        drawn = torch.randint(0, 2**62, (B,)).tolist()  # a CPU generator: no device sync
        seeds = [d if s is None else s for s, d in zip(seeds or [None] * B, drawn)]
    seeds = [0 if s is None else s for s in (seeds or [None] * B)]
    per_row = isinstance(eos_token_id, (list, tuple)) and any(
        e is None or isinstance(e, (list, tuple)) for e in eos_token_id)
    if per_row:
        eos = _per_request("eos_token_id", eos_token_id, B, lambda label, v: _stop_ids(label, v, vocab_size))
    else:
        eos = [_stop_ids("generate: eos_token_id", eos_token_id, vocab_size)] * B
    return GenerateArgs(max_new, temps, ks, ps, seeds, eos)
