"""dsv4::compress against its meaning: driven incrementally (plan -> compress -> ring writes,
chunks of any size, one larger than the ring), the pool must equal a dense float64 compressor run
over the whole sequence at once, block by block, with nothing written past the last complete block;
every rate (CSA m = 4 with overlap, HCA m = 8, 16, 128), fp32 and bf16, lengths around and at
multiples of m; edge cases: token-by-token decode across blocks, rows that stay padding, fewer
tokens than a block, every emit slot -1 and no new tokens."""
import pytest
import torch

import dsv4_ops
from compress_cases import EPS, I32, make_inputs, rope_tables


def dense_compress(kv, gate, norm_w, cos, sin, m, overlap, eps=EPS):
    """Every complete block of a whole sequence at once, in float64 (architecture §4 / §11).

    kv, gate: [T, c*d]. Returns [T // m, d]."""
    kv, gate = kv.double(), gate.double()
    T, C = kv.shape
    d = C // 2 if overlap else C
    n = T // m
    a = kv[: n * m].reshape(n, m, C)
    z = gate[: n * m].reshape(n, m, C)
    if overlap:  # 2m slots: first halves of block i-1 (none for i = 0), second halves of block i
        K = a.new_zeros(n, 2 * m, d)
        L = a.new_full((n, 2 * m, d), float("-inf"))
        K[:, m:], L[:, m:] = a[..., d:], z[..., d:]
        K[1:, :m], L[1:, :m] = a[:-1, :, :d], z[:-1, :, :d]
    else:
        K, L = a, z
    c = (K * L.softmax(dim=1)).sum(dim=1)  # per-channel softmax over the slots
    c = c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + eps) * norm_w.double()
    half = cos.shape[-1]  # rope: rotate channel pairs of the last 2*half dims as complex numbers
    pos = m * torch.arange(n)
    rot = torch.complex(cos.double()[pos], sin.double()[pos])
    pairs = torch.view_as_complex(c[:, d - 2 * half:].reshape(n, half, 2).contiguous())
    c[:, d - 2 * half:] = torch.view_as_real(pairs * rot).reshape(n, 2 * half)
    return c


