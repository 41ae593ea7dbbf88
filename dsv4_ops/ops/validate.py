"""Boundary checks for the public op wrappers (DESIGN.md rule 7).

Every message names the op, the argument, what was expected and what was given.
Metadata checks (dtype, rank, matching dims, device, static ints) are plain Python on
shapes, so they also run while ``torch.compile`` traces a wrapper. Value checks read
device data and sync the host, so they run only in eager mode on real tensors
(:func:`reads_values`); they keep out-of-range indices from ever reaching a kernel.
All checks raise ``ValueError``.

What an eager call pays (#47): the metadata checks run once per signature -- shapes, dtypes
and devices of the tensors, the other arguments' values -- since they read nothing else
(:func:`once_per_signature`); the value checks of one call are computed on the device and read
back together, one host read a call (:func:`run_value_checks`), and only a failed check runs
its detailed form, which finds the offending element for the message.

On a GPU those value checks cost more than the op (a few small launches and a sync that waits for
the queued work): a caller whose indices come from ``plan`` or its own tested code turns them off
with :func:`value_checks` and keeps the metadata checks. The raw ops stay memory-safe without them
(each op's docstring says what it does with out-of-range values: skipped, clamped, counted as 0).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, NamedTuple

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from ..reference.fp8_cache import entries  # noqa: F401  (the ops' checks count a cache's entries with it)


def fail(op: str, msg: str) -> None:
    raise ValueError(f"{op}: {msg}")


def dtype(op: str, name: str, t: Tensor, expected: torch.dtype) -> None:
    if t.dtype != expected:
        fail(op, f"{name} must be {expected}, got {t.dtype}")


def floating(op: str, name: str, t: Tensor) -> None:
    if not t.is_floating_point():
        fail(op, f"{name} must be a floating-point tensor, got {t.dtype}")


def same_dtype(op: str, name: str, t: Tensor, ref_name: str, ref: Tensor) -> None:
    if t.dtype != ref.dtype:
        fail(op, f"{name} must have the dtype of {ref_name} ({ref.dtype}), got {t.dtype}")


def rank(op: str, name: str, t: Tensor, layout: str) -> None:
    """``layout`` like ``"[B, S, H, D]"``; its number of entries is the required rank."""
    want = len(layout.strip("[]").split(","))
    if t.dim() != want:
        fail(op, f"{name} must have rank {want} {layout}, got shape {tuple(t.shape)}")


def dim(op: str, name: str, t: Tensor, d: int, expected: int, what: str) -> None:
    """``t.shape[d] == expected``; ``what`` says where ``expected`` comes from, e.g. "B of q"."""
    if t.shape[d] != expected:
        fail(op, f"{name}.shape[{d}] must be {expected} ({what}), got {t.shape[d]} (shape {tuple(t.shape)})")


def same_device(op: str, **tensors: Tensor | None) -> None:
    """Every given tensor on one device (an optional argument left out, ``None``, is skipped)."""
    tensors = {name: t for name, t in tensors.items() if t is not None}
    names = list(tensors)
    first = tensors[names[0]].device
    for name in names[1:]:
        if tensors[name].device != first:
            fail(op, f"all tensors must be on one device: {names[0]} is on {first}, "
                     f"{name} is on {tensors[name].device}")


def check_int(name: str, value, low: int) -> None:
    """A Python int (not a bool) ``>= low``; ``name`` carries its caller, e.g. "export: max_seq_len"."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def at_least(op: str, name: str, value: int, minimum: int, why: str = "") -> None:
    if value < minimum:
        fail(op, f"{name} must be >= {minimum}{' ' + why if why else ''}, got {value}")


def fp8_kv_cache(op: str, name: str, t: Tensor, dim: int, paged: bool = False) -> None:
    """An FP8 KV cache ``uint8 [B, pages, page, entry_bytes]`` of ``dim``-wide entries (``paged``:
    pages ``[num_pages, page, entry_bytes]``)."""
    from ..reference.fp8_cache import KVLayout

    if paged and t.dim() != 3:
        fail(op, f"{name} (paged FP8 KV cache) must have rank 3 [num_pages, page, entry_bytes], "
                 f"got shape {tuple(t.shape)}")
    if not paged and t.dim() != 4:
        fail(op, f"{name} (FP8 KV cache) must have rank 4 [B, pages, page, entry_bytes], got shape {tuple(t.shape)}")
    try:
        KVLayout.of(t, dim)
    except ValueError as e:
        fail(op, f"{name}: {e}")


