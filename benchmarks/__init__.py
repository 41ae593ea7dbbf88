"""The benchmark scripts of BENCHMARKS.md and their helpers (DESIGN.md §6); README.md lists them. Not part of the
installed package: run them from the repository root (``python3 benchmarks/<script>.py``)."""
