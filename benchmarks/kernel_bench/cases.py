"""The decode benchmark grid and each case's inputs, with the dtypes the model uses.

One case = one op at one (widths, batch, context). Every query is the LAST token of a context
of ``ctx`` tokens (position ``ctx - 1``, already in the cache), so it sees the full context:
window ``W`` = all ring slots, CSA ``ctx/4`` compressed entries (the indexer scores all of them,
attention reads its top-k), HCA ``ctx/128`` entries, and the step closes one block per row
for every compressor. Inputs are random (never zeros), indices valid and distinct by
construction; ``make`` also runs on the ``meta`` device, which sizes a case without memory.

The ops that read the KV cache (``sparse_attention``, ``indexer_topk``) also have FP8-cache cases
(``cache="fp8"``, the model's ``kv_cache_dtype="fp8"``): the caches are random bf16 entries put
through the reference quantiser (``dsv4_ops/reference/fp8_cache.py``), so every code and scale is
one the model could have written, in the pages the model allocates.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

import torch

from dsv4_ops.reference import fp8_cache as fp8

from . import roofline as rl

ACT = torch.bfloat16  # q, kv, pools, indexer keys (model dtype)
RING = torch.float32  # compressor-input rings and new rows (the model keeps them in fp32)
NORM = torch.bfloat16  # RMSNorm weight (a model parameter)
ROPE = torch.float32  # cos / sin tables
WEIGHTS = torch.float32  # indexer per-head weights (the model folds the scales in fp32)
I32 = torch.int32
KERNELS = ("sparse_attention", "indexer_topk", "compress", "plan", "cache_write", "sinkhorn")
CACHES = ("bf16", "fp8")  # KV-cache dtypes (the model's kv_cache_dtype); fp8 = FlashMLA's V4 layout
FP8_KERNELS = ("sparse_attention", "indexer_topk")  # the ops with FP8-cache cases: they read the cache


@dataclass(frozen=True)
class Dims:
    """Model widths a case is built from; V4 values unless noted (architecture.md §1.1)."""

    name: str
    heads: int  # H
    topk: int  # index_topk K
    head_dim: int = 512  # D, also the main compressor's entry width
    window: int = 128  # W; also the window ring slots (decode ring mode needs W + S - 1)
    csa_ratio: int = 4
    hca_ratio: int = 128
    index_heads: int = 64  # HI
    index_dim: int = 128  # DI, also the indexer compressor's entry width
    rope_half: int = 32  # rope dims / 2


FLASH = Dims("flash", heads=64, topk=512)
PRO = Dims("pro", heads=128, topk=1024)
# Small widths with the same structure, for the CPU smoke run (--tiny). head_dim 72 = 64 + 8 rope
# dims: the FP8 layout needs the non-rope part to be whole 64-value scale blocks.
TINY = {"flash": Dims("flash", heads=4, topk=8, head_dim=72, window=8, hca_ratio=16, index_heads=4, index_dim=16,
                      rope_half=4),
        "pro": Dims("pro", heads=8, topk=16, head_dim=72, window=8, hca_ratio=16, index_heads=4, index_dim=16,
                    rope_half=4)}


@dataclass
class Case:
    kernel: str  # name in torch.ops.dsv4 / dsv4_ops.reference.ops / dsv4_ops.ops
    variant: str  # "csa", "hca", "indexer", "window" or ""
    shape: str  # "flash", "pro", or "flash/pro" when the op's widths are the same for both
    batch: int
    ctx: int
    cost: rl.Cost
    params: dict  # the sizes that define the inputs (goes to the JSON)
    make: Callable[[torch.device], tuple] | None  # one copy of the op's arguments
    mutated: int | None = None  # index of the argument the op writes; None: it returns its output
    work_bytes: int = 0  # op scratch memory, upper estimate
    ref_work_bytes: int = 0  # reference peak temporaries, estimate
    skip: str | None = None  # reason the case cannot run at all
    cache: str = "bf16"  # KV-cache dtype the op reads ("bf16" or "fp8"); ops without an FP8 case: "bf16"

    @property
    def label(self) -> str:
        return f"{self.kernel} {self.variant}".strip()

    @property
    def seed(self) -> int:
        fp8_tag = "" if self.cache == "bf16" else f"|{self.cache}"  # bf16 cases keep the inputs of earlier runs
        return zlib.crc32(f"{self.label}|{self.shape}|{self.batch}|{self.ctx}{fp8_tag}".encode())


def _randn(shape, dtype, device) -> torch.Tensor:
    return torch.randn(shape, dtype=dtype, device=device)


def _distinct(batch: int, n: int, k: int, device) -> torch.Tensor:
    """``[B, 1, k] int32``: ``k`` distinct indices in ``[0, n)`` per row, in random order."""
    return torch.rand(batch, n, device=device).argsort(dim=-1)[:, :k].to(I32)[:, None, :]


def _fp8_cache(layout, B: int, n: int, quantise: Callable, width: int, device) -> torch.Tensor:
    """An FP8 paged cache ``uint8 [B, pages, page, entry_bytes]`` of ``n`` entries per row in
    ``layout`` (``fp8_cache.KVLayout`` / ``IndexerLayout``): random bf16 entries through
    ``quantise`` (the reference rule), every slot of every page filled, the last page's tail too."""
    cache = torch.empty(layout.shape(B, n), dtype=torch.uint8, device=device)
    if cache.device.type == "meta":  # sizing only: the per-row quantiser loop costs ~1 s at B=128 even on meta
        return cache
    for row in cache:  # one batch row at a time: the quantiser's fp32 temporaries stay small
        data, scales = quantise(_randn((row.shape[0] * layout.page, width), ACT, device))
        row.copy_(fp8.from_entries(torch.cat([data, scales], -1)[None], layout.page, layout.data_bytes)[0])
    return cache


