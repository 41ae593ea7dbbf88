"""Gluon (Triton's explicit-layout dialect) kernels for what ``tl`` cannot express.

The sm_90 decode attention reached through the opaque op ``dsv4::sparse_attention_sm90``
(``dsv4_ops/ops/attention_sm90.py``), which ``dsv4::sparse_attention`` routes to; the Triton kernel
stays the fallback everywhere else and in AOTInductor packages:

- ``sparse_attention``: over bf16 caches (a producer partition gathers the rows);
- ``sparse_attention_fp8``: over FP8 pages (a decoder partition copies and decodes them);
- ``mma_partitions``: the scoring and accumulating warpgroups both kernels run;
- ``common``: the entry list, splits, epilogue, checks and launch assembly they share."""
