"""FP8 cache test inputs, in the layouts of ``dsv4_ops/reference/fp8_cache.py``: byte buffers poisoned
with a byte no write in the tests produces for a whole entry, and caches whose every entry was written
by the reference (``fp8_kv_cache``, ``write_index_keys``)."""
import torch

from dsv4_ops.reference import fp8_cache as fp8
from dsv4_ops.reference import ops as ref

POISON = 0xA5


def poisoned(shape, device="cpu", byte=POISON) -> torch.Tensor:
    """A uint8 buffer of ``shape`` filled with ``byte``."""
    return torch.full(shape, byte, dtype=torch.uint8, device=device)


def all_slots(B, n, device):
    """Slots 0 .. n-1 for each of ``B`` rows: int32 ``[B, n]``."""
    return torch.arange(n, dtype=torch.int32, device=device).expand(B, n).contiguous()


def fp8_kv_cache(values, rope, page):
    """``[B, n, D]`` values in an FP8 KV cache of ``n`` entries in pages of ``page`` (FlashMLA's layout),
    written by the reference ``cache_write`` into a poisoned buffer."""
    B, n, D = values.shape
    cache = poisoned(fp8.KVLayout(D, rope, page).shape(B, n), values.device)
    ref.cache_write(cache, values, all_slots(B, n, values.device))
    return cache


def write_index_keys(keys, values):
    """``[B, N, DI]`` values into the FP8 indexer-key cache ``keys`` (Hadamard-rotated, then quantised),
    every entry; returns ``keys``."""
    B, N, _ = values.shape
    ref._write_entries_fp8(keys, values, all_slots(B, N, values.device))
    return keys
