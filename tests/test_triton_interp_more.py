"""Raw Triton launchers of plan, cache_write, compress and sinkhorn vs the reference ops.

On a machine without CUDA the kernels run under ``TRITON_INTERPRET=1`` (numpy, one program at a
time), so shapes stay small; on a CUDA machine the same tests launch the compiled kernels. Every
output / pool is poisoned before the launch (NaN for floats, a large negative value for ints),
so anything a kernel fails to write, or writes where it should not, shows up.
"""
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported
DEVICE = torch.device("cuda" if CUDA else "cpu")

from dsv4_ops.reference import ops as ref  # noqa: E402
from test_triton_interp import _kernel_module  # noqa: E402

tplan = _kernel_module("plan")
tcache = _kernel_module("cache_write")
tcompress = _kernel_module("compress")
tsinkhorn = _kernel_module("sinkhorn")

I32 = torch.int32


def i32(x):
    return torch.tensor(x, dtype=I32, device=DEVICE)


# --------------------------------------------------------------------------------------
# plan
# --------------------------------------------------------------------------------------
PLAN_CASES = {
    # name: (lengths, n_new, num_tokens, steps, window, win_ring, win_concat, csa m, csa ring, hca m, hca ring)
    "decode": ([5, 0, 127], [1, 1, 1], 1, 1, 4, 4, False, 4, 8, 8, 8),
    "verify_with_padding_row": ([7, 126, 3], [4, 0, 2], 4, 1, 4, 9, False, 4, 8, 8, 8),
    "concat_prefill": ([0, 13], [9, 5], 9, 1, 4, 4, True, 4, 8, 4, 4),
    "mtp_steps": ([127, 128], [1, 1], 1, 3, 4, 6, False, 4, 8, 128, 130),
    "chunk_larger_than_ring": ([3, 1], [6, 2], 6, 1, 2, 7, False, 2, 4, 4, 4),
    "many_query_blocks_and_wide_window": ([0, 200], [70, 33], 70, 1, 200, 199, True, 4, 8, 16, 16),
    "v4_rates_prefill": ([0, 1000], [130, 129], 130, 1, 128, 128, True, 4, 8, 128, 128),
    "positions_near_int32_max": ([2**31 - 12], [4], 4, 2, 8, 11, False, 4, 8, 128, 128),
}


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_plan_matches_reference_exactly(case, poison):
    lengths, n_new, *rest = PLAN_CASES[case]
    args = (i32(lengths), i32(n_new), *rest)
    want = ref.plan(*args)
    out = tuple(poison(torch.empty(w.shape, dtype=I32, device=DEVICE)) for w in want)
    got = tplan.plan(*args, out=out)
    assert all(g is o for g, o in zip(got, out))
    for name, g, w in zip(("positions", "win_write", "win_idx", "csa_len", "csa_emit", "csa_write", "hca_len",
                           "hca_emit", "hca_write"), got, want):
        assert torch.equal(g, w), f"{name}:\n{g}\nwant\n{w}"


def test_plan_allocates_contiguous_outputs_and_handles_empty():
    args = (i32([4, 9]), i32([2, 1]), 3, 2, 5, 8, False, 4, 8, 8, 8)
    for g, w in zip(tplan.plan(*args), ref.plan(*args)):
        assert g.dtype == I32 and g.is_contiguous() and torch.equal(g, w)
    empty = (i32([4, 9]), i32([0, 0]), 0, 1, 5, 8, False, 4, 8, 8, 8)  # num_tokens = 0: nothing to launch
    assert [g.shape for g in tplan.plan(*empty)] == [w.shape for w in ref.plan(*empty)]
    with pytest.raises(ValueError, match=r"plan: out\[2\] must be a contiguous int32 tensor of shape"):
        tplan.plan(*args, out=tuple(torch.empty(w.shape, dtype=I32, device=DEVICE).mT if w.dim() == 4 else
                                    torch.empty(w.shape, dtype=I32, device=DEVICE) for w in ref.plan(*args)))


# --------------------------------------------------------------------------------------
# cache_write
# --------------------------------------------------------------------------------------
def _slots(B, S, N, p_skip=0.3):
    slots = torch.stack([torch.randperm(max(N, S))[:S] for _ in range(B)]).to(I32)
    skip = (torch.rand(B, S) < p_skip) | (slots >= N)
    return torch.where(skip, -1, slots).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,N,S,C", [(2, 8, 3, 5), (1, 16, 1, 512), (2, 6, 6, 1100)],
                         ids=["small", "decode_row", "full_ring_two_channel_blocks"])
