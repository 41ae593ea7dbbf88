"""Gluon (Triton's explicit-layout dialect) kernels for what ``tl`` cannot express.

``sparse_attention``: bf16 decode attention on sm_90, reached through the opaque op
``dsv4::sparse_attention_sm90`` (``dsv4_ops/ops/attention_sm90.py``) that ``dsv4::sparse_attention``
routes to; the Triton kernel stays the fallback everywhere else and in AOTInductor packages.
``sparse_attention_fp8``: the same pipeline reading FP8 caches, routed to by the same op from
batch 64 on (H200, session 13: faster than the Triton FP8 kernel there, slower at batch 1)."""
