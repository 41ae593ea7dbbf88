"""What the launch-configuration code of every kernel module shares.

Each module computes its launches as :class:`Launch` values (grid, arguments, constexprs and
compile options: pure functions of static shapes). The ``triton_op`` bodies in
``dsv4_ops/ops`` launch them as ``wrap_triton(<kernel>)[l.grid](*l.args, **l.meta)``, naming
the kernel literally so torch's kernel discovery (the AOTAutograd cache key) finds it; the
raw launchers here launch them directly with :func:`launch`.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch


class Launch(NamedTuple):
    """One launch of a known kernel: ``kernel[grid](*args, **meta)``."""

    grid: tuple
    args: tuple
    meta: dict


def launch(kernel, spec: Launch | None) -> None:
    """``kernel[spec.grid](*spec.args, **spec.meta)``; nothing for ``None`` (an empty launch)."""
    if spec is not None:
        kernel[spec.grid](*spec.args, **spec.meta)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a GPU device (static: read from the device properties, not
    from data); 132 (H100/H200) on a device without properties, e.g. the interpreter."""
    if device.type == "cuda" and torch.cuda.is_available():
        return _multiprocessors(device_index(device))
    return 132


def device_index(device: torch.device) -> int:
    """The index of a CUDA device (``cuda`` alone: the current one)."""
    return device.index if device.index is not None else torch.cuda.current_device()


# device properties, read once per device: a query costs microseconds on every eager launch
@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def capability(index: int) -> tuple[int, int]:
    """``(major, minor)`` compute capability of CUDA device ``index``."""
    return tuple(torch.cuda.get_device_capability(index))


def block_table_args(block_table: torch.Tensor | None, pages: torch.Tensor, unused: torch.Tensor) -> tuple:
    """A launch's block-table arguments ``(pointer, num_pages, stride_b, stride_p)`` for ``pages
    [num_pages, page, ...]``; without a block table (the per-row layout) ``unused``, any tensor of
    the launch, stands in for the pointer the kernel's constexpr switch never reads, and the rest are 0."""
    if block_table is None:
        return unused, 0, 0, 0
    return block_table, pages.shape[0], *block_table.stride()


def entries(keys: torch.Tensor, block_table: torch.Tensor | None = None) -> int:
    """Entries of a row of a key pool: ``N`` of ``[B, N, DI]``, ``pages * page`` of an FP8 one;
    ``P * page`` of pages ``[num_pages, page, ...]`` through ``block_table [B, P]``."""
    if block_table is not None:
        return block_table.shape[1] * keys.shape[1]
    return keys.shape[1] * keys.shape[2] if keys.dim() == 4 else keys.shape[1]


def cached_config(config: Callable[..., dict]) -> Callable[..., dict]:
    """Memoise a launch-configuration function (a pure function of ints, strings and dtypes)
    for eager calls, which otherwise recompute it on every launch; each call gets its own copy
    of the dict. An argument that cannot be hashed (a SymInt while tracing with dynamic
    shapes) computes the configuration afresh."""
    memo = functools.lru_cache(maxsize=1024)(config)

    @functools.wraps(config)
    def cached(*args, **kwargs) -> dict:
        try:
            return dict(memo(*args, **kwargs))
        except TypeError:
            return config(*args, **kwargs)

    return cached


def backend() -> str:
    """``"hip"`` on a ROCm build of torch, else ``"cuda"`` (static, decided by the build)."""
    return "hip" if torch.version.hip else "cuda"