def test_cache_write_matches_reference(B, N, S, C, dtype, poison):
    cache = poison(torch.empty(B, N, C, device=DEVICE, dtype=dtype))
    values = torch.randn(B, S, C, device=DEVICE).to(dtype)
    slots = _slots(B, S, N)
    first = slots[0].tolist()  # make the last row addressable, keeping row 0's slots distinct
    if N - 1 in first:
        slots[0, first.index(N - 1)] = first[0]
    slots[0, 0] = N - 1
    want = cache.clone()
    ref.cache_write(want, values, slots)
    assert tcache.cache_write(cache, values, slots) is None
    torch.testing.assert_close(cache, want, rtol=0, atol=0, equal_nan=True)


def test_cache_write_into_a_layer_view_and_skips():
    stacked = torch.randn(3, 2, 8, 4, device=DEVICE)
    before = stacked.clone()
    values = torch.randn(2, 3, 4, device=DEVICE)
    slots = i32([[-1, 7, 0], [-1, -1, -1]])  # row 1: every slot skipped
    tcache.cache_write(stacked[1], values, slots)
    want = before[1].clone()
    ref.cache_write(want, values, slots)
    assert torch.equal(stacked[1], want)
    assert torch.equal(stacked[0], before[0]) and torch.equal(stacked[2], before[2])
    # strided values (a channel slice of a wider projection) and slots past N are skipped
    wide = torch.randn(2, 3, 10, device=DEVICE)
    cache = torch.randn(2, 8, 4, device=DEVICE)
    want = cache.clone()
    tcache.cache_write(cache, wide[..., 2:6], i32([[1, 8, 3], [99, 0, -1]]))
    ref.cache_write(want, wide[..., 2:6], i32([[1, -1, 3], [-1, 0, -1]]))
    assert torch.equal(cache, want)


# --------------------------------------------------------------------------------------
# compress
# --------------------------------------------------------------------------------------
def _tables(P, half):
    angle = torch.rand(P, half, device=DEVICE) * 6.283
    return angle.cos(), angle.sin()


def _drive(T, chunks, m, overlap, poison, d=16, half=4, dtype=torch.float32, ring_extra=0):
    """Feed rows of lengths ``T`` in chunks (``chunks[b][k]`` tokens of row b at step k, 0 =
    padding row) through plan -> compress -> ring writes, once with the reference ops and once
    with the Triton launchers (compress + cache_write) on identical copies of the state. The
    pools start poisoned and must agree (NaN where nothing was emitted) after every step."""
    B, c = len(T), (2 if overlap else 1)
    R = c * m + ring_extra
    norm_w = torch.rand(d, device=DEVICE) + 0.5
    cos, sin = _tables(max(T) + m, half)
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
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(mine[2], state[2], equal_nan=True, **tol, msg=lambda s: f"step {k}: {s}")
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
def test_compress_matches_reference(case, poison):
    m, overlap, T, chunks, kw = COMPRESS_CASES[case]
    emitted = _drive(T, chunks, m, overlap, poison, **kw)
    assert emitted == sum(t // m for t in T)


def test_compress_skips_minus_one_and_out_of_range_blocks(poison):
    """Emit slots of -1 (and, in the raw launcher, blocks >= N) leave the pool untouched;
    E = 0 and S = 0 launch nothing."""
    m, d, half, B = 4, 16, 4, 2
    cos, sin = _tables(64, half)
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
    torch.testing.assert_close(pool, want, equal_nan=True, atol=1e-5, rtol=1e-5)
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


# --------------------------------------------------------------------------------------
# sinkhorn
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", [None, dict(BLOCK_T=8), dict(BLOCK_T=64, num_warps=4)],
                         ids=["default", "prefill_tile", "4_warps"])
