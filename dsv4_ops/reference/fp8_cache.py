"""The FP8 KV-cache formats and their ONE quantisation rule, in plain PyTorch.

Two paged formats, both "footer" layouts: a page holds ``page`` entries, all their data rows
first, then all their scale rows, so a kernel reads a page's data with one contiguous stride.

**KV (window rings, CSA / HCA compressed pools)** -- FlashMLA's DeepSeek-V4 "MODEL1" layout
(``anchors_kernels_hf_aoti_tp.md``), generalised to any ``dim = nope + rope`` with
``nope % 64 == 0``. Per entry: ``nope`` e4m3 bytes, then ``rope`` bf16 values (little-endian,
``2 * rope`` bytes) = ``data_bytes`` (576 at V4's 448 + 64); its scales are ``nope / 64`` ue8m0
bytes padded to a multiple of 8 (7 + 1 pad = 8 at V4). Entry ``i`` of a row lives in page
``i // page``, slot ``t = i % page``: data at ``page_base + t * data_bytes``, scales at
``page_base + page * data_bytes + t * scale_bytes`` (FlashMLA's ``block_base + bs*576 + t*8``).
The tensor is ``uint8 [B, pages, page, entry_bytes]`` (FlashMLA passes ``[blocks, bs, 1, 584]``):
its shape carries ``page`` and ``entry_bytes``, NOT a row-per-entry layout. A paged pool (read and
written through a block table, ``dsv4_ops/reference/ops.py``) is ``uint8 [num_pages, page,
entry_bytes]``: the same pages without the row dim. Its page stride may exceed ``page *
entry_bytes`` (FlashMLA pads every page to a multiple of 576 bytes); only the bytes of a page's
entries and footer are ever read or written.

**Indexer keys** (CSA layers) -- DeepGEMM's paged FP8 indexer layout: keys are Hadamard-rotated
(``H / sqrt(DI)``, Sylvester order; orthonormal, so ``q . k`` is kept when the queries are rotated
too), then ``DI`` e4m3 bytes per entry and one fp32 scale (4 bytes, a power of two) in the page
footer: ``uint8 [B, pages, page, DI + 4]``.

**The quantisation rule** (DeepSeek's ``act_quant`` with ue8m0 scales): per block of values,
``s = 2 ** ceil(log2(max(amax, 1e-4) / 448))`` -- the smallest power of two with
``amax / s <= 448`` -- computed EXACTLY from amax's exponent and mantissa bits (no rounded
division; FlashMLA's test packer clamps ``amax / 448`` at 1e-4 instead, which only differs for
blocks with ``amax < 0.0448``); codes ``e4m3fn(round_to_nearest_even(x / s))`` (``x / s`` is
exact: ``s`` is a power of two, and ``|x / s| <= 448`` so nothing saturates). ue8m0 byte =
``log2(s) + 127``. RoPE dims are rounded to bf16 (nearest-even). Decoding is exact:
``code * s`` is representable in bf16 and fp32. The Triton kernels
(``lowering/triton/fp8_codec.py``) implement the same rule with integer ops and are tested bit
for bit against these functions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["QUANT_BLOCK", "FP8_MAX", "AMAX_FLOOR", "PAGE_SIZE", "KVLayout", "IndexerLayout", "scale_exponent",
           "quantize_kv", "dequantize_kv", "simulate_kv", "quantize_keys", "dequantize_keys", "simulate_keys",
           "simulate_queries",
           "rotate", "to_entries", "from_entries", "read_kv", "read_keys", "is_fp8_cache", "entries"]

QUANT_BLOCK = 64  # nope values per ue8m0 scale (KV format)
FP8_MAX = 448.0  # largest e4m3fn value
AMAX_FLOOR = 1e-4  # amax floor of DeepSeek's act_quant: an all-zero block gets a finite scale
PAGE_SIZE = 64  # default entries per page: FlashMLA's c4 `extra_block_size`, vLLM's block, SGLang's c4 page


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVLayout:
    """Byte layout of an FP8 KV entry (see the module docstring)."""

    dim: int
    rope: int
    page: int = PAGE_SIZE

    def __post_init__(self):
        if self.nope < 0 or self.nope % QUANT_BLOCK or self.rope < 0 or self.page < 1:
            raise ValueError(f"FP8 KV layout: dim - rope = {self.nope} must be a non-negative multiple of "
                             f"{QUANT_BLOCK} (got dim={self.dim}, rope={self.rope}) and page >= 1 (got {self.page})")

    @property
    def nope(self) -> int:
        return self.dim - self.rope

    @property
    def blocks(self) -> int:
        return self.nope // QUANT_BLOCK

    @property
    def data_bytes(self) -> int:
        return self.nope + 2 * self.rope

    @property
    def scale_bytes(self) -> int:
        return _cdiv(self.blocks, 8) * 8

    @property
    def entry_bytes(self) -> int:
        return self.data_bytes + self.scale_bytes

    def shape(self, batch: int, entries: int) -> tuple[int, int, int, int]:
        """Cache shape for ``entries`` entries per row (rounded up to whole pages)."""
        return (batch, max(1, _cdiv(entries, self.page)), self.page, self.entry_bytes)

    @staticmethod
    def of(cache: Tensor, dim: int) -> "KVLayout":
        """The layout of a ``[B, pages, page, entry_bytes]`` cache (or ``[num_pages, page,
        entry_bytes]`` pages) of ``dim``-wide entries (the rope width follows from
        ``entry_bytes``: it falls strictly as nope grows)."""
        page, eb = cache.shape[-2], cache.shape[-1]
        for nope in range(0, dim + 1, QUANT_BLOCK):
            lay = KVLayout(dim, dim - nope, page)
            if lay.entry_bytes == eb:
                return lay
        raise ValueError(f"an FP8 KV cache of {dim}-wide entries has no layout with {eb} bytes per entry")


@dataclass(frozen=True)
class IndexerLayout:
    """Byte layout of an FP8 indexer-key entry: ``dim`` e4m3 bytes + one fp32 scale."""

    dim: int
    page: int = PAGE_SIZE

    def __post_init__(self):
        if self.dim < 1 or self.dim & (self.dim - 1) or self.page < 1:
            raise ValueError(f"FP8 indexer keys: index_head_dim = {self.dim} must be a power of two "
                             f"(Hadamard rotation) and page >= 1 (got {self.page})")

    data_bytes = property(lambda self: self.dim)
    scale_bytes = property(lambda self: 4)
    entry_bytes = property(lambda self: self.dim + 4)
    shape = KVLayout.shape  # reads only page and entry_bytes

    @staticmethod
    def of(cache: Tensor) -> "IndexerLayout":
        return IndexerLayout(cache.shape[-1] - 4, cache.shape[-2])


def is_fp8_cache(t: Tensor, paged: bool = False) -> bool:
    """An FP8 cache is a uint8 tensor: rank 4 ``[B, pages, page, entry_bytes]`` per row, rank 3
    ``[num_pages, page, entry_bytes]`` when ``paged`` (addressed through a block table); float
    caches are rank 3 either way."""
    return t.dtype == torch.uint8 and t.dim() == (3 if paged else 4)


def entries(t: Tensor, block_table: Tensor | None = None) -> int:
    """Entries a row of a cache addresses: ``pages * page`` (FP8) or ``N`` of ``[B, N, C]``; through
    ``block_table [B, P]``, ``P * page`` of ``[num_pages, page, width]`` pages."""
    if block_table is not None:
        return block_table.shape[1] * t.shape[1]
    return t.shape[1] * t.shape[2] if is_fp8_cache(t) else t.shape[1]


# --------------------------------------------------------------------------------------
# the rule: scale exponent, e4m3 codes, bf16 rope
# --------------------------------------------------------------------------------------
def scale_exponent(amax: Tensor) -> Tensor:
    """ue8m0 byte (int32, ``log2(s) + 127``) of ``s = 2^ceil(log2(max(amax, 1e-4) / 448))``.

    Exact: with ``amax = 2^e * (1 + f)``, ``448 * 2^k = 2^(k+8) * 1.75`` bounds it iff
    ``k >= e - 8`` when ``f <= 0.75`` (mantissa bits <= 0x600000), else ``k >= e - 7``."""
    a = amax.float().clamp(min=AMAX_FLOOR)
    bits = a.view(torch.int32)
    e = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    return e - 8 + (mant > 0x600000).to(torch.int32)


def _pow2(exponent: Tensor) -> Tensor:
    """``2 ** (exponent - 127)`` as fp32 from a ue8m0 byte (1..254)."""
    return (exponent.to(torch.int32) << 23).view(torch.float32)


def _e4m3(x: Tensor, exponent: Tensor) -> Tensor:
    """e4m3fn codes (uint8) of ``x / s`` (``exponent`` broadcast over x's blocks)."""
    y = (x.float() * _pow2(254 - exponent)).clamp(-FP8_MAX, FP8_MAX)  # * 2^-k, exact
    return y.to(torch.float8_e4m3fn).view(torch.uint8)


def _bf16_bytes(x: Tensor) -> Tensor:
    """``[..., r]`` -> ``[..., 2r]`` little-endian bf16 bytes (round to nearest even)."""
    return x.to(torch.bfloat16).view(torch.uint8) if x.shape[-1] else x.new_zeros(*x.shape[:-1], 0, dtype=torch.uint8)


def quantize_kv(x: Tensor, rope: int) -> tuple[Tensor, Tensor]:
    """``[..., dim]`` -> ``(data uint8 [..., data_bytes], scales uint8 [..., scale_bytes])``."""
    lay = KVLayout(x.shape[-1], rope)
    nope = x[..., : lay.nope].float().unflatten(-1, (lay.blocks, QUANT_BLOCK))
    exp = scale_exponent(nope.abs().amax(-1))  # [..., blocks]
    codes = _e4m3(nope, exp[..., None]).flatten(-2)
    rope_bytes = _bf16_bytes(x[..., lay.nope:].float())
    scales = torch.zeros(*x.shape[:-1], lay.scale_bytes, dtype=torch.uint8, device=x.device)
    scales[..., : lay.blocks] = exp.to(torch.uint8)
    return torch.cat([codes, rope_bytes], -1), scales


def dequantize_kv(data: Tensor, scales: Tensor, lay: KVLayout) -> Tensor:
    """Inverse of :func:`quantize_kv`: fp32 ``[..., dim]`` (exact)."""
    codes = data[..., : lay.nope].contiguous().view(torch.float8_e4m3fn).float()
    s = _pow2(scales[..., : lay.blocks].to(torch.int32))
    nope = (codes.unflatten(-1, (lay.blocks, QUANT_BLOCK)) * s[..., None]).flatten(-2)
    rope = data[..., lay.nope:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], -1)


