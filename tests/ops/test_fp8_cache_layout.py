"""The FP8 cache formats (``dsv4_ops/reference/fp8_cache.py``) through the public ops: the
quantisation rule, FlashMLA's V4 byte layout (data rows, then the page footer of scales),
write -> read equal to the reference quant-sim bit for bit, untouched sentinels and unwritten
entries, and the bad inputs the wrappers refuse. Reference path (CPU); the Triton kernels are
checked against the same functions in the ops' ``test_<op>_kernels.py`` and the codec in
``test_fp8_codec.py``."""
from __future__ import annotations

import pytest
import torch

import dsv4_ops.ops as ops
from dsv4_ops.reference import fp8_cache as fp8
from dsv4_ops.reference import ops as ref
from fp8_cases import POISON, poisoned, write_index_keys


def test_v4_layout_is_flashmla_model1():
    lay = fp8.KVLayout(512, 64)
    assert (lay.nope, lay.data_bytes, lay.scale_bytes, lay.entry_bytes) == (448, 576, 8, 584)
    assert fp8.IndexerLayout(128).entry_bytes == 132
    cache = torch.empty(fp8.KVLayout(512, 64, 64).shape(3, 100), dtype=torch.uint8)
    assert cache.shape == (3, 2, 64, 584) and fp8.KVLayout.of(cache, 512) == fp8.KVLayout(512, 64, 64)


def test_scale_is_the_smallest_power_of_two_that_fits_448():
    amax = torch.cat([torch.logspace(-7, 7, 4001), 448 * 2.0 ** torch.arange(-20, 20),
                      torch.nextafter(448 * 2.0 ** torch.arange(-20, 20), torch.tensor(1e30))])
    e = fp8.scale_exponent(amax)
    s = 2.0 ** (e.double() - 127)
    a = amax.double().clamp(min=fp8.AMAX_FLOOR)
    assert bool((a / s <= 448).all()) and bool((a / (s / 2) > 448).all())


def test_quantise_then_dequantise_is_exact_e4m3_and_idempotent():
    x = torch.randn(4, 7, 144) * torch.logspace(-3, 3, 144)
    data, scales = fp8.quantize_kv(x, 16)
    lay = fp8.KVLayout(144, 16)
    y = fp8.dequantize_kv(data, scales, lay)
    s = 2.0 ** (scales[..., :2].float() - 127)
    codes = (x[..., :128].unflatten(-1, (2, 64)) / s[..., None]).flatten(-2)
    assert torch.equal(data[..., :128], codes.to(torch.float8_e4m3fn).view(torch.uint8))  # RNE e4m3 of x / s
    assert torch.equal(y[..., 128:], x[..., 128:].bfloat16().float())  # rope: bf16
    assert bool((scales[..., 2:] == 0).all())  # pad bytes
    assert torch.equal(fp8.simulate_kv(y, 16), y)


def _kv_cache(B, n, D, rope, page):
    return poisoned(fp8.KVLayout(D, rope, page).shape(B, n))


def test_cache_write_round_trips_bit_for_bit_and_puts_scales_in_the_footer():
    B, D, rope, page = 2, 144, 16, 4
    lay = fp8.KVLayout(D, rope, page)
    cache = _kv_cache(B, 10, D, rope, page)
    values = torch.randn(B, 5, D) * 3
    slots = torch.tensor([[0, 5, -1, 9, 2], [7, -1, -1, 3, 11]], dtype=torch.int32)
    ops.cache_write(cache, values, slots)
    got = fp8.read_kv(cache, D)
    want = fp8.simulate_kv(values, rope)
    data, scales = fp8.quantize_kv(values, rope)
    flat = cache.view(B, -1)
    for b in range(B):
        for s in range(5):
            i = int(slots[b, s])
            if i < 0:
                continue
            assert torch.equal(got[b, i], want[b, s])
            p, t = divmod(i, page)
            base = p * page * lay.entry_bytes
            assert torch.equal(flat[b, base + t * 160: base + (t + 1) * 160], data[b, s])  # data row t
            foot = base + page * 160 + t * 8
            assert torch.equal(flat[b, foot: foot + 8], scales[b, s])  # footer row t
    written = torch.zeros(B, 12, dtype=torch.bool)
    for b in range(B):
        written[b, slots[b][slots[b] >= 0].long()] = True
    rows = fp8.to_entries(cache, lay.data_bytes)
    assert bool((rows[~written] == POISON).all())  # unwritten entries (and skipped -1 slots) untouched


def test_compress_quantises_exactly_the_float_entries():
    torch.manual_seed(1)
    B, m, d, half = 2, 4, 144, 8
    ring = [torch.randn(B, 16, 2 * d) for _ in range(2)]
    new = [torch.randn(B, 9, 2 * d) for _ in range(2)]
    start = torch.tensor([5, 12], dtype=torch.int32)
    emit = torch.tensor([[1, 2, -1], [3, 4, -1]], dtype=torch.int32)
    w, cos, sin = torch.rand(d) + 0.5, torch.randn(64, half), torch.randn(64, half)
    floats = torch.zeros(B, 12, d)
    ops.compress(*ring, *new, start, emit, w, cos, sin, floats, m, True, 1e-6)
    pool = _kv_cache(B, 12, d, 2 * half, 4)
    ops.compress(*ring, *new, start, emit, w, cos, sin, pool, m, True, 1e-6)
    got = fp8.read_kv(pool, d)
    for b, blocks in enumerate(([1, 2], [3, 4])):
        for i in blocks:
            assert torch.equal(got[b, i], fp8.simulate_kv(floats[b, i], 2 * half))
    assert bool((fp8.to_entries(pool, 160)[0, 0] == POISON).all())  # not emitted: untouched
    # indexer keys (entry_bytes = d + 4): Hadamard-rotated, then quantised
    DI = 32
    ring = [torch.randn(B, 16, 2 * DI) for _ in range(2)]
    new = [torch.randn(B, 9, 2 * DI) for _ in range(2)]
    floats = torch.zeros(B, 12, DI)
    ops.compress(*ring, *new, start, emit, w[:DI], cos, sin, floats, m, True, 1e-6)
    keys = poisoned(fp8.IndexerLayout(DI, 4).shape(B, 12))
    ops.compress(*ring, *new, start, emit, w[:DI], cos, sin, keys, m, True, 1e-6)
    assert torch.equal(fp8.read_keys(keys)[1, 4], fp8.dequantize_keys(*fp8.quantize_keys(fp8.rotate(floats[1, 4]))))