def fp8_key_cache(op: str, name: str, t: Tensor, dim: int, paged: bool = False) -> None:
    """An FP8 indexer-key cache ``uint8 [B, pages, page, dim + 4]`` (``paged``: ``[num_pages, page, dim + 4]``)."""
    if t.dim() != (3 if paged else 4) or t.shape[-1] != dim + 4:
        layout = "[num_pages, page" if paged else "[B, pages, page"
        fail(op, f"{name} (FP8 indexer keys) must be {layout}, DI + 4 = {dim + 4}], got shape {tuple(t.shape)}")


def block_table(op: str, table: Tensor, pages: Tensor, name: str = "block_table") -> None:
    """A block table ``int32 [B, P]`` of page ids into ``pages`` (``[num_pages, page, ...]``), each
    page's entries within the page stride (FlashMLA pads the stride; it never overlaps pages)."""
    rank(op, name, table, "[B, P]")
    dtype(op, name, table, torch.int32)
    if pages.dim() >= 2 and pages.shape[0] > 1 and pages.stride(0) < pages.shape[1] * pages.stride(1):
        fail(op, f"the pages of a paged pool must not overlap: stride(0) = {pages.stride(0)} < page * stride(1) "
                 f"= {pages.shape[1]} * {pages.stride(1)}")
    if pages.dtype == torch.uint8 and pages.dim() == 3 and (pages.stride(2) != 1 or pages.stride(1) != pages.shape[2]):
        fail(op, f"an FP8 page must be its entries' bytes back to back (stride(1) = entry_bytes = {pages.shape[2]}, "
                 f"stride(2) = 1), got strides {pages.stride()}")


# ---- metadata checks: once per signature ------------------------------------------------
# Signatures whose metadata checks passed, of every op (the check function is part of the key).
# Bounded: a process that sees ever new shapes (prefill lengths) clears it and checks again.
_passed_signatures: set = set()
MAX_SIGNATURES = 4096


def _signature(a) -> object:
    # a value with its type: 1, 1.0 and True hash alike, and a check may tell them apart
    return (a.shape, a.stride(), a.dtype, a.device) if isinstance(a, Tensor) else (type(a), a)


def once_per_signature(check: Callable[..., None], *args) -> None:
    """``check(*args)``, unless it passed before for arguments of the same signature: the tensors'
    shapes, strides, dtypes and devices, the other arguments' values. ``check`` must read nothing else.

    While ``torch.compile`` traces, the check always runs (it costs nothing at run time, and a
    lookup would make the graph guard on this cache); so does a call whose signature cannot be
    hashed (symbolic shapes)."""
    if torch.compiler.is_compiling():
        check(*args)
        return
    try:
        key = (check, *map(_signature, args))
        if key in _passed_signatures:
            return
    except TypeError:  # an unhashable SymInt in a shape
        check(*args)
        return
    check(*args)
    if len(_passed_signatures) >= MAX_SIGNATURES:
        _passed_signatures.clear()
    _passed_signatures.add(key)


# ---- value checks: eager only ---------------------------------------------------------
_op_value_checks = True  # process-wide, as torch's own debug switches (anomaly mode, sparse invariants)


@contextlib.contextmanager
def value_checks(enabled: bool):
    """Turn the public op wrappers' value checks on or off inside the ``with`` block (process-wide;
    on by default). Off, a wrapper checks metadata only (once per signature) and never reads the
    device: no sync, nothing launched besides the op."""
    global _op_value_checks
    if not isinstance(enabled, bool):
        raise ValueError(f"value_checks: enabled must be a bool, got {enabled!r}")
    before, _op_value_checks = _op_value_checks, enabled
    try:
        yield
    finally:
        _op_value_checks = before


def checks_op_values(*tensors: Tensor) -> bool:
    """True when an op wrapper runs its value checks on these tensors: on (:func:`value_checks`) and
    :func:`reads_values`. A traced call reads no switch, so its graph does not guard on it."""
    if torch.compiler.is_compiling():
        return False
    return _op_value_checks and reads_values(*tensors)


def reads_values(*tensors: Tensor) -> bool:
    """True when value checks may read these tensors: eager, real data, not capturing."""
    if torch.compiler.is_compiling():
        return False
    for t in tensors:
        if t.device.type == "meta" or is_fake(t):
            return False
        if t.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
    return True


def _first(mask: Tensor) -> tuple[int, ...]:
    return tuple(mask.nonzero()[0].tolist())


