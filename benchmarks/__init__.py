"""Benchmark scripts and their helpers (DESIGN.md §6). Not part of the installed package.

Run from the repository root: ``python3 benchmarks/<script>.py ...`` (each script puts the
root on ``sys.path``); the GPU box runs them through ``bash benchmarks/gpu_check.sh MODE``.

- ``timing``: the one timer of every benchmark (kernel rows and public-call rows).
- ``kernel_bench``: the per-kernel grid (cases, roofline floors, report); ``bench_ops.py`` runs it.
- ``bench_model.py`` / ``bench_spec.py`` / ``profile_step.py``: the model through the public
  ``Generator`` / ``AOTIGenerator`` calls.
"""
