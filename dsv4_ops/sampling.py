"""Sampling from logits: temperature, top-k, top-p (nucleus) and a seeded Gumbel-max draw, as pure
tensor functions with static shapes and no host syncs (they run in eager mode, inside compiled and
CUDA-graphed steps, and on an exported program's logits).

Randomness comes from a counter-based RNG written in integer ops: the uniform for ``(seed,
position, token, stream)`` is a hash of those four integers. Why not torch's RNG: Inductor draws
its random numbers differently from eager mode (so a compiled run would sample other tokens than
an eager one), and a CUDA graph replays the generator offsets it captured. A hash needs no state
to advance, gives the same numbers in eager, compiled and CUDA-graph code on any device, and
keys a request's randomness on its own seed and positions, never on its row or batch, so a
request samples the same tokens alone or in any batch.

The hash works on int64 tensors holding 32-bit values; every multiplier is below 2**31, so no
product overflows int64 (signed overflow is where eager and generated code could part ways).

A row with ``temperature == 0`` is greedy: its token is ``logits.argmax(-1)`` exactly.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["SamplingParams", "hash_uniform", "uniform_from_bits", "filter_logits", "sample", "sample_with_probs", "probs",
           "draw_from_probs", "STREAM_SAMPLE", "STREAM_DRAFT", "STREAM_ACCEPT", "STREAM_RESIDUAL"]

# independent random streams: the same (seed, position, token) gives unrelated numbers per use
STREAM_SAMPLE, STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESIDUAL = 0, 1, 2, 3

_M32 = 0xFFFFFFFF
_MULT = 0x45D9F3B  # an odd 28-bit multiplier with good avalanche in the xor-shift-multiply mix below
_GOLDEN = 0x9E3779B9  # 2**32 / golden ratio: separates the hashed fields


class SamplingParams(NamedTuple):
    """Per-row sampling settings as tensors of one length (the batch bucket), so changing a value
    between calls changes no graph. ``temperature == 0`` -> greedy; ``top_k == 0`` and
    ``top_p == 1`` -> no filtering."""

    temperature: Tensor  # [B] float32, >= 0
    top_k: Tensor  # [B] int64, >= 0
    top_p: Tensor  # [B] float32, in (0, 1]
    seed: Tensor  # [B] int64, >= 0

    def repeat_rows(self, n: int) -> "SamplingParams":
        """Each row's settings ``n`` times in a row (for ``[B, n, V]`` logits flattened to ``[B * n, V]``)."""
        return SamplingParams(*(t.repeat_interleave(n) for t in self))