def drive(T, chunks, m, overlap, d=16, half=4, dtype=torch.float32, device="cpu", poison=None):
    """Feed rows of lengths T[b] through plan + compress + cache_write in the given chunk sizes
    (chunks[b][k] tokens of row b at step k; 0 = padding row). Returns (pool, kv, gate, w, cos, sin)."""
    B, c = len(T), (2 if overlap else 1)
    R = c * m  # the smallest ring plan accepts
    kv = torch.randn(B, max(T), c * d, device=device).to(dtype)
    gate = torch.randn(B, max(T), c * d, device=device).to(dtype)
    norm_w = torch.rand(d, device=device) + 0.5
    cos, sin = rope_tables(max(T) + m, half, device)
    ring_kv = torch.randn(B, R, c * d, device=device).to(dtype)  # stale garbage: must never be read
    ring_gate = torch.randn(B, R, c * d, device=device).to(dtype)
    pool = torch.empty(B, max(T) // m + 2, d, device=device, dtype=dtype)
    poison(pool)
    lengths = [0] * B
    for k in range(max(len(ch) for ch in chunks)):
        n_new = [ch[k] if k < len(ch) else 0 for ch in chunks]
        S = max(n_new)
        if S == 0:
            continue
        L = torch.tensor(lengths, dtype=I32, device=device)
        p = dsv4_ops.plan(L, torch.tensor(n_new, dtype=I32, device=device), S, 1, 1, S, False,
                          m, 2 * m, m, m)
        emit, write = (p.csa_emit, p.csa_write) if overlap else (p.hca_emit, p.hca_write)
        new_kv = torch.randn(B, S, c * d, device=device).to(dtype)  # padding rows: garbage
        new_gate = torch.randn(B, S, c * d, device=device).to(dtype)
        for b in range(B):
            new_kv[b, : n_new[b]] = kv[b, lengths[b]: lengths[b] + n_new[b]]
            new_gate[b, : n_new[b]] = gate[b, lengths[b]: lengths[b] + n_new[b]]
        dsv4_ops.compress(ring_kv, ring_gate, new_kv, new_gate, L, emit[0], norm_w, cos, sin, pool, m, overlap, EPS)
        dsv4_ops.cache_write(ring_kv, new_kv, write[0])
        dsv4_ops.cache_write(ring_gate, new_gate, write[0])
        lengths = [x + n for x, n in zip(lengths, n_new)]
    assert lengths == list(T)
    return pool, kv, gate, norm_w, cos, sin


def chunked(T, sizes, offset=0):
    out, k = [], offset
    while sum(out) < T:
        out.append(min(sizes[k % len(sizes)], T - sum(out)))
        k += 1
    return out


def check_pool(pool, kv, gate, norm_w, cos, sin, T, m, overlap, tol):
    for b, t in enumerate(T):
        want = dense_compress(kv[b, :t].cpu(), gate[b, :t].cpu(), norm_w.cpu(), cos.cpu(), sin.cpu(), m, overlap)
        got = pool[b].cpu().double()
        torch.testing.assert_close(got[: t // m], want, **tol(pool.dtype), msg=lambda s: f"row {b}, T={t}: {s}")
        assert got[t // m:].isnan().all(), f"row {b}, T={t}: entries past the last complete block were written"


LENGTHS = [1, 3, 4, 5, 127, 128, 129]
RATES = [(4, True), (8, False), (16, False), (128, False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m, overlap", RATES, ids=[f"m{m}" for m, _ in RATES])
def test_compress_matches_reference(device, m, overlap, dtype, tol, poison):
    lengths = LENGTHS + [2 * m, 3 * m]
    # two rows of different lengths and chunkings per run: mixed sizes (one chunk larger than the
    # ring), and the whole sequence in one step
    for i, t in enumerate(lengths):
        T = [t, lengths[(i + 3) % len(lengths)]]
        chunks = [chunked(T[0], [1, 3, 4, 5, 150]), chunked(T[1], [1, 3, 4, 5, 150], offset=2)]
        check_pool(*drive(T, chunks, m, overlap, dtype=dtype, device=device, poison=poison), T, m, overlap, tol)
        check_pool(*drive(T, [[T[0]], [T[1]]], m, overlap, dtype=dtype, device=device, poison=poison), T, m,
                   overlap, tol)


@pytest.mark.parametrize("m, overlap", [(4, True), (16, False)], ids=["m4", "m16"])
def test_compress_edge_cases(device, m, overlap, tol, poison):
    # token-by-token decode across block boundaries
    T = [2 * m + 1, m - 1]
    check_pool(*drive(T, [[1] * T[0], [1] * T[1]], m, overlap, device=device, poison=poison), T, m, overlap, tol)
    # exact multiples of m in chunks of exactly m, and a row that stays padding until late
    T = [3 * m, m]
    check_pool(*drive(T, [[m] * 3, [0, 0, m]], m, overlap, device=device, poison=poison), T, m, overlap, tol)
    # shorter than one block: nothing is emitted, the pool stays untouched
    T = [m - 1, 1]
    check_pool(*drive(T, [[m - 1], [1]], m, overlap, device=device, poison=poison), T, m, overlap, tol)
    # every emit slot -1, and no new tokens at all (E = 0): the pool is left alone
    args = make_inputs(m=m, overlap=overlap, lengths=(0, 1), n_new=(1, 1), device=device)
    args[5].fill_(-1)
    before = args[9].clone()
    dsv4_ops.compress(*args)
    assert torch.equal(args[9], before)
    args = make_inputs(m=m, overlap=overlap, lengths=(0, 1), n_new=(0, 0), S=0, device=device)
    assert args[5].shape == (2, 0)
    before = args[9].clone()
    dsv4_ops.compress(*args)
    assert torch.equal(args[9], before)
