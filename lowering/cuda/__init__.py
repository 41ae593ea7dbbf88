"""CUDA C++ kernels (sources in ``csrc/kernels``), built with nvcc on first use and called through
opaque ``torch.ops.dsv4`` ops; Triton stays the fallback wherever they cannot be built.

``topk_rows``: the indexer's top-k over score rows (``dsv4::topk_rows_cuda``)."""
