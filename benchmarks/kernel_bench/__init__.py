"""Per-kernel benchmark of the ``torch.ops.dsv4`` ops (DESIGN.md §6): each op's Triton path
and its plain-PyTorch reference, timed on the same inputs, next to the op's roofline floor.

- ``roofline``: bytes / flops each kernel must move / do, and the floor they imply (pure).
- ``cases``: the decode grid (V4-Flash / V4-Pro widths x batch x context) and input builders.
- ``report``: JSON, markdown table and plot.
- ``run``: the loop (memory planning, correctness check, progress) and the command line of
  ``benchmarks/bench_ops.py``. Timing: ``benchmarks/timing.py`` (``kernel_time``).
"""
