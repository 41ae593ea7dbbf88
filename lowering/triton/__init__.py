"""Triton kernels and raw launchers, one module per op family.

- ``sparse_attention``: MQA over window ∪ compressed entries with the sink, split-KV.
- ``indexer``: lightning-indexer scores + radix top-k with the reference tie rule.

Submodules are imported lazily by their users: importing this package does not import
Triton, so CPU-only installs without Triton can still import ``dsv4_ops``.
"""
