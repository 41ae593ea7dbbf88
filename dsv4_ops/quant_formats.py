"""Dequantisers for the weight formats of official DeepSeek-V4 checkpoints (pure functions).

* **FP8 block-scaled** linear weights: ``float8_e4m3fn`` ``[..., N, K]`` with one scale per
  ``(bn, bk)`` block (``weight_block_size``, 128x128 in the official checkpoints) of the last
  two dims: scale ``[..., ceil(N / bn), ceil(K / bk)]``. When ``N`` or ``K`` is not a
  multiple of the block, the last block row / column is partial and still has one scale.
  ``value = fp8 * scale`` (the scale is what HF calls ``weight_scale_inv``: the inverse of
  the factor the weight was multiplied by when it was quantised).
* **FP4 (e2m1) experts**: two e2m1 codes per byte, ``[..., N, K // 2]`` as ``int8`` /
  ``uint8`` or ``float4_e2m1fn_x2``; element ``2j`` in the LOW nibble of byte ``j``, element
  ``2j + 1`` in the high nibble (transformers' ``Fp8Dequantize._unpack_fp4`` and torch's
  ``float4_e2m1fn_x2`` agree). One scale per 32 consecutive values along the input dim:
  scale ``[..., N, ceil(K / 32)]``.
* **Scales** are ``float32`` or ue8m0: ``float8_e8m0fnu`` (or its raw bytes as ``uint8``),
  byte ``b`` meaning ``2 ** (b - 127)``; ``0xFF`` is NaN and is rejected.

Exactness: an e4m3 or e2m1 value times a power of two is exact in fp32, so with ue8m0 scales
the product is formed in fp32 and the cast to ``dtype`` is the only rounding. With fp32
scales the product (at most 4 + 24 significant bits) is formed in fp64, exact again, unless
``dtype`` is fp32 itself (then fp32's correctly rounded multiply is that one rounding).
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["E2M1_VALUES", "FP4_BLOCK", "decode_scale", "unpack_fp4", "dequantize_fp8", "dequantize_fp4",
           "fp8_scale_shape", "fp4_scale_shape", "SCALE_DTYPES", "FP4_DTYPES"]

# the 16 e2m1 codes: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP4_BLOCK = 32  # values per FP4 scale, along the input dim
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
_FP4X2 = getattr(torch, "float4_e2m1fn_x2", None)
SCALE_DTYPES = tuple(d for d in (torch.float32, _E8M0, torch.uint8) if d is not None)
FP4_DTYPES = tuple(d for d in (torch.int8, torch.uint8, _FP4X2) if d is not None)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fp8_scale_shape(weight_shape, block: tuple[int, int]) -> tuple[int, ...]:
    """The scale grid of an FP8 weight ``[..., N, K]``: ``[..., ceil(N/bn), ceil(K/bk)]``."""
    *lead, n, k = weight_shape
    return (*lead, _cdiv(n, block[0]), _cdiv(k, block[1]))


def fp4_scale_shape(shape, block: int = FP4_BLOCK) -> tuple[int, ...]:
    """The scale grid of an FP4 weight of logical (unpacked) shape ``[..., N, K]``."""
    *lead, n, k = shape
    return (*lead, n, _cdiv(k, block))


def decode_scale(scale: Tensor) -> Tensor:
    """fp32 scales from fp32, ``float8_e8m0fnu`` or ue8m0 bytes (``uint8``). Raises
    ``ValueError`` on a NaN / infinite scale."""
    if scale.dtype not in SCALE_DTYPES:
        raise ValueError(f"scale dtype {scale.dtype} is not a known scale format (float32, float8_e8m0fnu, uint8)")
    if scale.dtype != torch.float32:
        if bool((scale.view(torch.uint8) == 255).any()):
            raise ValueError("ue8m0 scale has the NaN code 0xFF")
        # byte b -> 2 ** (b - 127), b in 0..254: all fp32 numbers (2**-127 a subnormal)
        scale = scale.view(_E8M0).to(torch.float32)
    elif not bool(torch.isfinite(scale).all()):
        raise ValueError("scale has non-finite values")
    return scale


def unpack_fp4(packed: Tensor) -> Tensor:
    """``[..., K // 2]`` packed e2m1 pairs -> fp32 ``[..., K]`` (low nibble first)."""
    if packed.dtype not in FP4_DTYPES:
        raise ValueError(f"FP4 weights must be int8 / uint8 / float4_e2m1fn_x2, got {packed.dtype}")
    b = packed.view(torch.uint8)
    # byte -> its (low nibble, high nibble) values: one table lookup per byte. index_select:
    # plain `table[codes]` has a ~5 ms fixed cost per call on CPU
    pairs = _PAIRS.get(b.device)
    if pairs is None:
        pairs = _PAIRS[b.device] = torch.tensor(E2M1_VALUES, device=b.device)[_BYTE_NIBBLES.to(b.device)]
    return pairs.index_select(0, b.flatten().int()).view(*b.shape[:-1], 2 * b.shape[-1])


_BYTE_NIBBLES = torch.stack([torch.arange(256) & 0xF, torch.arange(256) >> 4], dim=-1)  # [256, 2]
_PAIRS: dict = {}


def _apply(values: Tensor, scale: Tensor, bn: int, bk: int, dtype: torch.dtype) -> Tensor:
    exact_in_fp32 = scale.dtype != torch.float32 or dtype == torch.float32
    work = torch.float32 if exact_in_fp32 else torch.float64
    s, v = decode_scale(scale).to(work), values.to(work)
    n, k = v.shape[-2:]
    if n % bn == 0 and k % bk == 0:  # whole blocks: broadcast each scale over its block
        blocks = v.unflatten(-1, (k // bk, bk)).unflatten(-3, (n // bn, bn))  # [..., n/bn, bn, k/bk, bk]
        out = (blocks * s[..., :, None, :, None]).flatten(-2).flatten(-3, -2)
    else:  # one scale per element; the last block row / column is partial
        out = v * s.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return out.to(dtype) if exact_in_fp32 else _round_once(out, dtype)


def _round_once(x: Tensor, dtype: torch.dtype) -> Tensor:
    """fp64 -> ``dtype`` (bf16 / fp16) with ONE rounding. torch converts fp64 to bf16 through
    fp32, which can double-round; rounding to fp32 "to odd" first (truncate, then set the last
    bit if anything was cut off) keeps the information the second rounding needs, since fp32
    has at least 2 more significant bits than bf16 or fp16."""
    if dtype == torch.float64:
        return x
    t = x.to(torch.float32)
    inexact = t.double() != x
    t = torch.where(inexact & (t.double().abs() > x.abs()), torch.nextafter(t, torch.zeros_like(t)), t)
    t = (t.view(torch.int32) | inexact.to(torch.int32)).view(torch.float32)
    return t.to(dtype)


def _check_scale(what: str, scale: Tensor, want: tuple[int, ...]) -> None:
    if tuple(scale.shape) != tuple(want):
        raise ValueError(f"{what}: scale has shape {tuple(scale.shape)}, expected {tuple(want)}")


def dequantize_fp8(weight: Tensor, scale: Tensor, block: tuple[int, int] = (128, 128),
                   dtype: torch.dtype = torch.float32) -> Tensor:
    """``float8_e4m3fn [..., N, K]`` with block scales ``[..., ceil(N/bn), ceil(K/bk)]`` ->
    ``dtype [..., N, K]``. Raises ``ValueError`` on a wrong weight dtype or scale shape."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 weights must be float8_e4m3fn, got {weight.dtype}")
    if weight.dim() < 2:
        raise ValueError(f"FP8 weights must have at least 2 dims, got shape {tuple(weight.shape)}")
    _check_scale("FP8 weight", scale, fp8_scale_shape(weight.shape, block))
    return _apply(weight.to(torch.float32), scale, block[0], block[1], dtype)


def dequantize_fp4(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32,
                   block: int = FP4_BLOCK) -> Tensor:
    """Packed e2m1 ``[..., N, K // 2]`` with scales ``[..., N, ceil(K / block)]`` -> ``dtype
    [..., N, K]``. Raises ``ValueError`` on a wrong weight dtype or scale shape."""
    values = unpack_fp4(packed)
    if values.dim() < 2:
        raise ValueError(f"FP4 weights must have at least 2 dims, got shape {tuple(packed.shape)}")
    _check_scale("FP4 weight", scale, fp4_scale_shape(values.shape, block))
    return _apply(values, scale, 1, block, dtype)
