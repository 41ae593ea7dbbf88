"""dsv4::compress: driven incrementally (plan -> compress -> ring writes, chunks of any size),
the pool must equal a dense compressor run over the whole sequence at once, block by block."""
import math

import pytest
import torch
from torch.library import opcheck

import dsv4_ops

I32 = torch.int32
EPS = 1e-6


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


def rope_tables(P, half, device="cpu"):
    angle = torch.rand(P, half, device=device) * 2 * math.pi
    return angle.cos(), angle.sin()


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


def make_inputs(m=4, overlap=True, lengths=(3, 6), n_new=(1, 1), S=1, d=16, half=4, N=None, device="cpu"):
    """Direct op inputs in a consistent state: emit from plan, rings of R = c*m slots."""
    B, c = len(lengths), (2 if overlap else 1)
    L = torch.tensor(lengths, dtype=I32, device=device)
    p = dsv4_ops.plan(L, torch.tensor(n_new, dtype=I32, device=device), S, 1, 1, max(S, 1), False, m, 2 * m, m, m)
    emit = (p.csa_emit if overlap else p.hca_emit)[0]
    cos, sin = rope_tables(max(lengths) + S + m, half, device)
    N = max(lengths) // m + S // m + 1 if N is None else N
    return [torch.randn(B, c * m, c * d, device=device), torch.randn(B, c * m, c * d, device=device),
            torch.randn(B, S, c * d, device=device), torch.randn(B, S, c * d, device=device), L, emit,
            torch.rand(d, device=device) + 0.5, cos, sin, torch.randn(B, N, d, device=device), m, overlap, EPS]


OPCHECK_CASES = {
    "decode_overlap": dict(),
    "prefill_chunk_overlap": dict(lengths=(0, 5), n_new=(9, 4), S=9),
    "non_overlap": dict(m=8, overlap=False, lengths=(7, 15), n_new=(1, 1)),
    "nothing_emitted_all_-1": dict(lengths=(0, 0), n_new=(1, 2), S=2),
    "empty_pool": dict(lengths=(0, 0), n_new=(1, 1), N=0),
}


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_compress_opcheck(case):
    opcheck(torch.ops.dsv4.compress.default, make_inputs(**OPCHECK_CASES[case]))


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_compress_fake_matches_real(fake_check, case):
    fake_check(torch.ops.dsv4.compress.default, *make_inputs(**OPCHECK_CASES[case]))


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


def test_compress_rejects_bad_input():
    def bad(match, change, **kw):
        args = make_inputs(**kw)
        change(args)
        with pytest.raises(ValueError, match=match):
            dsv4_ops.compress(*args)

    def setitem(i, value):
        return lambda a: a.__setitem__(i, value(a) if callable(value) else value)

    bad(r"compress: ring_kv.shape\[2\] must be 32 \(\(2 if overlap else 1\) \* d = 2 \* 16\), got 16",
        setitem(0, lambda a: a[0][..., :16]))
    bad(r"new_gate.shape\[2\] must be 16 \(\(2 if overlap else 1\) \* d = 1 \* 16\), got 32",
        lambda a: (a.__setitem__(0, a[0][..., :16]), a.__setitem__(1, a[1][..., :16]),
                   a.__setitem__(2, a[2][..., :16]), a.__setitem__(11, False)))
    bad(r"rope dims 2 \* cos.shape\[-1\] = 18 exceed d = 16", lambda a: (a.__setitem__(7, torch.rand(20, 9)),
                                                                       a.__setitem__(8, torch.rand(20, 9))))
    bad(r"start must be torch.int32, got torch.int64", setitem(4, lambda a: a[4].long()))
    bad(r"emit must be torch.int32, got torch.int64", setitem(5, lambda a: a[5].long()))
    bad(r"new_gate must have the dtype of ring_gate \(torch.float32\), got torch.bfloat16",
        setitem(3, lambda a: a[3].bfloat16()))
    bad(r"pool must be a floating-point tensor", setitem(9, lambda a: a[9].int()))
    bad(r"norm_weight.shape\[0\] must be 16 \(d of pool\), got 8", setitem(6, torch.rand(8)))
    bad(r"all tensors must be on one device: ring_kv is on cpu, pool is on meta", setitem(9, lambda a: a[9].to("meta")))
    bad(r"ring_kv.shape\[1\] must be >= 8 \(ring slots R >= 2 \* ratio = 8\), got 7",
        lambda a: (a.__setitem__(0, a[0][:, :7]), a.__setitem__(1, a[1][:, :7])))
    bad(r"emit\[0, 0\] = 5 is beyond pool entries N=2", setitem(5, torch.tensor([[5], [-1]], dtype=I32)))
    bad(r"emit\[1, 0\] = block 1 ends at position 7, past the new rows \(start\[1\] = 6, S = 1\)",
        setitem(5, torch.tensor([[0], [1]], dtype=I32)))
    bad(r"emit\[0, 0\] = block 0 needs position 0, older than the ring of R=8 slots holds \(start\[0\] = 11\)",
        setitem(5, torch.tensor([[0], [-1]], dtype=I32)), lengths=(11, 6))
    bad(r"cos.shape\[0\] must be >= 1 \(rope table rows\), got 0",
        lambda a: (a.__setitem__(7, torch.rand(0, 4)), a.__setitem__(8, torch.rand(0, 4))))
    bad(r"emit\[0, 0\] = block 3 is rotated at position 12, beyond the rope table rows P=12",
        lambda a: (a.__setitem__(7, torch.rand(12, 4)), a.__setitem__(8, torch.rand(12, 4))),
        lengths=(15, 6), N=5)


def test_compress_raw_op_skips_out_of_range_blocks(device):
    """The raw op (no wrapper checks), on every backend: emitted blocks outside [0, N) are
    skipped like -1, and an entry whose rope row is past the table is left unrotated (as by
    an identity row there)."""
    args = make_inputs(lengths=(3, 7), device=device)  # emits block 0 (row 0) and block 1 (row 1)
    N = args[9].shape[1]
    extra = torch.tensor([[N, -5], [2**31 - 1, 99]], dtype=I32, device=device)
    runs = []
    for emit in (torch.cat([args[5], extra], 1), torch.cat([args[5], torch.full_like(extra, -1)], 1)):
        pool = args[9].clone()
        torch.ops.dsv4.compress(*args[:5], emit, *args[6:9], pool, *args[10:])
        runs.append(pool)
    assert torch.equal(runs[0], runs[1])
    half = args[7].shape[-1]
    cut = (args[7][:4], args[8][:4])  # block 1 rotates at position 4: past a 4-row table
    identity = (torch.cat([cut[0], torch.ones(1, half, device=device)]),
                torch.cat([cut[1], torch.zeros(1, half, device=device)]))
    runs = []
    for cos, sin in (cut, identity):
        pool = args[9].clone()
        torch.ops.dsv4.compress(*args[:7], cos, sin, pool, *args[10:])
        runs.append(pool)
    assert torch.equal(runs[0], runs[1])