@pytest.mark.parametrize("T, N, iters", [(1, 4, 20), (130, 4, 20), (7, 2, 5), (5, 3, 2), (3, 4, 1)])
def test_sinkhorn_matches_reference(T, N, iters, config, poison):
    """T = 130 spans several programs in every tile (2, 8 or 64 matrices of 4 x 4 each); N = 3 pads to 4."""
    comb = (torch.rand(T, N, N, device=DEVICE) * 3).softmax(-1) + 1e-6
    out = poison(torch.empty(T, N, N, device=DEVICE))
    tsinkhorn.sinkhorn(comb, iters, 1e-6, out=out, config=config)
    torch.testing.assert_close(out, ref.sinkhorn(comb, iters, 1e-6), atol=1e-6, rtol=1e-5)


def test_sinkhorn_config_is_one_warp_with_a_lane_per_entry_at_decode():
    """A decode step's few matrices: one warp, 32 entries (two 4 x 4 matrices) per program, so the
    row / column sums stay inside the warp; a long prefill's: 4 entries per lane."""
    assert tsinkhorn.sinkhorn_config(1, 4) == dict(BLOCK_T=2, num_warps=1)
    assert tsinkhorn.sinkhorn_config(64, 4) == dict(BLOCK_T=2, num_warps=1)
    assert tsinkhorn.sinkhorn_config(8192, 4) == dict(BLOCK_T=2, num_warps=1)
    assert tsinkhorn.sinkhorn_config(8193, 4) == dict(BLOCK_T=8, num_warps=1)
    assert tsinkhorn.sinkhorn_config(1, 2) == dict(BLOCK_T=8, num_warps=1)
    assert tsinkhorn.sinkhorn_config(1, 3) == dict(BLOCK_T=2, num_warps=1)


def _op_inputs():
    """Small inputs for every torch.ops.dsv4 op: (name, args), each with -1 sentinels."""
    cos, sin = _tables(32, 4)
    cache, values, slots = torch.randn(2, 6, 8, device=DEVICE), torch.randn(2, 2, 8, device=DEVICE), \
        i32([[0, 5], [-1, 2]])
    ring = [torch.randn(2, 8, 32, device=DEVICE) for _ in range(2)]
    new = [torch.randn(2, 2, 32, device=DEVICE) for _ in range(2)]
    compress = (*ring, *new, i32([6, 2]), i32([[1], [0]]), torch.rand(16, device=DEVICE) + 0.5, cos, sin,
                torch.randn(2, 4, 16, device=DEVICE), 4, True, 1e-6)
    q = torch.randint(-2, 3, (2, 2, 4, 32), device=DEVICE).float()
    keys = torch.randint(-2, 3, (2, 40, 32), device=DEVICE).float()
    indexer = (q, torch.randint(1, 3, (2, 2, 4), device=DEVICE).float(), keys, i32([[40, 3], [0, 17]]), 8)
    attention = (torch.randn(2, 2, 4, 64, device=DEVICE), torch.randn(2, 12, 64, device=DEVICE),
                 i32([[[0, 11, -1], [3, -1, 5]], [[7, 7, 2], [-1, -1, -1]]]), torch.randn(2, 10, 64, device=DEVICE),
                 i32([[[9, -1], [0, 1]], [[-1, -1], [4, 2]]]), i32([[3, 0], [10, 2]]), torch.randn(4, device=DEVICE),
                 0.125)
    return {"plan": (i32([3, 9]), i32([2, 1]), 2, 1, 4, 6, False, 4, 8, 8, 8),
            "cache_write": (cache, values, slots), "compress": compress, "indexer_topk": indexer,
            "sparse_attention": attention, "sinkhorn": (torch.rand(3, 2, 4, 4, device=DEVICE) + 0.1, 20, 1e-6)}


OP_KERNELS = {"plan": ["plan_kernel"], "cache_write": ["cache_write_kernel"], "compress": ["compress_kernel"],
              "indexer_topk": ["indexer_scores_kernel", "topk_row_kernel"],
              "sparse_attention": ["sparse_attention_kernel"], "sinkhorn": ["sinkhorn_kernel"]}
OP_MODULES = {"plan": "plan", "cache_write": "cache_write", "compress": "compressor", "indexer_topk": "indexer",
              "sparse_attention": "attention", "sinkhorn": "sinkhorn"}


