"""A pure-PyTorch stand-in for FlashMLA's ``flash_mla`` (sparse FP8 decode, MODEL1 only), for CPU runs of
``benchmarks/bench_flashmla.py`` (``--flashmla tests/fake_flashmla``). Written from FlashMLA's documented
interface and its sm_90 kernel's addressing, NOT from our converter: it checks the arguments the way
``sparse_attn_decode_interface`` does, reads each index ``g`` of a cache at block ``g // page_block_size``,
slot ``t = g % page_block_size``, data at ``block * stride(0) + t * 576`` and the 8 scale bytes at
``block * stride(0) + page_block_size * 576 + t * 8``, and computes one softmax over the window's and the
extra cache's entries with the sink, in fp32 (``tests/ref.py``'s semantics). Returns ``(out bf16, lse)``."""
from __future__ import annotations

import torch

from dsv4_ops.reference import fp8_cache as fp8

DATA, SCALES, ENTRY = 576, 8, 584  # MODEL1: 448 e4m3 + 64 bf16 rope, 7 ue8m0 + 1 pad
LAYOUT = fp8.KVLayout(512, 64)
calls = []  # one dict a call, for tests


class SchedMeta:
    have_initialized = False
    config = None


def get_mla_metadata(*args, **kwargs):
    return SchedMeta(), None


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise RuntimeError(f"fake flash_mla: {what}")


def _gather(cache: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries of ``cache`` at global indices ``idx [B, S, K]``: fp32 ``[B, S, K, 512]`` and the valid mask."""
    _check(cache.dim() == 4 and cache.shape[2] == 1 and cache.shape[3] == ENTRY, f"k cache shape {tuple(cache.shape)}")
    _check(cache.dtype in (torch.float8_e4m3fn, torch.uint8, torch.int8), f"k cache dtype {cache.dtype}")
    _check(cache.stride(1) == ENTRY and cache.stride(3) == 1, "the whole block must be contiguous")
    _check(idx.dtype == torch.int32 and idx.stride(-1) == 1, "indices int32, last dim contiguous")
    _check(idx.shape[-1] % 64 == 0 and idx.shape[-1] > 0, f"topk {idx.shape[-1]} must be a positive multiple of 64")
    blocks, page = cache.shape[0], cache.shape[1]
    flat = cache.view(torch.uint8).as_strided((blocks * cache.stride(0),), (1,), cache.storage_offset())
    valid = idx != -1
    g = idx.long().clamp(min=0)
    _check(bool((g[valid] < blocks * page).all()), "index past the cache")
    base = (g // page) * cache.stride(0)
    t = g % page
    data = flat[(base + t * DATA)[..., None] + torch.arange(DATA)]
    scales = flat[(base + page * DATA + t * SCALES)[..., None] + torch.arange(SCALES)]
    return fp8.dequantize_kv(data, scales, LAYOUT), valid


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                           num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None,
                           attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                           extra_topk_length=None):
    _check(isinstance(tile_scheduler_metadata, SchedMeta) and num_splits is None, "metadata from get_mla_metadata")
    _check(indices is not None and is_fp8_kvcache and not causal, "sparse FP8 decode only")
    _check(block_table is None and cache_seqlens is None and topk_length is None and extra_topk_length is None,
           "this stand-in takes no block table, seqlens or topk lengths")
    _check(q.dtype == torch.bfloat16 and q.dim() == 4 and q.shape[3] == 512 and q.shape[2] == 64,
           f"q bf16 [b, s_q, 64, 512], got {q.dtype} {tuple(q.shape)}")
    _check(head_dim_v == 512, "head_dim_v must be 512")
    b, s_q, h_q, _ = q.shape
    _check(indices.shape[:2] == (b, s_q), "indices [b, s_q, topk]")
    _check(attn_sink is None or (attn_sink.dtype == torch.float32 and attn_sink.shape == (h_q,)),
           "attn_sink [h_q] fp32")
    e, valid = _gather(k_cache, indices)
    if extra_k_cache is not None:
        _check(extra_indices_in_kvcache is not None and extra_indices_in_kvcache.shape[:2] == (b, s_q), "extra indices")
        e2, v2 = _gather(extra_k_cache, extra_indices_in_kvcache)
        e, valid = torch.cat([e, e2], 2), torch.cat([valid, v2], 2)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    logits = torch.einsum("bshd,bskd->bshk", q.float(), e) * scale
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    lse = logits.logsumexp(-1)  # [b, s_q, h_q]
    p = torch.exp(logits - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bshk,bskd->bshd", p, e)
    if attn_sink is not None:
        out = out / (1 + torch.exp(attn_sink.view(1, 1, h_q) - lse))[..., None]
    out = out.nan_to_num(0.0)
    calls.append(dict(b=b, topk=indices.shape[-1], extra_topk=None if extra_indices_in_kvcache is None
                      else extra_indices_in_kvcache.shape[-1], block_stride=k_cache.stride(0)))
    return out.to(torch.bfloat16), lse.transpose(1, 2)