def test_readers_equal_the_float_ops_on_the_dequantised_cache():
    torch.manual_seed(2)
    B, S, H, D = 2, 3, 4, 144
    window = _kv_cache(B, 8, D, 16, 8)
    pool = _kv_cache(B, 12, D, 16, 4)
    ops.cache_write(window, torch.randn(B, 8, D), torch.arange(8, dtype=torch.int32).expand(B, 8).contiguous())
    ops.cache_write(pool, torch.randn(B, 12, D), torch.arange(12, dtype=torch.int32).expand(B, 12).contiguous())
    q, sink = torch.randn(B, S, H, D), torch.randn(H)
    kv_idx = torch.randint(-1, 8, (B, S, 5), dtype=torch.int32)
    cmp_idx = torch.randint(-1, 12, (B, S, 3), dtype=torch.int32)
    cmp_len = torch.randint(0, 13, (B, S), dtype=torch.int32)
    got = ops.sparse_attention(q, window, kv_idx, pool, cmp_idx, cmp_len, sink, D**-0.5)
    want = ref.sparse_attention(q, fp8.read_kv(window, D), kv_idx, fp8.read_kv(pool, D), cmp_idx, cmp_len, sink,
                                D**-0.5)
    assert torch.equal(got, want)
    keys = poisoned(fp8.IndexerLayout(32, 4).shape(B, 12))
    write_index_keys(keys, torch.randn(B, 12, 32))
    qI, wI = torch.randn(B, S, 8, 32), torch.randn(B, S, 8)
    vis = torch.randint(0, 13, (B, S), dtype=torch.int32)
    assert torch.equal(ops.indexer_topk(qI, wI, keys, vis, 5), ref.indexer_topk(qI, wI, fp8.read_keys(keys), vis, 5))


def test_an_fp8_window_without_a_pool_is_served():
    """A sliding-window layer over an FP8 cache has no pool: the model passes an empty float
    ``cmp`` with the FP8 window, and the public op serves it like the raw op (session 20)."""
    torch.manual_seed(3)
    B, S, H, D = 2, 1, 4, 144
    window = _kv_cache(B, 8, D, 16, 8)
    ops.cache_write(window, torch.randn(B, 8, D), torch.arange(8, dtype=torch.int32).expand(B, 8).contiguous())
    q, sink, no_pool = torch.randn(B, S, H, D), torch.randn(H), torch.empty(B, 0, D)
    kv_idx = torch.randint(-1, 8, (B, S, 5), dtype=torch.int32)
    no_picks, no_prefix = torch.zeros(B, S, 0, dtype=torch.int32), torch.zeros(B, S, dtype=torch.int32)
    got = ops.sparse_attention(q, window, kv_idx, no_pool, no_picks, no_prefix, sink, D**-0.5)
    want = ref.sparse_attention(q, fp8.read_kv(window, D), kv_idx, no_pool, no_picks, no_prefix, sink, D**-0.5)
    assert torch.equal(got, want) and got.abs().sum() > 0
    assert torch.equal(got, torch.ops.dsv4.sparse_attention(q, window, kv_idx, no_pool, no_picks, no_prefix, sink,
                                                            D**-0.5))


def test_bad_fp8_inputs_are_refused_naming_the_argument():
    cache = _kv_cache(1, 8, 144, 16, 8)
    with pytest.raises(ValueError, match=r"cache_write: slots\[0, 0\] = 8 is beyond cache rows N=8"):
        ops.cache_write(cache, torch.randn(1, 1, 144), torch.tensor([[8]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cache_write: cache: an FP8 KV cache of 100-wide entries has no layout"):
        ops.cache_write(cache, torch.randn(1, 1, 100), torch.tensor([[0]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"sparse_attention: an FP8 window source kv needs an FP8 compressed pool "
                                         r".* or an empty one, got a torch.float32 pool of 3 entries"):
        ops.sparse_attention(torch.randn(1, 1, 2, 144), cache, torch.zeros(1, 1, 1, dtype=torch.int32),
                             torch.randn(1, 3, 144), torch.zeros(1, 1, 0, dtype=torch.int32),
                             torch.zeros(1, 1, dtype=torch.int32), torch.zeros(2), 0.1)
    with pytest.raises(ValueError, match=r"indexer_topk: keys \(FP8 indexer keys\) must be"):
        ops.indexer_topk(torch.randn(1, 1, 2, 32), torch.randn(1, 1, 2), cache, torch.ones(1, 1, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match=r"FP8 KV layout: dim - rope = 48 must be a non-negative multiple of 64"):
        fp8.KVLayout(64, 16)
