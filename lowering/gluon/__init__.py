"""Gluon (Triton's explicit-layout dialect) kernels for what ``tl`` cannot express.

``sparse_attention``: bf16 decode attention on sm_90, reached through the opaque op
``dsv4::sparse_attention_sm90`` (``dsv4_ops/ops/attention_sm90.py``) that ``dsv4::sparse_attention``
routes to; the Triton kernel stays the fallback everywhere else and in AOTInductor packages.
``sparse_attention_fp8``: the same pipeline reading FP8 caches (cross-compiled only, not routed
to until it has run on a GPU: ``benchmarks/gpu_check.sh gluon-fp8-check``)."""