def _paged(layout, n: int) -> int:
    """Entries an FP8 cache of ``n`` entries addresses: whole pages (``fp8_cache.entries``)."""
    return layout.shape(1, n)[1] * layout.page


def _fp8_kv(layout: fp8.KVLayout, B: int, n: int, device) -> torch.Tensor:
    return _fp8_cache(layout, B, n, lambda x: fp8.quantize_kv(x, layout.rope), layout.dim, device)


def _fp8_keys(layout: fp8.IndexerLayout, B: int, n: int, device) -> torch.Tensor:
    # the model stores indexer keys Hadamard-rotated (compress rotates, then quantises)
    return _fp8_cache(layout, B, n, lambda k: fp8.quantize_keys(fp8.rotate(k)), layout.dim, device)


def sparse_attention_case(d: Dims, variant: str, B: int, ctx: int, shape: str, cache: str = "bf16") -> Case:
    D, H, W = d.head_dim, d.heads, d.window
    csa = variant == "csa"
    nc = ctx // (d.csa_ratio if csa else d.hca_ratio)
    K, dense = (d.topk, 0) if csa else (0, nc)
    # FP8: the model's pages (AttentionModule.new_state): the window ring is ONE page of W entries,
    # a pool has fp8_cache.PAGE_SIZE entries a page (Nc rounds up to whole pages; the tail is never read)
    win8 = fp8.KVLayout(D, 2 * d.rope_half, W) if cache == "fp8" else None
    pool8 = fp8.KVLayout(D, 2 * d.rope_half) if cache == "fp8" else None

    def make(dev):
        q = _randn((B, 1, H, D), ACT, dev)
        # the window ring: W slots, all visible
        kv = _fp8_kv(win8, B, W, dev) if win8 else _randn((B, W, D), ACT, dev)
        kv_idx = _distinct(B, W, W, dev)
        cmp = _fp8_kv(pool8, B, nc, dev) if pool8 else _randn((B, nc, D), ACT, dev)
        cmp_idx = _distinct(B, nc, K, dev) if csa else torch.empty((B, 1, 0), dtype=I32, device=dev)
        cmp_len = torch.full((B, 1), dense, dtype=I32, device=dev)
        sink = _randn((H,), torch.float32, dev)
        return q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, D**-0.5

    # reference: fp32 copies of kv and cmp, [B, L, D] fp32 gather/cat/mask (it appends the whole
    # pool as a dense prefix whenever Nc > 0, also for CSA), ~6 live [B, H, L] fp32 logit tensors
    L = W + K + nc
    ref = 4 * B * (nc + W) * D + 3 * 4 * B * L * D + 6 * 4 * B * H * L
    params = dict(H=H, D=D, W=W, K=K, Nc=nc, dense=dense)
    if pool8:  # FP8: read_kv dequantises both caches first (byte rows, fp32 codes, scaled, out), freed before the rest
        ref = max(ref, B * (W + _paged(pool8, nc)) * (pool8.entry_bytes + 3 * 4 * D))
        params.update(entry_bytes=pool8.entry_bytes, page=pool8.page)
    return Case("sparse_attention", variant, shape, B, ctx,
                rl.sparse_attention_cost(B, H, D, W, K, dense, act_bytes=ACT.itemsize,
                                         entry_bytes=pool8.entry_bytes if pool8 else None),
                params, make,
                work_bytes=B * 16 * H * (D + 2) * 4,  # split-KV partials, at most 16 splits
                ref_work_bytes=ref,
                skip=None if nc >= K else f"ctx/{d.csa_ratio} = {nc} entries < top-k {K}: indices cannot be distinct",
                cache=cache)