def simulate_kv(x: Tensor, rope: int) -> Tensor:
    """Quantise -> dequantise (what an FP8 KV cache gives back), in ``x.dtype``."""
    lay = KVLayout(x.shape[-1], rope)
    return dequantize_kv(*quantize_kv(x, rope), lay).to(x.dtype)


def rotate(x: Tensor) -> Tensor:
    """``x @ H / sqrt(d)`` over the last dim (``H`` the Sylvester Hadamard matrix,
    ``H[i, j] = (-1) ** popcount(i & j)``; symmetric, and orthonormal once scaled), fp32.

    Computed as the fast Walsh-Hadamard butterfly, stage ``h = 1, 2, 4, ...``: pairs
    ``(x[i], x[i + h])`` become ``(x[i] + x[i + h], x[i] - x[i + h])``, then one multiply by
    ``d^-0.5``. The Triton kernels run the same additions in the same order, so the rotated keys
    (and their FP8 codes) agree bit for bit."""
    d = x.shape[-1]
    y = x.float()
    h = 1
    while h < d:
        blocks = y.unflatten(-1, (d // (2 * h), 2, h))
        a, b = blocks[..., 0, :], blocks[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2).flatten(-3)
        h *= 2
    return y * d**-0.5


def quantize_keys(k: Tensor) -> tuple[Tensor, Tensor]:
    """Indexer keys ``[..., DI]`` (already rotated) -> ``(codes uint8 [..., DI], scale bytes [..., 4])``:
    one power-of-two scale for the whole key, stored as fp32."""
    exp = scale_exponent(k.float().abs().amax(-1, keepdim=True))
    codes = _e4m3(k, exp)
    # the fp32 scale 2^(exp - 127) has bits exp << 23: its 4 little-endian bytes, by shifts (a chain of
    # dtype views int32 -> fp32 -> uint8 fails to lower in torch 2.11's Inductor on CPU)
    bits = exp.to(torch.int32) << 23
    return codes, torch.cat([(bits >> shift) & 0xFF for shift in (0, 8, 16, 24)], -1).to(torch.uint8)


def dequantize_keys(codes: Tensor, scale_bytes: Tensor) -> Tensor:
    s = scale_bytes.contiguous().view(torch.float32)
    return codes.contiguous().view(torch.float8_e4m3fn).float() * s


def simulate_keys(k: Tensor) -> Tensor:
    """Rotate -> quantise -> dequantise (what the FP8 indexer cache holds), in ``k.dtype``."""
    return dequantize_keys(*quantize_keys(rotate(k))).to(k.dtype)


def simulate_queries(q: Tensor) -> Tensor:
    """Indexer queries as they meet FP8 keys: each head's ``DI`` values (already rotated) quantised
    by the keys' rule (one power-of-two scale a head, e4m3 codes) and dequantised, fp32.

    The serving engines score FP8 keys with FP8 queries (SGLang's and vLLM's fused q
    rope-Hadamard-quant, DeepGEMM's FP8 logits; DeepSeek's V3.2 ``act_quant`` of the indexer q), so
    the scores are an FP8 x FP8 dot, which the tensor cores run without decoding either side.
    Idempotent in value: a simulated query quantises to the same values again."""
    return dequantize_keys(*quantize_keys(q))


# --------------------------------------------------------------------------------------
# paged layout <-> one byte row per entry
# --------------------------------------------------------------------------------------
def to_entries(cache: Tensor, data_bytes: int) -> Tensor:
    """``[B, P, page, E]`` footer layout -> ``[B, P * page, E]`` rows ``data | scales`` (a copy)."""
    B, P, page, E = cache.shape
    flat = cache.reshape(B, P, page * E)
    data = flat[..., : page * data_bytes].reshape(B, P, page, data_bytes)
    scales = flat[..., page * data_bytes:].reshape(B, P, page, E - data_bytes)
    return torch.cat([data, scales], -1).reshape(B, P * page, E)


def from_entries(rows: Tensor, page: int, data_bytes: int) -> Tensor:
    """Inverse of :func:`to_entries`."""
    B, N, E = rows.shape
    r = rows.reshape(B, N // page, page, E)
    flat = torch.cat([r[..., :data_bytes].flatten(-2), r[..., data_bytes:].flatten(-2)], -1)
    return flat.reshape(B, N // page, page, E)


def read_kv(cache: Tensor, dim: int) -> Tensor:
    """Every entry of an FP8 KV cache, dequantised: fp32 ``[B, P * page, dim]``."""
    lay = KVLayout.of(cache, dim)
    rows = to_entries(cache, lay.data_bytes)
    return dequantize_kv(rows[..., : lay.data_bytes], rows[..., lay.data_bytes:], lay)


def read_keys(cache: Tensor) -> Tensor:
    """Every entry of an FP8 indexer-key cache, dequantised (still rotated): fp32 ``[B, P * page, DI]``."""
    lay = IndexerLayout.of(cache)
    rows = to_entries(cache, lay.data_bytes)
    return dequantize_keys(rows[..., : lay.data_bytes], rows[..., lay.data_bytes:])
