"""Triton projections of a few tokens (decode): ``y [T, G, N] = x [T, G, K] @ w [G, N, K]^T`` per
group ``g``. Contract: ``dsv4_ops.reference.gemv``.

Why a kernel: at batch 1 every dense projection of a decode step (q_a, q_b, kv, the grouped o_a,
o_b, the indexer's q_b, the compressors, the shared expert, the MTP projections) is a
matrix-vector product, so its cost is reading the weight once. cuBLAS serves these shapes with
split-K GEMM tiles padded to 8 rows plus a reduce kernel, well short of HBM bandwidth, where
the same streaming layout in ``moe_gemv`` comes close to it (docs/kernels.md).

``gemv_kernel``, grid ``(cdiv(N, BLOCK_N), G)``: program ``(n-block, g)`` streams ``BLOCK_N``
whole weight rows of group ``g`` (contiguous ``K`` runs, coalesced) and multiplies each
``[BLOCK_N, BLOCK_K]`` tile into every token at once, so ``T`` tokens read the weight once.
Partial products accumulate in fp32 registers and are reduced once at the end; the output is
rounded to ``y``'s dtype, as a matmul in that dtype returns it. ``BLOCK_N`` shrinks until the
grid gives every SM two programs (:func:`block_rows`), so narrow projections still spread
their bytes over the GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launch, launch, next_pow2, sm_count

__all__ = ["gemv", "gemv_launch", "gemv_kernel", "MAX_TOKENS", "DEFAULT_CONFIG"]

# at most this many tokens per call: the accumulator holds TOKENS x BLOCK_N x BLOCK_K partials
MAX_TOKENS = 8

# rows x columns of one weight tile at one token, 3 stages, 4 warps: the fastest measured
# (docs/kernels.md); more tokens share the same register budget (BLOCK_K shrinks as TOKENS grows)
DEFAULT_CONFIG = dict(rows=8, cols=512, stages=3, warps=4)


@triton.jit
def gemv_kernel(x_ptr, w_ptr, y_ptr, T, G, N, K,
                TOKENS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    # x [T, G, K], w [G, N, K], y [T, G, N]: contiguous
    g = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.arange(0, TOKENS)
    k = tl.arange(0, BLOCK_K)
    n_ok, t_ok = n < N, t < T
    w_rows = w_ptr + (g.to(tl.int64) * N + n.to(tl.int64))[:, None] * K  # [BLOCK_N, 1]
    x_rows = x_ptr + (t.to(tl.int64) * G + g)[:, None] * K  # [TOKENS, 1]
    acc = tl.zeros([TOKENS, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k_ok = (k0 + k) < K
        w = tl.load(w_rows + k0 + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        xv = tl.load(x_rows + k0 + k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += w[None, :, :] * xv[:, None, :]
    y = tl.sum(acc, axis=2)  # [TOKENS, BLOCK_N]
    y_rows = y_ptr + (t.to(tl.int64) * G + g)[:, None] * N
    tl.store(y_rows + n[None, :], y.to(y_ptr.dtype.element_ty), mask=t_ok[:, None] & n_ok[None, :])


def block_rows(n_rows: int, groups: int, device: torch.device, rows: int) -> int:
    """``rows`` weight rows per program, fewer (down to 1) while the grid would not give every
    multiprocessor two programs: a narrow projection (kv: 512 rows) still spreads its bytes."""
    target = 2 * sm_count(device)
    while rows > 1 and triton.cdiv(n_rows, rows) * groups < target:
        rows //= 2
    return rows


def gemv_launch(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor | None = None,
                config: dict | None = None) -> tuple[torch.Tensor, Launch | None]:
    """``(y, launch)`` for ``x [T, G, K]``, ``w [G, N, K]`` (``T <= MAX_TOKENS``); ``config``
    overrides entries of ``DEFAULT_CONFIG`` (sweeps). ``launch`` is None when there is nothing
    to compute (``y`` is then empty, or zeros when ``K == 0``)."""
    c = {**DEFAULT_CONFIG, **(config or {})}
    (T, G, K), N = x.shape, w.shape[1]
    if y is None:
        y = torch.empty(T, G, N, dtype=x.dtype, device=x.device)
    if T == 0 or G == 0 or N == 0:
        return y, None
    if K == 0:
        y.zero_()
        return y, None
    tokens = next_pow2(T)
    block_k = min(max(c["cols"] // tokens, 16), next_pow2(K))
    block_n = min(block_rows(N, G, x.device, c["rows"]), next_pow2(N))
    return y, Launch((triton.cdiv(N, block_n), G), (x.contiguous(), w.contiguous(), y, T, G, N, K),
                     dict(TOKENS=tokens, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=c["stages"],
                          num_warps=c["warps"]))


def gemv(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """Raw launcher with the reference signature -> ``y [T, G, N]`` in ``x``'s dtype."""
    y, spec = gemv_launch(x, w, y, config)
    launch(gemv_kernel, spec)
    return y
