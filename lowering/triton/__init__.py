"""Triton kernels, their launch configurations and raw launchers, one module per op family.

- ``sparse_attention``: MQA over window ∪ compressed entries with the sink, split-KV.
- ``indexer``: lightning-indexer scores + radix top-k with the reference tie rule.
- ``plan``: all nine metadata tensors of a step in one launch.
- ``cache_write``: ring / pool row scatter by slot (-1 skipped).
- ``compress``: compressor emission fused with RMSNorm, RoPE and the pool write.
- ``sinkhorn``: the mHC mixing matrix's whole Sinkhorn loop in registers, one launch.
- ``gemv`` / ``moe_gemv``: decode-time dense projections and routed experts, streaming each
  weight once for a few tokens.
- ``fp8_codec``: the FP8 cache formats' encode / decode helpers (``@triton.jit``), shared by the
  readers and writers above.

Each module has ``*_launch`` / ``*_launches`` functions that return the outputs and the
:class:`~.launch.Launch` (grid, arguments, constexprs: pure functions of static shapes) of
each kernel; the ``triton_op`` bodies in ``dsv4_ops/ops`` launch those through
``wrap_triton(<kernel>)``. Every raw launcher (``sparse_attention``, ``indexer_topk``, ...)
has the reference op's signature plus ``out=`` where the op returns tensors, and launches
the same kernels directly (tests, benchmarks). Why each kernel is built as it is, with the
measurements behind its configuration: ``docs/kernels.md``.
"""
