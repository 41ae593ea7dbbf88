"""Readable plain-PyTorch semantics of every ``torch.ops.dsv4`` op.

These functions ARE the contract: the CPU branch of each op calls them, and every GPU kernel is
tested against them. They favour clarity over speed, compute in fp32 whatever the input dtype, and
never read a tensor value on the host (no ``.item()``), so they also trace under
``torch.compile(fullgraph=True)``.

Shape legend (all ops):
    B  batch rows (requests, padded to a bucket)     S  query / new tokens per row
    H  attention heads        D  head dim (512)      W  window entries per query
    R  ring slots             N  entries in a pool   E  blocks that may close per step
    HI / DI  indexer heads / head dim                r  rope dims (last r channels)

Position-addressed state (DESIGN.md rule 3): token ``p`` of a row lives at ring slot ``p % R``;
compressed entry ``i`` (block of positions ``[m*i, m*i + m)``) lives at pool index ``i``. A row's
only mutable scalar is its length. ``-1`` means "nothing" in every index tensor.

FP8 caches (``fp8_cache.py``): wherever an op takes a window ring, a compressed pool or an
indexer-key pool, it also takes that cache in its paged FP8 layout (a rank-4 ``uint8`` tensor of
``N = pages * page`` entries): ``cache_write`` and ``compress`` quantise on write,
``sparse_attention`` and ``indexer_topk`` dequantise what they read. Over FP8 keys ``indexer_topk``
also quantises its queries, one power-of-two scale a head (``fp8_cache.simulate_queries``): an
FP8 x FP8 score, as the serving engines compute it.

Paged pools (the serving engine's): wherever an op takes a compressed pool or an indexer-key pool
it also takes it as pages shared by all rows, ``[num_pages, page, width]`` (float, or FP8
``uint8 [num_pages, page, entry_bytes]``), with a ``block_table [B, P] int32``: entry ``i`` of row
``b`` lives in page ``block_table[b, i // page]`` at slot ``i % page``, so a row addresses
``N = P * page`` entries. The per-row layout is the special case of one page per row
(``block_table[b] = b``); :func:`paged_rows` is the definition every backend follows. Page ids
are clamped to ``[0, num_pages)``.

Out-of-range values (the raw-op contract): the public wrappers in ``dsv4_ops.ops`` reject them, the
raw ``torch.ops.dsv4`` ops do not check values. Every backend then reads them the same way, these
functions included: an index or slot outside its tensor is skipped like ``-1``, a count is clamped
to its range. Each op's docstring says which.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import fp8_cache as fp8

__all__ = [
    "plan",
    "paged_rows",
    "physical_entries",
    "cache_write",
    "compress",
    "indexer_topk",
    "sparse_attention",
    "sinkhorn",
    "moe_gemv",
    "gemv",
    "apply_rope",
    "rms_norm",
    "swiglu",
]


# --------------------------------------------------------------------------------------
# small math helpers shared by the ops and the layer reference
# --------------------------------------------------------------------------------------
def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm in fp32: ``weight * x / sqrt(mean(x^2) + eps)`` (weight optional); returns fp32."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y * weight.float() if weight is not None else y


def swiglu(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    """The clamped SwiGLU of V4's experts (HF and the official code): ``gate`` clamped from above
    only, ``up`` on both sides; in the inputs' dtype."""
    return torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """Interleaved partial RoPE on the LAST ``r = 2 * cos.shape[-1]`` channels of ``x``.

    Channel pairs ``(x[2i], x[2i+1])`` of the rope slice are rotated like the complex number
    ``x[2i] + j x[2i+1]`` times ``exp(j * angle_i)``. ``cos``/``sin`` must broadcast against
    ``x[..., :r/2]`` (one entry per pair, already gathered at the right positions).
    ``inverse=True`` multiplies by the conjugate. Math in fp32, result in ``x.dtype``.
    """
    half = cos.shape[-1]
    r = 2 * half
    nope, rope = x[..., :-r], x[..., -r:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    c, s = cos.float(), sin.float()
    if inverse:
        s = -s
    out_even = even * c - odd * s
    out_odd = odd * c + even * s
    rotated = torch.stack((out_even, out_odd), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


# --------------------------------------------------------------------------------------
# plan: step inputs -> every derived metadata tensor
# --------------------------------------------------------------------------------------
def _window_write_slots(pos: Tensor, valid: Tensor, end: Tensor, ring: int) -> Tensor:
    # A new token is written unless a later token of the same step lands on the same
    # slot (only possible when a step brings more than `ring` tokens): writing it would
    # make the ring's content depend on the scatter order.
    keep = valid & (pos >= end[..., None] - ring)
    return torch.where(keep, pos % ring, torch.full_like(pos, -1))


def plan(lengths: Tensor, n_new: Tensor, num_tokens: int, steps: int, window: int, win_ring: int, win_concat: bool,
         csa_ratio: int, csa_ring: int, hca_ratio: int, hca_ring: int) -> tuple[Tensor, ...]:
    """Turn per-row lengths into every tensor the layers need, for ``steps`` sub-steps.

    The arguments are :func:`dsv4_ops.ops.plan`'s; returns the fields of ``dsv4_ops.ops.Plan`` as a
    tuple, every tensor ``int32`` with a leading ``[steps]`` dim. With ``steps=k`` and ``n_new=1``
    (the MTP draft loop), draft step ``i`` sees the window of draft tokens ``0..i-1``.

    Raw-op contract: negative ``lengths`` / ``n_new`` count as 0.
    """
    device = lengths.device
    lengths = lengths.to(torch.int64).clamp(min=0)
    n_new = n_new.to(torch.int64).clamp(min=0)
    step = torch.arange(steps, device=device)[:, None]  # [steps, 1]
    start = lengths[None, :] + step * n_new[None, :]  # [steps, B]
    end = start + n_new[None, :]
    j = torch.arange(num_tokens, device=device)
    pos = start[..., None] + j  # [steps, B, S]
    valid = j < n_new[None, :, None]
    neg = torch.full_like(pos, -1)
    positions = torch.where(valid, pos, neg)

    win_write = _window_write_slots(pos, valid, end, win_ring)
    # window entries of query t: positions t-W+1 .. t (oldest first)
    wpos = pos[..., None] - window + 1 + torch.arange(window, device=device)  # [steps,B,S,W]
    if win_concat:
        fresh = wpos >= start[..., None, None]
        widx = torch.where(fresh, win_ring + (wpos - start[..., None, None]), wpos % win_ring)
    else:
        widx = wpos % win_ring
    win_idx = torch.where(valid[..., None] & (wpos >= 0), widx, torch.full_like(widx, -1))

    outs = [positions, win_write, win_idx]
    for ratio, ring in ((csa_ratio, csa_ring), (hca_ratio, hca_ring)):
        visible = torch.where(valid, (pos + 1) // ratio, torch.zeros_like(pos))
        n_emit = -(-num_tokens // ratio)
        first = start // ratio  # first block a new token can close
        blocks = first[..., None] + torch.arange(n_emit, device=device)
        emit = torch.where(blocks < (end // ratio)[..., None], blocks, torch.full_like(blocks, -1))
        write = _window_write_slots(pos, valid, end, ring)
        outs += [visible, emit, write]
    return tuple(t.to(torch.int32).contiguous() for t in outs)


# --------------------------------------------------------------------------------------
# paged pools: a row's entries through its block-table row
# --------------------------------------------------------------------------------------
def paged_rows(pages: Tensor, block_table: Tensor) -> Tensor:
    """The per-row layout of a paged pool: row ``b`` is its pages in block-table order.

    ``pages [num_pages, page, width]`` (or FP8 ``uint8 [num_pages, page, entry_bytes]``),
    ``block_table [B, P] int32`` -> ``[B, P * page, width]`` (FP8: ``[B, P, page, entry_bytes]``,
    the per-row FP8 layout). A copy: what the reads see, never written back."""
    rows = pages[block_table.long().clamp(0, pages.shape[0] - 1)]  # [B, P, page, width]
    return rows if fp8.is_fp8_cache(pages, paged=True) else rows.flatten(1, 2)


def physical_entries(idx: Tensor, block_table: Tensor, pages: Tensor) -> Tensor:
    """Entries ``idx [B, ...]`` of the rows of ``block_table [B, P]`` -> their index in ``pages``
    seen as one row of ``num_pages * page`` entries (``page_id * page + idx % page``), int64;
    ``-1`` where ``idx`` is outside ``[0, P * page)``."""
    num_pages, page = pages.shape[0], pages.shape[1]
    B = idx.shape[0]
    ok = (idx >= 0) & (idx < block_table.shape[1] * page)
    safe = torch.where(ok, idx, 0).long().reshape(B, -1)
    page_id = block_table.long().clamp(0, num_pages - 1).gather(1, safe // page)
    return torch.where(ok, (page_id * page + safe % page).view(idx.shape), -1)


def _write_pages(pages: Tensor, values: Tensor, phys: Tensor) -> None:
    """``pages`` seen as one row, ``row[phys] = values`` (``[..., C]`` at ``phys [...]``, -1 = skip)."""
    num_pages, page = pages.shape[0], pages.shape[1]
    keep = phys >= 0
    # Skipped rows are routed to a scratch page, then dropped: no data-dependent shapes.
    page_id = torch.where(keep, phys // page, num_pages)
    padded = torch.cat([pages, pages.new_zeros(1, *pages.shape[1:])])
    padded[page_id, torch.where(keep, phys % page, 0)] = values.to(pages.dtype)
    pages.copy_(padded[:num_pages])


# --------------------------------------------------------------------------------------
# cache writes
# --------------------------------------------------------------------------------------
def cache_write(cache: Tensor, values: Tensor, slots: Tensor, block_table: Tensor | None = None) -> None:
    """``cache[b, slots[b, s]] = values[b, s]`` for every ``slots >= 0``; in place.

    cache ``[B, N, C]``, values ``[B, S, C]`` (same dtype), slots ``[B, S] int32``. Serves the
    window ring, the compressor-input rings and any pool. Slots of one row must be distinct
    (``plan`` guarantees it); with ``block_table``, the physical entries of all rows must be
    (rows own their pages while they write them).

    ``block_table [B, P]``: ``cache`` is a paged pool (``[num_pages, page, C]``, or FP8 pages),
    ``N = P * page``.

    Raw-op contract: slots outside ``[0, N)`` are skipped like -1.
    """
    _scatter_rows(cache, values, slots, block_table, keys=False)


def _scatter_rows(cache: Tensor, values: Tensor, slots: Tensor, block_table: Tensor | None, keys: bool) -> None:
    """:func:`cache_write`; an FP8 ``cache`` takes the indexer-key format when ``keys``, else the KV format."""
    if block_table is not None:
        phys = physical_entries(slots, block_table, cache)
        if fp8.is_fp8_cache(cache, paged=True):  # the pages as one row of the FP8 layout (a view)
            return _write_entries_fp8(cache[None], values.flatten(0, 1)[None], phys.flatten()[None], keys)
        return _write_pages(cache, values, phys)
    if fp8.is_fp8_cache(cache):
        return _write_entries_fp8(cache, values, slots, keys)
    B, S = slots.shape
    N = cache.shape[1]
    keep = (slots >= 0) & (slots < N)
    # Skipped rows are routed to a scratch row N, then dropped: no data-dependent shapes.
    tgt = torch.where(keep, slots.long(), torch.full_like(slots, N, dtype=torch.long))
    padded = torch.cat([cache, cache.new_zeros(B, 1, cache.shape[2])], dim=1)
    padded.scatter_(1, tgt[..., None].expand(B, S, cache.shape[2]), values.to(cache.dtype))
    cache.copy_(padded[:, :N])


def _write_entries_fp8(pool: Tensor, entry: Tensor, slots: Tensor, keys: bool | None = None) -> None:
    """Quantise ``entry [B, E, d]`` into an FP8 pool at ``slots [B, E]`` (-1 = skip). The KV format, or
    the indexer-key format (``keys``; None: ``entry_bytes == d + 4``): rotate, then one fp32 scale per key."""
    d = entry.shape[-1]
    if (pool.shape[-1] == d + 4) if keys is None else keys:
        lay = fp8.IndexerLayout.of(pool)
        data, scales = fp8.quantize_keys(fp8.rotate(entry))
    else:
        lay = fp8.KVLayout.of(pool, d)
        data, scales = fp8.quantize_kv(entry, lay.rope)
    rows = fp8.to_entries(pool, lay.data_bytes)
    cache_write(rows, torch.cat([data, scales], -1), slots)
    pool.copy_(fp8.from_entries(rows, lay.page, lay.data_bytes))


# --------------------------------------------------------------------------------------
# compressor: pooled entries of every block the new tokens close
# --------------------------------------------------------------------------------------
def compress(ring_kv: Tensor, ring_gate: Tensor, new_kv: Tensor, new_gate: Tensor, start: Tensor, emit: Tensor,
             norm_weight: Tensor, cos: Tensor, sin: Tensor, pool: Tensor, ratio: int, overlap: bool, eps: float,
             block_table: Tensor | None = None) -> None:
    """Emit the compressed entry of every block listed in ``emit`` into ``pool``; in place.

    The arguments are :func:`dsv4_ops.ops.compress`'s: per channel, the entry of block ``i`` is
    ``sum_slots softmax_slots(gate) * kv`` in fp32, then RMSNorm, then RoPE at position ``m*i``.

    Raw-op contract: ``emit`` entries outside ``[0, N)`` are skipped like -1; an entry whose
    rope row is past the table (``m*i >= P``) is left unrotated. (A block that is not
    complete, or older than the ring, pools whatever rows its positions map to.)
    """
    B, E = emit.shape
    c = 2 if overlap else 1
    d = new_kv.shape[-1] // c
    m = ratio
    R = ring_kv.shape[1]
    S = new_kv.shape[1]
    dev = emit.device
    N = fp8.entries(pool, block_table)
    emitted = (emit >= 0) & (emit < N)
    blk = torch.where(emitted, emit.long(), 0)  # [B, E]; skipped blocks computed then dropped
    start = start.long()

    def gather_rows(pos: Tensor, ring: Tensor, new: Tensor) -> Tensor:
        # pos [B, E, L] -> rows [B, E, L, c*d] from `new` (p >= start) or the ring
        fresh = pos >= start[:, None, None]
        ridx = (pos % R).clamp(min=0)
        nidx = (pos - start[:, None, None]).clamp(0, max(S - 1, 0))
        C = ring.shape[-1]
        from_ring = torch.gather(ring.float(), 1, ridx.reshape(B, -1, 1).expand(-1, -1, C))
        if S > 0:
            from_new = torch.gather(new.float(), 1, nidx.reshape(B, -1, 1).expand(-1, -1, C))
        else:
            from_new = from_ring
        rows = torch.where(fresh.reshape(B, -1, 1), from_new, from_ring)
        return rows.view(B, E, pos.shape[-1], C)  # explicit L: E may be 0

    own = blk[..., None] * m + torch.arange(m, device=dev)  # [B, E, m]
    kv_own = gather_rows(own, ring_kv, new_kv)
    gate_own = gather_rows(own, ring_gate, new_gate)
    if overlap:
        prev = own - m
        kv_prev = gather_rows(prev, ring_kv, new_kv)[..., :d]
        gate_prev = gather_rows(prev, ring_gate, new_gate)[..., :d]
        # block -1 does not exist: its slots get weight 0
        gate_prev = torch.where(prev[..., None] >= 0, gate_prev, torch.full_like(gate_prev, float("-inf")))
        kv_prev = torch.where(prev[..., None] >= 0, kv_prev, torch.zeros_like(kv_prev))
        kv = torch.cat([kv_prev, kv_own[..., d:]], dim=2)  # [B, E, 2m, d]
        gate = torch.cat([gate_prev, gate_own[..., d:]], dim=2)
    else:
        kv, gate = kv_own, gate_own
    pooled = (kv * gate.softmax(dim=2)).sum(dim=2)  # [B, E, d]
    entry = rms_norm(pooled, norm_weight, eps)
    bpos = blk * m
    P = cos.shape[0]
    if P > 0:
        in_table = (bpos < P)[..., None]
        row = bpos.clamp(max=P - 1)
        c = torch.where(in_table, cos[row].float(), 1.0)
        s = torch.where(in_table, sin[row].float(), 0.0)
    else:
        c = cos.new_ones(B, E, cos.shape[-1], dtype=torch.float32)
        s = torch.zeros_like(c)
    entry = apply_rope(entry, c, s)

    _scatter_rows(pool, entry, torch.where(emitted, blk, -1), block_table, keys=pool.shape[-1] == d + 4)


# --------------------------------------------------------------------------------------
# lightning indexer
# --------------------------------------------------------------------------------------
def indexer_scores(q: Tensor, weights: Tensor, keys: Tensor, visible: Tensor) -> Tensor:
    """``score[b,s,i] = sum_h weights[b,s,h] * relu(q[b,s,h] . keys[b,i])`` in fp32 for
    ``i < visible[b,s]``, ``-inf`` elsewhere. Returns ``[B, S, N]``."""
    dots = torch.einsum("bshd,bnd->bshn", q.float(), keys.float())
    scores = (dots.relu() * weights.float()[..., None]).sum(dim=2)
    idx = torch.arange(keys.shape[1], device=keys.device)
    return scores.masked_fill(idx >= visible[..., None], float("-inf"))


def indexer_topk(q: Tensor, weights: Tensor, keys: Tensor, visible: Tensor, topk: int,
                 block_table: Tensor | None = None) -> Tensor:
    """Top-``topk`` visible compressed entries per query, fixed width, -1 sentinels.

    The arguments are :func:`dsv4_ops.ops.indexer_topk`'s. Returns ``[B, S, topk] int32``: the
    ``min(topk, visible)`` best entries, ordered by descending score; **ties go to the lower entry
    index** (a stable sort), so the choice among equal scores (e.g. many exact zeros from the
    ReLUs) is deterministic. Remaining slots are -1.

    Raw-op contract: ``visible`` is clamped to ``[0, N]``.
    """
    if block_table is not None:
        keys = paged_rows(keys, block_table)
    if fp8.is_fp8_cache(keys):  # rotated keys: the caller passes rotated queries, scored as FP8 (per head)
        keys = fp8.read_keys(keys)
        q = fp8.simulate_queries(q)
    B, S = visible.shape
    N = keys.shape[1]
    scores = indexer_scores(q, weights, keys, visible)
    if N == 0:
        return torch.full((B, S, topk), -1, dtype=torch.int32, device=q.device)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :topk]
    rank = torch.arange(order.shape[-1], device=q.device)
    picked = torch.where(rank < visible[..., None], order, torch.full_like(order, -1))
    if picked.shape[-1] < topk:  # fewer entries in the pool than k
        pad = picked.new_full((B, S, topk - picked.shape[-1]), -1)
        picked = torch.cat([picked, pad], dim=-1)
    return picked.to(torch.int32).contiguous()


# --------------------------------------------------------------------------------------
# sparse attention over window ∪ compressed entries, one softmax with the sink
# --------------------------------------------------------------------------------------
def sparse_attention(q: Tensor, kv: Tensor, kv_idx: Tensor, cmp: Tensor, cmp_idx: Tensor, cmp_len: Tensor, sink: Tensor,
                     scale: float, block_table: Tensor | None = None) -> Tensor:
    """MQA with one shared K = V vector per entry, over a per-query entry set, plus sink.

    The arguments are :func:`dsv4_ops.ops.sparse_attention`'s. Returns ``[B, S, H, D]`` in
    ``q.dtype``: ``o = sum_j exp(l_j) e_j / (sum_j exp(l_j) + exp(sink_h))`` with
    ``l_j = scale q.e_j`` in ONE softmax over all entries (fp32). A query with no entries gets zeros.

    Raw-op contract: indices outside ``[0, N)`` / ``[0, Nc)`` are skipped like -1;
    ``cmp_len`` is clamped to ``[0, Nc]``.
    """
    B, S, H, D = q.shape
    if block_table is not None:
        cmp = paged_rows(cmp, block_table)
    if fp8.is_fp8_cache(kv):
        kv = fp8.read_kv(kv, D)
    if fp8.is_fp8_cache(cmp):
        cmp = fp8.read_kv(cmp, D)
    Nc = cmp.shape[1]
    qf = q.float()

    def gather(src: Tensor, idx: Tensor) -> Tensor:  # [B, N, D] x [B, S, L] -> [B, S, L, D]
        L = idx.shape[-1]
        if src.shape[1] == 0:  # empty source: every index is -1, nothing to gather from
            return src.new_zeros(B, S, L, D, dtype=torch.float32)
        safe = idx.long().clamp(min=0).reshape(B, S * L, 1).expand(-1, -1, D)
        return torch.gather(src.float(), 1, safe).view(B, S, L, D)

    ok = [(kv_idx >= 0) & (kv_idx < kv.shape[1]), (cmp_idx >= 0) & (cmp_idx < Nc)]
    ent = [gather(kv, torch.where(ok[0], kv_idx, 0)), gather(cmp, torch.where(ok[1], cmp_idx, 0))]
    if Nc > 0:
        ent.append(cmp.float()[:, None].expand(B, S, Nc, D))
        ok.append(torch.arange(Nc, device=q.device) < cmp_len[..., None])
    entries = torch.cat(ent, dim=2)  # [B, S, L, D]
    valid = torch.cat(ok, dim=2)  # [B, S, L]
    # Skipped entries may hold anything (never-written pool / ring rows, e.g. NaN from an
    # uninitialised buffer): zero them so a 0-probability slot cannot inject 0 * NaN.
    entries = entries.masked_fill(~valid[..., None], 0.0)
    logits = torch.einsum("bshd,bsld->bshl", qf, entries) * scale
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    sinks = sink.float().view(1, 1, H, 1).expand(B, S, H, 1)
    probs = torch.cat([logits, sinks], dim=-1).softmax(dim=-1)[..., :-1]
    out = torch.einsum("bshl,bsld->bshd", probs, entries)
    return out.to(q.dtype)


# --------------------------------------------------------------------------------------
# sinkhorn: the mHC residual-mixing matrix (architecture.md §8)
# --------------------------------------------------------------------------------------
def sinkhorn(comb: Tensor, iters: int, eps: float) -> Tensor:
    """Sinkhorn normalisation of positive ``[..., N, N]`` matrices, in fp32: one column
    normalisation, then ``iters - 1`` x (rows, columns); every sum is offset by ``eps``
    (``c / (sum + eps)``), the order HF and the official mHC use. Returns fp32, same shape."""
    comb = comb.float()
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


# --------------------------------------------------------------------------------------
# moe_gemv: routed experts of a few tokens (architecture.md §9)
# --------------------------------------------------------------------------------------
def moe_gemv(x: Tensor, indices: Tensor, weights: Tensor, w13: Tensor, w2: Tensor, limit: float) -> Tensor:
    """``out[t] = sum_k weights[t, k] * expert_{indices[t, k]}(x[t])``, fp32 ``[T, D]``.

    Expert ``e``: ``gate, up = x @ w13[e, :I].T, x @ w13[e, I:].T`` (each rounded to the
    weights' dtype, as a matmul in that dtype returns it), ``h = silu(min(gate, limit)) *
    clamp(up, -limit, limit)`` rounded to the weights' dtype, ``y = h @ w2[e].T`` in fp32.
    An index named twice in a row counts twice (hash layers); an index outside ``[0, E)``
    contributes zero."""
    T, K = indices.shape
    E, I = w13.shape[0], w2.shape[2]
    flat = indices.reshape(-1).long()
    routed = (flat >= 0) & (flat < E)
    e = torch.where(routed, flat, torch.zeros_like(flat))
    xs = x.float().repeat_interleave(K, dim=0)  # [T*K, D], token-major like ``flat``
    gu = torch.einsum("nd,nid->ni", xs, w13[e].float()).to(w13.dtype).float()  # [T*K, 2I]
    gate, up = gu[:, :I], gu[:, I:]
    h = swiglu(gate, up, limit).to(w13.dtype).float()
    y = torch.einsum("ni,ndi->nd", h, w2[e].float())  # [T*K, D]
    y = y * (weights.reshape(-1).float() * routed.float()).unsqueeze(-1)
    return y.view(T, K, x.shape[1]).sum(dim=1)


# --------------------------------------------------------------------------------------
# gemv: dense projections of a few tokens (decode)
# --------------------------------------------------------------------------------------
def gemv(x: Tensor, weight: Tensor) -> Tensor:
    """``y[t, g] = weight[g] @ x[t, g]`` for ``x [T, G, K]``, ``weight [G, N, K]`` -> ``[T, G, N]``,
    accumulated in fp32 and rounded once to ``x``'s dtype (what ``F.linear`` in that dtype returns)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    return torch.einsum("tgk,gnk->tgn", x.to(acc), weight.to(acc)).to(x.dtype)