def indexer_topk_case(d: Dims, B: int, ctx: int, shape: str, cache: str = "bf16") -> Case:
    HI, DI, N, k = d.index_heads, d.index_dim, ctx // d.csa_ratio, d.topk
    keys8 = fp8.IndexerLayout(DI) if cache == "fp8" else None  # fp8_cache.PAGE_SIZE keys a page, as the model's

    def make(dev):
        # random queries: the model rotates them for FP8 keys, but a rotated Gaussian is a Gaussian
        q = _randn((B, 1, HI, DI), ACT, dev)
        w = _randn((B, 1, HI), WEIGHTS, dev) * (HI * DI) ** -0.5
        keys = _fp8_keys(keys8, B, N, dev) if keys8 else _randn((B, N, DI), ACT, dev)
        visible = torch.full((B, 1), N, dtype=I32, device=dev)
        return q, w, keys, visible, k

    # reference: fp32 q and keys, [B, HI, N] fp32 dots / relu / weighted (3), sort values + int64 indices
    ref = 4 * B * N * DI + 3 * 4 * B * HI * N + 24 * B * N
    params = dict(HI=HI, DI=DI, N=N, topk=k)
    if keys8:  # FP8: read_keys dequantises first (byte rows, fp32 codes, scaled), freed before the scores
        ref = max(ref, B * _paged(keys8, N) * (keys8.entry_bytes + 3 * 4 * DI))
        params.update(entry_bytes=keys8.entry_bytes, page=keys8.page)
    return Case("indexer_topk", "", shape, B, ctx,
                rl.indexer_topk_cost(B, HI, DI, N, k, ACT.itemsize, WEIGHTS.itemsize, ACT.itemsize,
                                     key_entry_bytes=keys8.entry_bytes if keys8 else None),
                params, make, work_bytes=B * N * 4, ref_work_bytes=ref, cache=cache)


def compress_case(d: Dims, variant: str, B: int, ctx: int, shape: str) -> Case:
    """CSA (m=4, overlap, d=D), HCA (m=128, d=D) or the indexer's compressor (m=4, overlap, d=DI).
    The new token at position ``ctx - 1`` closes block ``ctx/m - 1``; the ring holds the
    block's (and, with overlap, the previous block's) earlier rows (the model's ring sizes)."""
    m = d.hca_ratio if variant == "hca" else d.csa_ratio
    overlap = variant != "hca"
    dim = d.index_dim if variant == "indexer" else d.head_dim
    c = 2 if overlap else 1
    R, N, t, half = c * m, ctx // m, ctx - 1, d.rope_half

    def make(dev):
        ring_kv, ring_gate = _randn((B, R, c * dim), RING, dev), _randn((B, R, c * dim), RING, dev)
        new_kv, new_gate = _randn((B, 1, c * dim), RING, dev), _randn((B, 1, c * dim), RING, dev)
        start = torch.full((B,), t, dtype=I32, device=dev)
        emit = torch.full((B, 1), N - 1, dtype=I32, device=dev)
        norm_w = (1 + 0.1 * _randn((dim,), torch.float32, dev)).to(NORM)
        angle = torch.rand((ctx, half), device=dev) * 6.283185307179586
        cos, sin = angle.cos().to(ROPE), angle.sin().to(ROPE)
        pool = _randn((B, N, dim), ACT, dev)
        return ring_kv, ring_gate, new_kv, new_gate, start, emit, norm_w, cos, sin, pool, m, overlap, 1e-6

    # reference: pool padded by cat then copied back (2 pool-sized temporaries), small gathers
    ref = 2 * B * (N + 1) * dim * ACT.itemsize + 16 * B * c * m * c * dim * 4
    return Case("compress", variant, shape, B, ctx,
                rl.compress_cost(B, dim, m, overlap, half, 1, ring_bytes=RING.itemsize, norm_bytes=NORM.itemsize,
                                 rope_bytes=ROPE.itemsize, pool_bytes=ACT.itemsize),
                dict(d=dim, m=m, overlap=overlap, R=R, N=N), make, mutated=9, ref_work_bytes=ref,
                skip=None if ctx % m == 0 else f"ctx {ctx} is not a multiple of m = {m}: no block closes at ctx - 1")