def none_of(op: str, bad: Tensor, message) -> None:
    """Fail when any element of the bool mask ``bad`` is set; ``message(at)`` gets its index tuple."""
    if bad.numel() and bool(bad.any()):
        fail(op, message(_first(bad)))


def in_range(op: str, name: str, t: Tensor, lo: int, hi: int, limit: str) -> None:
    """Every value of ``t`` in ``[lo, hi]``; ``limit`` names the bound, e.g. "cache rows N=16"."""
    if t.numel() == 0:
        return
    for bad, what in ((t > hi, f"beyond {limit}"), (t < lo, f"below the minimum {lo}")):
        if bool(bad.any()):
            at = _first(bad)
            fail(op, f"{name}[{', '.join(map(str, at))}] = {int(t[at])} is {what}")


def index_range(op: str, name: str, idx: Tensor, n: int, what: str) -> None:
    """Indices into ``n`` rows: ``-1`` (none) or ``0 .. n-1``."""
    valid = f"-1 or 0..{n - 1}" if n > 0 else "only -1"
    in_range(op, name, idx, -1, n - 1, f"{what} N={n} (valid: {valid})")


def distinct_per_row(op: str, name: str, idx: Tensor) -> None:
    """Non-negative entries of each row of a ``[B, S]`` index tensor are distinct."""
    if idx.numel() == 0:
        return
    s = idx.sort(dim=-1).values
    dup = (s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)
    if bool(dup.any()):
        b, j = _first(dup)
        fail(op, f"{name}[{b}] holds index {int(s[b, j])} twice; the indices of one row must be distinct")


# ---- value checks of one call, one host read ---------------------------------------------
class ValueCheck(NamedTuple):
    """One value check, split so that a call's checks read the host once: ``reads`` are 0-d
    tensors computed on the tensors' device, ``passes`` judges their values, and ``explain`` is the
    detailed check, run only when ``passes`` fails, which finds the element and raises."""

    reads: tuple[Tensor, ...]
    passes: Callable[[list], bool]
    explain: Callable[[], None]


def run_value_checks(*checks: ValueCheck) -> None:
    """Read every check's values in one host read (one sync on a GPU, not one or two per check),
    then run the detailed check, which raises, of the first check that fails."""
    reads = [t for c in checks for t in c.reads]
    values = torch.stack(reads).tolist() if reads else []
    for c in checks:
        n = len(c.reads)
        if not c.passes(values[:n]):
            c.explain()
        values = values[n:]


def in_range_check(op: str, name: str, t: Tensor, lo: int, hi: int, limit: str) -> ValueCheck:
    """:func:`in_range` as a :class:`ValueCheck`: one ``aminmax`` on the device."""
    explain = functools.partial(in_range, op, name, t, lo, hi, limit)
    if t.numel() == 0:
        return ValueCheck((), lambda values: True, explain)
    return ValueCheck(tuple(t.aminmax()), lambda values: lo <= values[0] and values[1] <= hi, explain)


def index_range_check(op: str, name: str, idx: Tensor, n: int, what: str) -> ValueCheck:
    """:func:`index_range` as a :class:`ValueCheck`."""
    check = in_range_check(op, name, idx, -1, n - 1, what)
    return check._replace(explain=functools.partial(index_range, op, name, idx, n, what))


def distinct_per_row_check(op: str, name: str, idx: Tensor) -> ValueCheck:
    """:func:`distinct_per_row` as a :class:`ValueCheck`."""
    s = idx.sort(dim=-1).values
    dup = (s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)
    return ValueCheck((dup.any(),), lambda values: not values[0], functools.partial(distinct_per_row, op, name, idx))


def block_table_checks(op: str, table: Tensor | None, pages: Tensor,
                       name: str = "block_table") -> tuple[ValueCheck, ...]:
    """Every entry of a block table names one of the pool's pages (no check without a table)."""
    if table is None:
        return ()
    return (in_range_check(op, name, table, 0, pages.shape[0] - 1, f"the pool's pages num_pages={pages.shape[0]}"),)


def present(*tensors: Tensor | None) -> tuple[Tensor, ...]:
    """The tensors that are given (optional arguments left out)."""
    return tuple(t for t in tensors if t is not None)


def none_of_check(op: str, bad: Tensor, message) -> ValueCheck:
    """:func:`none_of` as a :class:`ValueCheck`."""
    return ValueCheck((bad.any(),), lambda values: not values[0], functools.partial(none_of, op, bad, message))
