"""Bytes and flops each kernel cannot avoid, and the roofline floor they imply (DESIGN.md §6).

``floor = max(bytes / 4.3e12 B/s, flops / 790e12 FLOP/s)``, both measured on the H200 (HBM copy
bandwidth, dense bf16 tensor-core rate). Bytes count every input element the kernel must read
ONCE and every output element it writes, at the dtype it is stored in; the kernels' own scratch
traffic (split-KV partials, the indexer's score row) is not counted: it is avoidable, so it
belongs to the gap between achieved time and the floor. Flops count only matrix-multiply work
(2 per multiply-add); elementwise work (softmax, ReLU, RMSNorm, RoPE) is not tensor-core work
and is not bounded by the 790 TFLOP/s rate, so kernels without matmuls have ``flops = 0``.

All formulas are for one decode step: one query (``S = 1``) per batch row.
"""
from __future__ import annotations

import math
from typing import NamedTuple

HBM_BYTES_PER_S = 4.3e12  # measured copy bandwidth of the H200
BF16_FLOPS_PER_S = 790e12  # measured dense bf16 matmul rate of the H200
INDEX_BYTES = 4  # every index / length / slot tensor is int32
SINK_BYTES = 4  # the per-head sink logits are fp32


class Cost(NamedTuple):
    bytes: int
    flops: int


def floor_us(cost: Cost) -> float:
    """``max(bytes / 4.3e12, flops / 790e12)`` in microseconds."""
    return max(cost.bytes / HBM_BYTES_PER_S, cost.flops / BF16_FLOPS_PER_S) * 1e6


def bound(cost: Cost) -> str:
    """Which term sets the floor: ``"memory"`` or ``"compute"``."""
    return "compute" if cost.flops / BF16_FLOPS_PER_S > cost.bytes / HBM_BYTES_PER_S else "memory"


def sparse_attention_cost(batch: int, heads: int, head_dim: int, window: int, picked: int, dense: int,
                          act_bytes: int = 2, entry_bytes: int | None = None) -> Cost:
    """Decode sparse attention, per row: ``E = window + picked + dense`` entries
    (CSA: ``W + K`` picked; HCA: ``W + ctx/128`` visible, ``picked = 0``).

    bytes = B * (H*D*a          q
                 + E*e          each gathered entry (kv or cmp), read once
                 + (W + K)*4    kv_idx, cmp_idx
                 + 4            cmp_len
                 + H*D*a)       output
            + H*4               sink (shared by all rows)
    flops = B * 4*H*D*E         (q.e for every head and entry, then p.e: 2 flops per MAC each)
    with ``a = act_bytes`` (2 for bf16) and ``e = entry_bytes``: ``D*a`` for a float cache, an FP8
    cache's whole entry (``fp8_cache.KVLayout.entry_bytes``, scales included: 584 at V4 widths).
    The flops do not change with the cache: the kernel decodes FP8 entries to bf16 and multiplies those.
    """
    entries = window + picked + dense
    entry = head_dim * act_bytes if entry_bytes is None else entry_bytes
    per_row = (2 * heads * head_dim * act_bytes + entries * entry
               + (window + picked) * INDEX_BYTES + INDEX_BYTES)
    return Cost(batch * per_row + heads * SINK_BYTES, batch * 4 * heads * head_dim * entries)


def indexer_topk_cost(batch: int, heads: int, dim: int, keys: int, topk: int, q_bytes: int = 2,
                      weight_bytes: int = 4, key_bytes: int = 2, key_entry_bytes: int | None = None) -> Cost:
    """Decode lightning indexer over ``N = keys`` visible keys (``ctx / 4``), per row:

    bytes = B * (HI*DI*q + HI*w     q, per-head weights
                 + N*r              every visible key, read once
                 + 4                visible
                 + topk*4)          output indices
    flops = B * 2*HI*DI*N           (the q.k dots; ReLU and the weighted head sum are elementwise)
    with ``r = key_entry_bytes``: ``DI*k`` for float keys, an FP8 key's ``DI + 4`` (e4m3 codes and
    its fp32 scale, ``fp8_cache.IndexerLayout.entry_bytes``: 132 at V4 widths).
    """
    key = dim * key_bytes if key_entry_bytes is None else key_entry_bytes
    per_row = heads * dim * q_bytes + heads * weight_bytes + keys * key + INDEX_BYTES + topk * INDEX_BYTES
    return Cost(batch * per_row, batch * 2 * heads * dim * keys)


def compress_cost(batch: int, dim: int, ratio: int, overlap: bool, rope_half: int, blocks: int = 1,
                  ring_bytes: int = 4, norm_bytes: int = 2, rope_bytes: int = 4, pool_bytes: int = 2) -> Cost:
    """Compressor emission of ``blocks`` blocks per row (decode: 1). A block pools ``c*m`` slots
    of ``d`` channels (``c = 2`` with ``overlap`` (CSA): first halves of the previous block's ``m``
    rows, second halves of its own), for kv and for gate:

    bytes = B * blocks * (2 * c*m*d*r       kv + gate slots (fp32 rings / new rows), read once
                          + 2 * half*t      the block's cos and sin row
                          + 4               emit
                          + d*p)            pooled entry written to the pool
            + B*4                           start
            + d*n                           RMSNorm weight (shared)
    flops = 0 (softmax pooling, RMSNorm and RoPE are elementwise)
    with r, t, p, n the ring, rope table, pool and norm-weight element sizes.
    """
    slots = (2 if overlap else 1) * ratio
    per_block = 2 * slots * dim * ring_bytes + 2 * rope_half * rope_bytes + INDEX_BYTES + dim * pool_bytes
    return Cost(batch * blocks * per_block + batch * INDEX_BYTES + dim * norm_bytes, 0)


def plan_cost(batch: int, window: int, csa_ratio: int, hca_ratio: int, num_tokens: int = 1, steps: int = 1) -> Cost:
    """``plan``: reads ``lengths`` and ``n_new`` (``B`` int32 each), writes the nine int32 tensors:

    bytes = 2*B*4 + steps*B*4 * (6*S            positions, win_write, csa/hca len and write
                                 + S*W          win_idx
                                 + ceil(S/m_csa) + ceil(S/m_hca))   csa/hca emit
    flops = 0
    """
    S = num_tokens
    outputs = 6 * S + S * window + math.ceil(S / csa_ratio) + math.ceil(S / hca_ratio)
    return Cost(2 * batch * INDEX_BYTES + steps * batch * outputs * INDEX_BYTES, 0)


def cache_write_cost(batch: int, channels: int, elem_bytes: int = 2, num_tokens: int = 1) -> Cost:
    """``cache_write`` of ``S`` new rows of ``C`` channels per batch row:

    bytes = B*S * (C*e + 4 + C*e)    values read, slot read, cache row written
    flops = 0
    """
    return Cost(batch * num_tokens * (2 * channels * elem_bytes + INDEX_BYTES), 0)


def sinkhorn_cost(batch: int, hc_mult: int = 4, num_tokens: int = 1) -> Cost:
    """``sinkhorn`` of one fp32 ``N x N`` mHC matrix per token (read once, written once):

    bytes = B*S * 2 * N*N*4
    flops = 0
    """
    return Cost(batch * num_tokens * 2 * hc_mult * hc_mult * 4, 0)
