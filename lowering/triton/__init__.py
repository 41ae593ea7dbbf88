"""Triton kernels and raw launchers, one module per op family.

- ``sparse_attention``: MQA over window ∪ compressed entries with the sink, split-KV.
- ``indexer``: lightning-indexer scores + radix top-k with the reference tie rule.
- ``plan``: all nine metadata tensors of a step in one launch.
- ``cache_write``: ring / pool row scatter by slot (-1 skipped).
- ``compress``: compressor emission fused with RMSNorm, RoPE and the pool write.
- ``sinkhorn``: the mHC mixing matrix's whole Sinkhorn loop in registers, one launch.

Every launcher has the reference op's signature plus ``out=`` (where the op returns tensors)
and ``wrap=`` (launch through ``torch.library.wrap_triton``, as the ``triton_op`` bodies in
``dsv4_ops/ops`` do).

Submodules are imported lazily by their users: importing this package does not import
Triton, so CPU-only installs without Triton can still import ``dsv4_ops``.
"""