def plan_case(d: Dims, B: int, ctx: int, shape: str) -> Case:
    W = d.window

    def make(dev):
        lengths = torch.full((B,), ctx - 1, dtype=I32, device=dev)
        n_new = torch.ones((B,), dtype=I32, device=dev)
        return lengths, n_new, 1, 1, W, W, False, d.csa_ratio, 2 * d.csa_ratio, d.hca_ratio, d.hca_ratio

    return Case("plan", "", shape, B, ctx, rl.plan_cost(B, W, d.csa_ratio, d.hca_ratio),
                dict(S=1, steps=1, W=W), make, ref_work_bytes=64 * B * W * 8)


def cache_write_case(d: Dims, B: int, ctx: int, shape: str) -> Case:
    """The new token's kv row into the window ring (slot ``(ctx - 1) % W``)."""
    W, D = d.window, d.head_dim

    def make(dev):
        cache = _randn((B, W, D), ACT, dev)
        values = _randn((B, 1, D), ACT, dev)
        slots = torch.full((B, 1), (ctx - 1) % W, dtype=I32, device=dev)
        return cache, values, slots

    return Case("cache_write", "window", shape, B, ctx, rl.cache_write_cost(B, D, ACT.itemsize),
                dict(R=W, C=D), make, mutated=0, ref_work_bytes=2 * B * (W + 1) * D * ACT.itemsize)


def sinkhorn_case(d: Dims, B: int, ctx: int, shape: str, hc_mult: int = 4, iters: int = 20) -> Case:
    """One mHC site's Sinkhorn for the step's token of every row (V4: hc_mult 4, 20 iterations)."""

    def make(dev):
        comb = (torch.rand((B, 1, hc_mult, hc_mult), device=dev) * 3).softmax(-1) + 1e-6
        return comb, iters, 1e-6

    return Case("sinkhorn", "", shape, B, ctx, rl.sinkhorn_cost(B, hc_mult), dict(N=hc_mult, iters=iters), make,
                ref_work_bytes=4 * 4 * B * hc_mult * hc_mult * 4)


def grid(dims: list[Dims], kernels: tuple[str, ...], batches: list[int], contexts: list[int],
         caches: tuple[str, ...] = ("bf16",)) -> list[Case]:
    """Every case, kernel-major. Ops whose widths do not depend on H / top-k (compress, plan,
    cache_write, sinkhorn) run once, labelled with every requested shape (e.g. ``flash/pro``).
    The ops that read the KV cache (``FP8_KERNELS``) run once per cache dtype in ``caches``, the
    dtypes side by side; the others have no FP8 case and run once, bf16, whatever ``caches`` says."""
    unknown = set(caches) - set(CACHES)
    if unknown:
        raise ValueError(f"unknown cache dtype {sorted(unknown)}; choose from {CACHES}")
    shared = "/".join(d.name for d in dims)
    out = []
    for kernel in kernels:
        for ctx in contexts:
            for B in batches:
                if kernel == "sparse_attention":
                    out += [sparse_attention_case(d, v, B, ctx, d.name, c) for v in ("csa", "hca") for d in dims
                            for c in caches]
                elif kernel == "indexer_topk":
                    out += [indexer_topk_case(d, B, ctx, d.name, c) for d in dims for c in caches]
                elif kernel == "compress":
                    out += [compress_case(dims[0], v, B, ctx, shared) for v in ("csa", "hca", "indexer")]
                elif kernel == "plan":
                    out.append(plan_case(dims[0], B, ctx, shared))
                elif kernel == "cache_write":
                    out.append(cache_write_case(dims[0], B, ctx, shared))
                elif kernel == "sinkhorn":
                    out.append(sinkhorn_case(dims[0], B, ctx, shared))
                else:
                    raise ValueError(f"unknown kernel {kernel!r}; choose from {KERNELS}")
    return out


def alloc_bytes(case: Case) -> int:
    """Bytes of one copy of the case's inputs, from building it on the meta device."""
    return sum(a.nbytes for a in case.make(torch.device("meta")) if isinstance(a, torch.Tensor))