def _mix(x: Tensor) -> Tensor:
    """A 32-bit xor-shift-multiply finaliser on int64 values in ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = (x * _MULT) & _M32
    x = x ^ (x >> 16)
    x = (x * _MULT) & _M32
    return x ^ (x >> 16)


def hash_uniform(seed: Tensor, pos: Tensor, token: Tensor, stream: int) -> Tensor:
    """Uniforms in the open interval (0, 1), float32, one per element of the broadcast of the int64
    tensors ``seed`` (>= 0), ``pos`` and ``token``; ``stream`` picks an independent sequence."""
    h = _mix((seed & _M32) ^ ((stream * _GOLDEN) & _M32))
    h = _mix(h ^ ((seed >> 32) & _M32))
    h = _mix(((h + _GOLDEN) & _M32) ^ (pos.long() & _M32))
    h = _mix(((h + _GOLDEN) & _M32) ^ (token.long() & _M32))
    return uniform_from_bits(_mix((h + _GOLDEN) & _M32))


def uniform_from_bits(h: Tensor) -> Tensor:
    """32-bit hashes (int64 in ``[0, 2**32)``) -> float32 uniforms in the open interval (0, 1).

    The top 23 bits pick one of 2**23 equal cells and the value is its centre, ``(i + 0.5) / 2**23``:
    exact in float32 (24 significant bits), so never 0 or 1. With 24 bits the last centre would round
    to 1.0: a +inf Gumbel noise, which draws a token outside the top-k."""
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def _gumbel(seed: Tensor, pos: Tensor, vocab: int, stream: int) -> Tensor:
    """Gumbel(0, 1) noise ``[B, vocab]`` for rows with ``seed [B]`` sampling position ``pos [B]``."""
    token = torch.arange(vocab, device=seed.device)
    u = hash_uniform(seed[:, None], pos[:, None], token[None], stream)
    return -torch.log(-torch.log(u))


def filter_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """``[B, V]`` logits -> ``logits / temperature`` with ``-inf`` outside each row's top-k and
    then top-p nucleus (the smallest set of most likely tokens whose probability, renormalised
    after top-k, reaches ``top_p``). Greedy rows are scaled by 1.

    The cut is a threshold on values (the last kept token's scaled logit), so tokens tied with
    it are kept too: the result never depends on how a sort orders equal values."""
    t = torch.where(params.temperature > 0, params.temperature, torch.ones_like(params.temperature))
    x = logits.float() / t[:, None]
    V = x.shape[-1]
    vals = x.sort(dim=-1, descending=True).values
    rank = torch.arange(V, device=x.device)
    k = torch.where(params.top_k > 0, params.top_k.clamp(max=V), V)
    in_top_k = rank[None] < k[:, None]
    vals = vals.masked_fill(~in_top_k, float("-inf"))
    p = torch.softmax(vals, dim=-1)
    ahead = torch.cumsum(p, dim=-1) - p  # probability of the more likely tokens
    keep = in_top_k & ((ahead < params.top_p[:, None]) | (rank[None] == 0))
    n_keep = keep.sum(dim=-1)  # keep is a prefix of the ranks
    threshold = vals.gather(-1, (n_keep - 1)[:, None])
    return x.masked_fill(x < threshold, float("-inf"))


def _scaled(logits: Tensor, params: SamplingParams, filtered: bool) -> Tensor:
    if filtered:
        return filter_logits(logits, params)
    t = torch.where(params.temperature > 0, params.temperature, torch.ones_like(params.temperature))
    return logits.float() / t[:, None]


def sample(logits: Tensor, params: SamplingParams, pos: Tensor, filtered: bool = True,
           stream: int = STREAM_SAMPLE) -> Tensor:
    """One token per row from ``[B, V]`` logits: ``argmax`` for greedy rows, otherwise a draw from
    ``softmax(filter_logits(logits))`` by Gumbel-max with the uniforms of ``(seed, pos, token)``.
    ``pos [B]`` is the absolute position of the token being drawn. ``filtered=False`` skips the
    top-k / top-p sort (a static choice: pass it only when no row filters)."""
    x = _scaled(logits, params, filtered)
    drawn = (x + _gumbel(params.seed, pos, x.shape[-1], stream)).argmax(-1)
    return torch.where(params.temperature > 0, drawn, logits.argmax(-1))


def probs(logits: Tensor, params: SamplingParams, filtered: bool = True) -> Tensor:
    """The distribution ``sample`` draws from, ``[B, V]``: one-hot at the argmax for greedy rows."""
    x = _scaled(logits, params, filtered)
    greedy = torch.nn.functional.one_hot(logits.argmax(-1), x.shape[-1]).to(torch.float32)
    return torch.where(params.temperature[:, None] > 0, torch.softmax(x, dim=-1), greedy)


def sample_with_probs(logits: Tensor, params: SamplingParams, pos: Tensor, filtered: bool = True,
                      stream: int = STREAM_SAMPLE) -> tuple[Tensor, Tensor]:
    """``(sample(...), probs(...))`` sharing one filtering pass: the token is drawn from exactly
    the returned distribution (what speculative sampling's rejection rule needs)."""
    x = _scaled(logits, params, filtered)
    greedy_tok = logits.argmax(-1)
    drawn = (x + _gumbel(params.seed, pos, x.shape[-1], stream)).argmax(-1)
    sampling = params.temperature > 0
    greedy = torch.nn.functional.one_hot(greedy_tok, x.shape[-1]).to(torch.float32)
    return (torch.where(sampling, drawn, greedy_tok),
            torch.where(sampling[:, None], torch.softmax(x, dim=-1), greedy))


def draw_from_probs(p: Tensor, seed: Tensor, pos: Tensor, stream: int) -> Tensor:
    """One token per row from (unnormalised, non-negative) ``p [B, V]`` by Gumbel-max on ``log p``:
    zero-probability tokens are never drawn; a one-hot row gives its hot token."""
    return (torch.log(p) + _gumbel(seed, pos, p.shape[-1], stream)).argmax(-1)