def test_op_bodies_launch_their_kernels_through_wrap_triton(monkeypatch):
    """The Triton branch of every op body (CPU tensors take it here, under the interpreter)
    launches its kernels through ``wrap_triton`` and matches the reference op."""
    import sys

    from dsv4_ops import lowering

    monkeypatch.setattr(lowering, "use_triton", lambda device_type: True)
    launched = []
    for op, module in OP_MODULES.items():
        mod = sys.modules[f"dsv4_ops.ops.{module}"]

        def spy(kernel, real=mod.wrap_triton):
            launched.append(kernel.fn.__name__)
            return real(kernel)

        monkeypatch.setattr(mod, "wrap_triton", spy)
    for op, args in _op_inputs().items():
        launched.clear()
        mine = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        want = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        got = getattr(torch.ops.dsv4, op)(*mine)
        expect = getattr(ref, op)(*want)
        assert launched == OP_KERNELS[op], op
        for g, w in zip(got if isinstance(got, tuple) else [got] + mine, expect if isinstance(expect, tuple)
                        else [expect] + want):
            if isinstance(g, torch.Tensor):
                torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=lambda m: f"{op}: {m}")


def test_out_of_range_values_read_like_the_reference(poison):
    """The raw-op contract on the Triton path: slots / emitted blocks outside the tensor are
    skipped like -1, a rope row past the table leaves the entry unrotated, negative lengths
    and n_new count as 0 -- exactly what the reference does with the same values."""
    cache, values = torch.randn(2, 6, 8, device=DEVICE), torch.randn(2, 3, 8, device=DEVICE)
    bad, clean = i32([[6, 1, 99], [-5, 2, 2**31 - 1]]), i32([[-1, 1, -1], [-1, 2, -1]])
    got, want, skipped = cache.clone(), cache.clone(), cache.clone()
    tcache.cache_write(got, values, bad)
    ref.cache_write(want, values, bad)
    ref.cache_write(skipped, values, clean)
    assert torch.equal(got, want) and torch.equal(want, skipped)

    m, d, half = 4, 16, 4
    cos, sin = _tables(6, half)  # rope rows 0..5: block 2 (position 8) is past the table
    ring = [torch.randn(2, 2 * m, 2 * d, device=DEVICE) for _ in range(2)]
    new = [torch.randn(2, 4, 2 * d, device=DEVICE) for _ in range(2)]
    rest = (i32([8, 4]), torch.rand(d, device=DEVICE) + 0.5, cos, sin)
    pool = poison(torch.empty(2, 3, d, device=DEVICE))
    bad, clean = i32([[2, 3, -4], [1, 2**31 - 1, 7]]), i32([[2, -1, -1], [1, -1, -1]])
    got, want, skipped = pool.clone(), pool.clone(), pool.clone()
    tcompress.compress(*ring, *new, rest[0], bad, *rest[1:], got, m, True, 1e-6)
    ref.compress(*ring, *new, rest[0], bad, *rest[1:], want, m, True, 1e-6)
    ref.compress(*ring, *new, rest[0], clean, *rest[1:], skipped, m, True, 1e-6)
    torch.testing.assert_close(got, want, equal_nan=True, atol=1e-5, rtol=1e-5)
    assert torch.equal(want.nan_to_num(7.0), skipped.nan_to_num(7.0))
    assert not want[0, 2].isnan().any()  # written, unrotated

    args = (3, 2, 4, 8, False, 4, 8, 8, 8)
    for bad, clean in (((i32([-7, 5]), i32([2, -3])), (i32([0, 5]), i32([2, 0]))),):
        got = tplan.plan(*bad, *args)
        for g, w, c in zip(got, ref.plan(*bad, *args), ref.plan(*clean, *args)):
            assert torch.equal(g, w) and torch.equal(w, c)


def test_importing_the_kernels_leaves_the_interpreter_alone():
    """The numpy-2.4 fix of Triton's interpreter is a test-only patch (conftest.py): importing
    the package and every kernel module under ``TRITON_INTERPRET=1`` modifies nothing in Triton."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import triton.runtime.interpreter as i; before = i._patch_lang_tensor\n"
            "import dsv4_ops, importlib\n"
            "for m in ('sparse_attention', 'indexer', 'plan', 'cache_write', 'compress', 'sinkhorn'):\n"
            "    importlib.import_module('dsv4_ops.lowering.triton.' + m)\n"
            "assert i._patch_lang_tensor is before and not hasattr(i, '_dsv4_index_fix')\n")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
