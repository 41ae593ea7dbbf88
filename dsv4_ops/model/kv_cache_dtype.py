"""``kv_cache_dtype``: what the KV pool stores, checked once where a cache is configured
(``setup_caches``, ``Generator``, ``export``) with an error that names the argument.

* ``"auto"`` (default): the ``dtype`` given, else the model's dtype (bf16 for a bf16 model).
* ``"bf16"``: bfloat16 window rings and pools.
* ``"fp8"``: FlashMLA's FP8 V4 layout for the window rings and compressed pools, FP8 indexer
  keys (``dsv4_ops/reference/fp8_cache.py``). Read by the Triton kernels (CUDA / ROCm) and by the
  reference (CPU); it needs ``head_dim - rope_head_dim`` to be a multiple of 64 (one ue8m0
  scale per 64 values) and a power-of-two ``index_head_dim`` (the Hadamard rotation).

The compressor-input rings stay fp32 whatever the choice (they are state, not cache).
"""
from __future__ import annotations

import torch

from ..config import CSA, DSV4Config
from ..reference.fp8_cache import QUANT_BLOCK

__all__ = ["KV_CACHE_DTYPES", "FP8_DEVICES", "check_kv_cache_dtype"]

KV_CACHE_DTYPES = ("auto", "bf16", "fp8")
FP8_DEVICES = ("cpu", "cuda")  # the reference (cpu, any backend) and the Triton kernels (cuda = CUDA and ROCm)


def check_kv_cache_dtype(where: str, value, cfg: DSV4Config, device: torch.device) -> str:
    """Return ``value`` if it is a usable cache dtype for this model and device, else raise
    ``ValueError`` naming ``where`` (e.g. ``"setup_caches: kv_cache_dtype"``)."""
    if not isinstance(value, str) or value not in KV_CACHE_DTYPES:
        raise ValueError(f"{where} must be one of {KV_CACHE_DTYPES}, got {value!r}")
    if value != "fp8":
        return value
    if torch.device(device).type not in FP8_DEVICES:
        raise ValueError(f"{where}='fp8': no kernel reads the FP8 cache on device {torch.device(device).type!r} "
                         f"(supported: {FP8_DEVICES}); use kv_cache_dtype='bf16'")
    nope = cfg.head_dim - cfg.rope_head_dim
    if nope % QUANT_BLOCK:
        raise ValueError(f"{where}='fp8' needs head_dim - rope_head_dim to be a multiple of {QUANT_BLOCK} "
                         f"(one ue8m0 scale per {QUANT_BLOCK} values), got {cfg.head_dim} - {cfg.rope_head_dim} = {nope}")
    di = cfg.index_head_dim
    if CSA in cfg.layer_types and (di < 1 or di & (di - 1)):
        raise ValueError(f"{where}='fp8' needs a power-of-two index_head_dim (Hadamard-rotated FP8 indexer keys), "
                         f"got {di}")
    return value
