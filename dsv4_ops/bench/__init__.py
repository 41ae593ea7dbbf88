"""Per-kernel benchmark of the ``torch.ops.dsv4`` ops (DESIGN.md §6): each op's Triton path
and its plain-PyTorch reference, timed on the same inputs, next to the op's roofline floor.

- ``roofline``: bytes / flops each kernel must move / do, and the floor they imply (pure).
- ``cases``: the decode grid (V4-Flash / V4-Pro widths x batch x context) and input builders.
- ``timing``: CUDA-graph replay timing with L2-cold input rotation (CPU: wall clock).
- ``report``: JSON, markdown table and plot.
- ``run``: the loop (memory planning, correctness check, progress) and the command line,
  used by ``python -m dsv4_ops bench`` and ``benchmarks/bench_ops.py``.

Nothing here is imported by ``import dsv4_ops``.
"""
