"""The routed experts of many tokens in aten ops: the ``dsv4::moe_gemv`` op's path beyond its GEMV kernels.

Both paths sort the ``T * K`` (token, expert) assignments by expert with static shapes (no
``nonzero``, no boolean masks, no ``bincount``), so they trace with ``fullgraph=True`` and replay
in CUDA graphs, and both read only the experts the tokens route to:

- ``experts_grouped_mm``: one ``torch._grouped_mm`` per projection over the expert-sorted rows,
  where its fast kernels exist (bf16 on sm_90 / sm_100);
- ``experts_blocked``: the sorted rows padded per expert to blocks, each block one ``bmm`` against
  its expert's weights gathered once per block (any device, any dtype).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...reference.ops import swiglu

__all__ = ["route_layout", "experts_grouped_mm", "experts_blocked", "grouped_mm_supported"]

# torch._grouped_mm's fast kernels: bf16 on sm90 / sm100. Elsewhere CUDA falls back to a per-group
# loop that reads the offsets on the host (a sync; no CUDA graphs), and its fake kernel accepts bf16
# only, so other dtypes would not even trace. ROCm: the portable path (DESIGN rule 6).
_GROUPED_MM_ARCHS = (9, 10)
# AOTInductor calls torch._grouped_mm through a C shim that torch ships from 2.12 on; an exported
# program on an older torch takes the blocked path (its generated C++ would not compile).
_AOTI_HAS_GROUPED_MM = torch.torch_version.TorchVersion(torch.__version__) >= (2, 12)


@torch._dynamo.assume_constant_result
def _cuda_arch_has_grouped_mm(device_index: int) -> bool:
    if torch.version.hip is not None or not hasattr(torch, "_grouped_mm"):
        return False
    return torch.cuda.get_device_capability(device_index)[0] in _GROUPED_MM_ARCHS


def grouped_mm_supported(x: Tensor, w13: Tensor, w2: Tensor) -> bool:
    """Whether ``experts_grouped_mm`` serves these tensors: static facts only (device, dtype,
    16-byte aligned rows, whether torch.export traces), so the choice is fixed while tracing."""
    if not (x.is_cuda and x.dtype == w13.dtype == w2.dtype == torch.bfloat16):
        return False
    if torch.compiler.is_exporting() and not _AOTI_HAS_GROUPED_MM:
        return False
    if w13.shape[-1] % 8 or w2.shape[-1] % 8:
        return False
    return _cuda_arch_has_grouped_mm(x.device.index)  # a CUDA tensor's device always has its index


def route_layout(indices: Tensor, n_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """The T*K (token, expert) assignments sorted by expert, with static shapes.

    indices [T, K] -> (flat [N] expert of each assignment (token-major), order [N] assignments
    by expert (stable argsort, so tokens stay in order within an expert), counts [E] int64
    assignments per expert). Assignment a is token a // K; a row naming an expert twice is two
    assignments. The histogram is a scatter_add of ones: no bincount, no data-dependent shape."""
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    return flat, order, counts


def _inverse(order: Tensor) -> Tensor:
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def experts_grouped_mm(x: Tensor, indices: Tensor, w13: Tensor, w2: Tensor, limit: float) -> Tensor:
    """One grouped GEMM per projection over the expert-sorted rows: every assignment's FLOPs once,
    every routed expert's weights once, unrouted experts untouched. -> [N, D] in assignment order."""
    K = indices.shape[1]
    flat, order, counts = route_layout(indices, w13.shape[0])
    offs = counts.cumsum(0).to(torch.int32)  # end row of each expert's group
    xs = x[order // K]  # [N, D] rows sorted by expert
    gate, up = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    ys = torch._grouped_mm(swiglu(gate, up, limit), w2.transpose(1, 2), offs=offs)  # [N, D]
    return ys[_inverse(order)]


def experts_blocked(x: Tensor, indices: Tensor, w13: Tensor, w2: Tensor, limit: float) -> Tensor:
    """The expert-sorted rows padded per expert to blocks of B rows, each block one bmm against its
    expert's weights gathered once per block.

    B = ceil(N / E): while N = T*K <= E (decode) B = 1 and the blocks are exactly the routed
    (token, expert) pairs, so only routed experts are read; at large N the blocks gather at most 2E
    expert weights in all (twice the expert set, however skewed the routing) and at most 2N rows.
    The block count is the static bound floor((N + min(E, N) * (B - 1)) / B); spare blocks repeat
    a routed expert on a zero row and are dropped. -> [N, D] in assignment order."""
    (T, D), K, E = x.shape, indices.shape[1], w13.shape[0]
    N = T * K
    B = max(1, -(-N // E))
    n_blocks = (N + min(E, N) * (B - 1)) // B
    flat, order, counts = route_layout(indices, E)
    sorted_e = flat[order]
    padded = (counts + (B - 1)) // B * B  # [E] rows per expert, rounded up to whole blocks
    pad_start = padded.cumsum(0) - padded
    start = counts.cumsum(0) - counts
    rank = torch.arange(N, device=x.device) - start[sorted_e]  # place within its expert
    pos = pad_start[sorted_e] + rank  # [N] padded row of each sorted assignment
    rows = torch.full((n_blocks, B), T, dtype=torch.int64, device=x.device)  # token of each padded row
    rows.view(-1).scatter_(0, pos, order // K)
    blocks = torch.arange(n_blocks, device=x.device)
    block_e = torch.searchsorted(padded.cumsum(0) // B, blocks, right=True)  # expert of each block
    block_e = torch.where(block_e < E, block_e, sorted_e[-1])  # spare blocks: a routed expert, zero rows
    xp = torch.cat([x, x.new_zeros(1, D)])[rows]  # [n_blocks, B, D]; row T is the zero row
    gate, up = torch.bmm(xp, w13[block_e].transpose(1, 2)).chunk(2, dim=-1)  # [n_blocks, B, I] each
    y = torch.bmm(swiglu(gate, up, limit), w2[block_e].transpose(1, 2)).flatten(0, 1)  # [n_blocks * B, D]
    return y[pos[_inverse(order)]]
