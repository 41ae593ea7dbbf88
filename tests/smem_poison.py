"""Fill every SM's shared memory with NaN before a kernel runs, so that a kernel reading shared
memory it has not written (a skipped lane or slot, or a read before its writers stored it: a
missing barrier between warps) reads NaN instead of whatever happens to be there.

Shared memory is not cleared between kernels (``shared_memory_seen_after_poison`` checks that
on the GPU at hand). A back-to-back launch of the same call finds its own previous values at the
same addresses, so such a read passes repeatability and oracle tests and may show only inside a
model, where other kernels ran before. ``poison_shared_memory()`` launches enough CTAs of a
224 KB kernel that every SM runs some.
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

ROWS, COLS = gl.constexpr(32), gl.constexpr(256)  # a 32 KB float32 tile; 7 = 224 KB of the 227 KB a CTA may use


@gluon.jit
def _poison_kernel(out_ptr):
    tile_l: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [gl.num_warps(), 1], [1, 0])
    smem_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    nan = gl.full([ROWS, COLS], float("nan"), gl.float32, tile_l)
    four = gl.allocate_shared_memory(gl.float32, [4, ROWS, COLS], smem_l)
    two = gl.allocate_shared_memory(gl.float32, [2, ROWS, COLS], smem_l)
    one = gl.allocate_shared_memory(gl.float32, [1, ROWS, COLS], smem_l)
    for i in gl.static_range(4):
        four.index(i).store(nan)
    for i in gl.static_range(2):
        two.index(i).store(nan)
    one.index(0).store(nan)
    gl.thread_barrier()
    # read one value of each allocation back so that all three stay live (and distinct) to the end
    total = (four.index(3).load(tile_l) + two.index(1).load(tile_l) + one.index(0).load(tile_l))
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, tile_l))
    gl.store(out_ptr + gl.program_id(0) + rows * 0, gl.max(total, 1), mask=rows == 0)


def poison_shared_memory(device="cuda", waves: int = 4) -> None:
    """NaN into (nearly) all shared memory of every SM of ``device``: ``waves`` CTAs per SM."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    out = torch.empty(sms * waves, device=device)
    _poison_kernel[(sms * waves,)](out, num_warps=8)
    torch.cuda.synchronize(device)
    assert out.isnan().all(), "the poison kernel did not read its NaN back"


@gluon.jit
def _peek_kernel(out_ptr):
    """The NaN count of the first 32 KB of this CTA's shared memory, never written by it."""
    tile_l: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [gl.num_warps(), 1], [1, 0])
    smem_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    unwritten = gl.allocate_shared_memory(gl.float32, [ROWS, COLS], smem_l)
    nans = gl.sum(gl.sum((unwritten.load(tile_l) != unwritten.load(tile_l)).to(gl.int32), 1), 0)
    gl.store(out_ptr + gl.program_id(0), nans)


def shared_memory_seen_after_poison(device="cuda") -> float:
    """The fraction of NaN a kernel launched after ``poison_shared_memory`` finds in shared memory
    it never wrote: 1.0 where shared memory keeps the previous kernel's values."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    poison_shared_memory(device)
    counts = torch.zeros(sms, dtype=torch.int32, device=device)
    _peek_kernel[(sms,)](counts, num_warps=8)
    return float(counts.sum()) / (sms * ROWS * COLS)
