"""The compress kernel (``lowering/triton/compress.py``) against the reference compress, fed through
plan -> compress -> ring writes step by step on identical copies of the state: every rate (CSA
m = 4 with overlap, m = 8 / 16, HCA m = 128 over several slot chunks), token-by-token decode,
chunks larger than the ring, exact multiples, odd rope offsets, rope on all channels, bf16, a ring
with lookahead; emitted blocks of -1 (and, in the raw launcher, past the pool) are skipped, E = 0
and S = 0 launch nothing, an entry whose rope row is past the table is left unrotated -- as the
reference does with the same values; the launch config is a function of static sizes; and the
quantising FP8 epilogues (KV layout, Hadamard-rotated indexer keys) equal the reference bit for bit.

Under ``TRITON_INTERPRET=1`` on CPU (small shapes), the compiled kernel on a GPU. The pools start
poisoned (NaN, or a byte no write produces) and must agree after every step.
"""
import pytest
import torch

from dsv4_ops.reference import fp8_cache as fp8
from dsv4_ops.reference import ops as ref
from fp8_cases import poisoned
from launchers import DEVICE, i32, kernel_module, rope_tables

tcompress = kernel_module("compress")
tcache = kernel_module("cache_write")


def _drive(T, chunks, m, overlap, poison, tol, d=16, half=4, dtype=torch.float32, ring_extra=0):
    """Feed rows of lengths ``T`` in chunks (``chunks[b][k]`` tokens of row b at step k, 0 =
    padding row) through plan -> compress -> ring writes, once with the reference ops and once
    with the Triton launchers (compress + cache_write) on identical copies of the state. The
    pools start poisoned and must agree (NaN where nothing was emitted) after every step."""
    B, c = len(T), (2 if overlap else 1)
    R = c * m + ring_extra
    norm_w = torch.rand(d, device=DEVICE) + 0.5
    cos, sin = rope_tables(max(T) + m, half)
    state = [torch.randn(B, R, c * d, device=DEVICE).to(dtype), torch.randn(B, R, c * d, device=DEVICE).to(dtype),
             poison(torch.empty(B, max(T) // m + 2, d, device=DEVICE, dtype=dtype))]
    mine = [t.clone() for t in state]
    lengths = [0] * B
    emitted = 0
    for k in range(max(len(ch) for ch in chunks)):
        n_new = [ch[k] if k < len(ch) else 0 for ch in chunks]
        S = max(n_new)
        if S == 0:
            continue
        L = i32(lengths)
        p = ref.plan(L, i32(n_new), S, 1, 1, S, False, m, R, m, R)
        emit, write = (p[4], p[5]) if overlap else (p[7], p[8])
        new_kv = torch.randn(B, S, c * d, device=DEVICE).to(dtype)
        new_gate = torch.randn(B, S, c * d, device=DEVICE).to(dtype)
        common = (new_kv, new_gate, L, emit[0], norm_w, cos, sin)
        ref.compress(state[0], state[1], *common, state[2], m, overlap, 1e-6)
        tcompress.compress(mine[0], mine[1], *common, mine[2], m, overlap, 1e-6)
        for i in (0, 1):
            ref.cache_write(state[i], new_kv if i == 0 else new_gate, write[0])
            tcache.cache_write(mine[i], new_kv if i == 0 else new_gate, write[0])
        torch.testing.assert_close(mine[2], state[2], equal_nan=True, **tol(dtype),
                                   msg=lambda s: f"step {k}: {s}")
        assert torch.equal(mine[0], state[0]) and torch.equal(mine[1], state[1]), f"step {k}: rings differ"
        emitted += int((emit >= 0).sum())
        lengths = [x + n for x, n in zip(lengths, n_new)]
    assert lengths == list(T)
    return emitted


COMPRESS_CASES = {
    # name: (m, overlap, T, chunks, extra kwargs)
    "csa_lengths_1_3_4_5_by_token": (4, True, [5, 4], [[1] * 5, [1, 3]], {}),
    "csa_block0_and_chunk_larger_than_ring": (4, True, [13, 3], [[9, 4], [3]], {}),
    "csa_exact_multiples": (4, True, [8, 12], [[4, 4], [0, 12]], {}),
    "m8_decode_across_blocks": (8, False, [17, 9], [[5, 3, 1, 8], [1, 8]], {}),
    "m16_one_big_chunk": (16, False, [40, 33], [[40], [1, 32]], {}),
    "csa_odd_rope_offset": (4, True, [9, 6], [[9], [2, 4]], dict(d=17, half=3)),
    "csa_rope_on_all_channels": (4, True, [8], [[3, 5]], dict(d=8, half=4)),
    "csa_bf16": (4, True, [9, 7], [[5, 4], [7]], dict(dtype=torch.bfloat16)),
    "m16_bf16_wide_rows": (16, False, [32], [[20, 12]], dict(d=64, half=8, dtype=torch.bfloat16)),
    "m128_hca_several_slot_chunks": (128, False, [256, 130], [[200, 56], [130]], dict(d=64, half=8)),
    "csa_ring_with_lookahead": (4, True, [11], [[3, 3, 3, 2]], dict(ring_extra=3)),
}


@pytest.mark.parametrize("case", list(COMPRESS_CASES))
def test_compress_kernel_matches_reference(case, poison, tol):
    m, overlap, T, chunks, kw = COMPRESS_CASES[case]
    emitted = _drive(T, chunks, m, overlap, poison, tol, **kw)
    assert emitted == sum(t // m for t in T)


def test_compress_kernel_skips_minus_one_and_out_of_range_blocks(poison, tol):
    """Emit slots of -1 (and, in the raw launcher, blocks >= N) leave the pool untouched;
    E = 0 and S = 0 launch nothing."""
    m, d, half, B = 4, 16, 4, 2
    cos, sin = rope_tables(64, half)
    ring = [torch.randn(B, 2 * m, 2 * d, device=DEVICE) for _ in range(2)]
    new = [torch.randn(B, 4, 2 * d, device=DEVICE) for _ in range(2)]
    pool = poison(torch.empty(B, 3, d, device=DEVICE))
    w = torch.rand(d, device=DEVICE) + 0.5
    start = i32([4, 8])
    emit = i32([[-1, 3], [-1, -1]])  # block 3 is beyond the pool (N = 3)
    tcompress.compress(*ring, *new, start, emit, w, cos, sin, pool, m, True, 1e-6)
    assert pool.isnan().all()
    emit = i32([[1], [-1]])  # one real block
    want = pool.clone()
    ref.compress(*ring, *new, start, emit, w, cos, sin, want, m, True, 1e-6)
    tcompress.compress(*ring, *new, start, emit, w, cos, sin, pool, m, True, 1e-6)
    torch.testing.assert_close(pool, want, equal_nan=True, **tol(torch.float32))
    assert not pool[0, 1].isnan().any() and pool[0, [0, 2]].isnan().all() and pool[1].isnan().all()
    before = pool.clone()
    tcompress.compress(*ring, *new, start, emit[:, :0], w, cos, sin, pool, m, True, 1e-6)  # E = 0
    tcompress.compress(*ring, new[0][:, :0], new[1][:, :0], start, emit[:, :0], w, cos, sin, pool, m, True, 1e-6)
    assert torch.equal(pool.nan_to_num(7.0), before.nan_to_num(7.0))


def test_compress_config_is_static():
    csa = tcompress.compress_config(d=512, half=32, ratio=4, overlap=True)
    hca = tcompress.compress_config(d=512, half=32, ratio=128, overlap=False)
    assert (csa["BLOCK_D"], csa["BLOCK_M"], csa["PAR"]) == (512, 8, 0)
    assert (hca["BLOCK_D"], hca["BLOCK_M"]) == (512, 8)
    odd = tcompress.compress_config(d=17, half=3, ratio=4, overlap=True)
    assert odd["PAR"] == 1 and odd["BLOCK_D"] == 32


def test_compress_kernel_reads_out_of_range_values_like_the_reference(poison, tol):
    """The raw-op contract on the Triton path: emitted blocks outside the pool are skipped like -1,
    and a rope row past the table leaves the entry unrotated -- exactly what the reference does
    with the same values."""
    m, d, half = 4, 16, 4
    cos, sin = rope_tables(6, half)  # rope rows 0..5: block 2 (position 8) is past the table
    ring = [torch.randn(2, 2 * m, 2 * d, device=DEVICE) for _ in range(2)]
    new = [torch.randn(2, 4, 2 * d, device=DEVICE) for _ in range(2)]
    rest = (i32([8, 4]), torch.rand(d, device=DEVICE) + 0.5, cos, sin)
    pool = poison(torch.empty(2, 3, d, device=DEVICE))
    bad, clean = i32([[2, 3, -4], [1, 2**31 - 1, 7]]), i32([[2, -1, -1], [1, -1, -1]])
    got, want, skipped = pool.clone(), pool.clone(), pool.clone()
    tcompress.compress(*ring, *new, rest[0], bad, *rest[1:], got, m, True, 1e-6)
    ref.compress(*ring, *new, rest[0], bad, *rest[1:], want, m, True, 1e-6)
    ref.compress(*ring, *new, rest[0], clean, *rest[1:], skipped, m, True, 1e-6)
    torch.testing.assert_close(got, want, equal_nan=True, **tol(torch.float32))
    assert torch.equal(want.nan_to_num(7.0), skipped.nan_to_num(7.0))
    assert not want[0, 2].isnan().any()  # written, unrotated


@pytest.mark.parametrize("d,half,m,overlap,keys", [(144, 8, 4, True, False), (128, 32, 8, False, False),
                                                    (32, 8, 4, True, True)])
def test_fp8_compress_kernel_is_the_reference_bit_for_bit(d, half, m, overlap, keys):
    torch.manual_seed(d + m)
    B, S, c = 2, 9, 2 if overlap else 1
    R = c * m + 8
    rings = [torch.randn(B, R, c * d, device=DEVICE) for _ in range(2)]
    new = [torch.randn(B, S, c * d, device=DEVICE) for _ in range(2)]
    start = torch.tensor([5, 12], dtype=torch.int32, device=DEVICE)
    emit = torch.tensor([[1, 2, 3], [3, 4, -1]], dtype=torch.int32, device=DEVICE)  # raw op: whatever the ring holds
    w = torch.rand(d, device=DEVICE) + 0.5
    cos, sin = torch.randn(64, half, device=DEVICE), torch.randn(64, half, device=DEVICE)
    lay = fp8.IndexerLayout(d, 4) if keys else fp8.KVLayout(d, 2 * half, 4)
    want = poisoned(lay.shape(B, 10), DEVICE)
    got = want.clone()
    args = (*rings, *new, start, emit, w, cos, sin)
    ref.compress(*args, want, m, overlap, 1e-6)
    tcompress.compress(*args, got, m, overlap, 1e-6)
    assert torch.equal(got, want)
