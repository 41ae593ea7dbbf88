"""RoPE frequency tables for DeepSeek-V4, bit-identical to HF transformers.

V4 rotates the LAST ``rope_dim`` channels of a vector in interleaved pairs (see
``ops.apply_rope``), so a table holds one angle per pair: ``[max_pos, rope_dim // 2]``.

Two tables exist per model (architecture.md §2):
* "main" (sliding-window-only layers): ``theta = rope_theta`` (10000), no scaling;
* "compress" (CSA / HCA layers: queries, window keys, compressed entries, indexer):
  ``theta = compress_rope_theta`` (160000) with YaRN (factor 16, original context
  65536, beta_fast 32, beta_slow 1) and NO attention / mscale factor.

The arithmetic below repeats HF's fp32 operations in the same order
(``_compute_yarn_parameters`` / ``compute_default_rope_parameters`` and
``DeepseekV4RotaryEmbedding.forward``: ``freqs = position.float() * inv_freq``), so the
tables equal HF's cos/sin exactly, not merely to a tolerance.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["rope_inv_freq", "rope_tables"]


def _yarn_inv_freq(theta: float, dim: int, yarn: dict) -> Tensor:
    factor = float(yarn["factor"])
    original = yarn["original_max_position_embeddings"]
    # HF treats 0/None as "use the default" (`x or 32`), so do we.
    beta_fast = yarn.get("beta_fast") or 32
    beta_slow = yarn.get("beta_slow") or 1
    # HF reads `truncate` from the TOP-level rope_parameters ({"main", "compress"} for V4),
    # so for V4 it is always the default True; kept as a knob for completeness.
    truncate = yarn.get("truncate", True)

    def correction_dim(num_rotations: float) -> float:
        # pair-dimension at which a frequency completes `num_rotations` turns over `original`
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp

    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs  # unscaled (high-frequency pairs)
    interpolation = 1.0 / (factor * pos_freqs)  # divided by `factor` (low-frequency pairs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1 = pure extrapolation, 0 = pure interpolation
    return interpolation * (1 - keep) + extrapolation * keep


def rope_inv_freq(theta: float, rope_dim: int, yarn: dict | None = None) -> Tensor:
    """fp32 ``[rope_dim // 2]`` inverse frequencies; ``yarn`` = None for plain RoPE.

    ``yarn`` keys: ``factor``, ``original_max_position_embeddings``, optional ``beta_fast``
    (32), ``beta_slow`` (1), ``truncate`` (True).
    """
    if rope_dim <= 0 or rope_dim % 2:
        raise ValueError(f"rope_dim must be a positive even number, got {rope_dim}")
    if yarn is None:
        return 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim))
    return _yarn_inv_freq(theta, rope_dim, yarn)


def rope_tables(
    theta: float,
    rope_dim: int,
    max_pos: int,
    yarn: dict | None = None,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """``(cos, sin)``, each fp32 ``[max_pos, rope_dim // 2]``: row ``p`` = angles of position ``p``.

    ``yarn`` may carry ``attention_factor``; V4 pins it to 1.0 (HF's config injects
    ``attention_factor=1.0`` for the compress rope), and any other value scales cos/sin
    exactly as HF would.
    """
    inv_freq = rope_inv_freq(theta, rope_dim, yarn)
    positions = torch.arange(max_pos, dtype=torch.int64)
    freqs = positions[:, None].float() * inv_freq
    cos, sin = freqs.cos(), freqs.sin()
    scale = 1.0 if yarn is None else yarn.get("attention_factor", 1.0)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(device), sin.to(device)
