"""The model with ``kv_cache_dtype="fp8"``: every prefill and decode logit equals the FP8
reference numerics (``simulate_fp8_cache``: float caches that quantise -> dequantise every
write, rotated indexer keys) within ``fp8_cache_model_vs_simulated`` (1e-4 in fp32), and the
cache-free forward with those numerics (a different step structure) within
``fp8_cache_model_vs_cache_free`` (2e-3); the FP8 cache moves the logits away from the float cache
by a measured, bounded amount; the compiled FP8 step never recompiles; and a cache dtype that
cannot run is refused where the cache is configured.

One model for the file (tiny config with ``head_dim = 144``: 128 nope dims = two ue8m0 blocks,
16 rope dims; sliding + CSA + HCA layers, HCA rate 8 so decode crosses its blocks)."""
from __future__ import annotations

import pytest
import torch

import dsv4_ops
from dsv4_ops import DeepseekV4ForCausalLM, DSV4Config, Generator
from dsv4_ops.model.kv_cache_dtype import check_kv_cache_dtype
from dsv4_ops.ops import attention_sm90 as sm90  # noqa: F401
from routes import triton_attention
from model_util import random_model

CFG = DSV4Config.tiny(head_dim=144, num_hidden_layers=3, hca_ratio=8)
PROMPTS = [[3, 1, 4, 1, 5], list(range(40)), [7] * 17]
STEPS = 24  # decode steps: crosses the window (16) and several HCA (8) / CSA (4) blocks
# fp8-vs-float cache logit drift, relative to the largest logit. Measured on this random model:
# mean 1.4e-2, max 0.24 (a decode position after an indexer top-k pick changed; random weights
# make near-ties common). Bounds with ~3x headroom.
DRIFT_MEAN_BOUND, DRIFT_MAX_BOUND = 0.05, 0.75


@pytest.fixture(scope="module")
def model():
    return random_model(CFG)


def _feed() -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, CFG.vocab_size, (STEPS, len(PROMPTS)), generator=g)


def _generator_logits(model, kv_cache_dtype: str, device) -> torch.Tensor:
    """``[B, 1 + STEPS, vocab]``: the prefill logits, then one decode step per fed token."""
    gen = Generator(model, max_batch_size=4, max_seq_len=96, prefill_chunk=16, compile=False,
                    kv_cache_dtype=kv_cache_dtype)
    feed = _feed().to(device)
    out = [gen.prefill(PROMPTS)]
    out += [gen.decode(feed[t]) for t in range(STEPS)]
    return torch.stack(out, dim=1).cpu()


def _oracle_logits(model, device) -> torch.Tensor:
    """The same positions from the cache-free forward of each whole sequence, FP8 simulated."""
    feed = _feed()
    model.simulate_fp8_cache(True)
    try:
        rows = []
        for b, p in enumerate(PROMPTS):
            seq = torch.tensor([p + feed[:, b].tolist()], device=device)
            rows.append(model(seq)[0, len(p) - 1:].cpu())
        return torch.stack(rows)
    finally:
        model.simulate_fp8_cache(False)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def logits(request, model):
    """fp8 path, its oracle, and the float-cache path, on one device (cuda: the Triton kernels)."""
    m = model.to(request.param)
    out = dict(fp8=_generator_logits(m, "fp8", request.param), float=_generator_logits(m, "auto", request.param),
               bf16=_generator_logits(m, "bf16", request.param), cache_free=_oracle_logits(m, request.param))
    m.simulate_fp8_cache(True)
    try:
        out["simulated"] = _generator_logits(m, "auto", request.param)
    finally:
        m.simulate_fp8_cache(False)
        model.to("cpu")
    return out


def test_fp8_cache_matches_the_fp8_reference_numerics(logits, tol):
    """Same steps, float caches with the simulated quantisation: the bytes the FP8 cache holds
    decode to exactly the simulated values, so only fp32 noise remains (measured ~4e-7)."""
    err = _rel(logits["fp8"], logits["simulated"])
    print(f"fp8 cache vs fp8 reference numerics (float caches, simulated): max rel err {err:.2e}")
    assert err <= tol("fp8_cache_model_vs_simulated")["rel"]


def test_fp8_cache_matches_the_cache_free_fp8_forward(logits, tol):
    """One cache-free pass per sequence (other matmul shapes than the cached steps): the fp32
    noise between the two (~2e-6 without quantisation) can put a value on the other side of an
    e4m3 rounding boundary, a one-code change in one cache entry that later positions see
    (measured ~8e-4 at worst, from the step of the flip on; 1e-6 before it)."""
    err = (logits["fp8"] - logits["cache_free"]).abs().amax(-1) / logits["cache_free"].abs().max()
    print(f"fp8 cache vs cache-free fp8 forward: max rel err {float(err.max()):.2e}, "
          f"positions within 1e-5: {float((err <= 1e-5).float().mean()):.0%}")
    assert float(err.max()) <= tol("fp8_cache_model_vs_cache_free")["rel"]
    assert float((err <= 1e-5).float().mean()) >= 0.6  # most positions agree to fp32 noise


def test_fp8_cache_drift_from_the_float_cache_is_measured_and_bounded(logits):
    drift = _rel(logits["fp8"], logits["float"])
    scale = logits["float"].abs().max()
    mean = float((logits["fp8"] - logits["float"]).abs().mean() / scale)
    prefill = _rel(logits["fp8"][:, 0], logits["float"][:, 0])
    agree = float((logits["fp8"].argmax(-1) == logits["float"].argmax(-1)).float().mean())
    print(f"float-vs-fp8 cache logit drift (relative to the largest logit): max {drift:.3e}, mean {mean:.3e}, "
          f"prefill max {prefill:.3e}; argmax agreement {agree:.0%}")
    assert 1e-4 < mean < DRIFT_MEAN_BOUND  # the quantisation is really on, and it stays small
    assert drift < DRIFT_MAX_BOUND


def test_a_float32_model_runs_every_layer_kind_over_a_bf16_cache(logits):
    """``kv_cache_dtype="bf16"`` under fp32 weights: each layer's attention gets one dtype for its
    window and its pool (a sliding layer's empty pool too; the CUDA kernels refuse a mix), and the
    logits move by bf16 rounding, less than the FP8 cache moves them."""
    drift = (logits["bf16"] - logits["float"]).abs().mean() / logits["float"].abs().max()
    fp8_drift = (logits["fp8"] - logits["float"]).abs().mean() / logits["float"].abs().max()
    print(f"bf16 cache vs fp32 cache: mean rel drift {float(drift):.2e} (fp8 cache: {float(fp8_drift):.2e})")
    assert logits["bf16"].isfinite().all() and 0 < drift < fp8_drift


def test_fp8_pool_is_smaller(model):
    model.setup_caches(2, 256)
    float_bytes = model.cache_nbytes()
    model.setup_caches(2, 256, kv_cache_dtype="fp8")
    fp8_bytes = model.cache_nbytes()
    model.clear_caches()
    assert fp8_bytes < 0.75 * float_bytes, (fp8_bytes, float_bytes)


def test_compiled_fp8_decode_step_never_recompiles():
    """``torch.compile(fullgraph=True)`` of the cached decode step over an FP8 pool: one graph,
    no recompile over 40 steps (crossing the window ring, CSA blocks, indexer top-k growth),
    logits equal to the eager step. One CSA layer holds every FP8 cache kind (window ring, KV
    pool, indexer keys); the HCA pool is the same KV format. (The Generator's own compile
    test covers prefill + decode; on this 2-core CI box each graph costs about a minute.)

    The indexer keeps every visible entry here (``index_topk`` 32 >= the 24 entries of 96
    positions): it scores FP8 queries, and the compiled and eager query projections differ in
    their last bits, so now and then one query value rounds to the neighbouring e4m3 code and a
    near-tie pick flips, which no tolerance on the logits could tell from a bug. The compiled
    selection itself is compared on equal inputs in ``test_compiled_fp8_indexer_equals_eager``."""
    import copy

    cfg = DSV4Config.tiny(head_dim=144, num_hidden_layers=1, layer_types=["compressed_sparse_attention"],
                          mlp_layer_types=["moe"], index_topk=32)
    eager = random_model(cfg)
    eager.setup_caches(2, 96, kv_cache_dtype="fp8")
    compiled_model = copy.deepcopy(eager)
    step = torch.compile(compiled_model, fullgraph=True, dynamic=False)
    lengths = {"eager": torch.zeros(2, dtype=torch.int32), "compiled": torch.zeros(2, dtype=torch.int32)}
    prompt = torch.randint(0, cfg.vocab_size, (2, 20))
    one = torch.ones(2, dtype=torch.int32)
    for name, m in (("eager", eager), ("compiled", compiled_model)):  # prefill eagerly, same state
        m(prompt, lengths[name], torch.full((2,), 20, dtype=torch.int32), last_only=True)
        lengths[name] += 20
    feed = torch.randint(0, cfg.vocab_size, (41, 2, 1))
    step(feed[0], lengths["compiled"], one, last_only=True)  # warm-up: the one compile
    eager(feed[0], lengths["eager"], one, last_only=True)
    for t in lengths.values():
        t += 1
    with torch.compiler.set_stance("fail_on_recompile"):
        for t in range(1, 41):
            got = step(feed[t], lengths["compiled"], one, last_only=True)
            want = eager(feed[t], lengths["eager"], one, last_only=True)
            assert (got - want).abs().max() <= 1e-4 * want.abs().max(), t
            lengths["compiled"] += 1
            lengths["eager"] += 1


def test_compiled_fp8_indexer_equals_eager():
    """``indexer_topk`` over FP8 keys compiled (``fullgraph``) picks what the eager op picks from the
    same inputs: the FP8 queries' codes and scales, the scores and the tie rule survive compilation.
    Queries near e4m3 rounding midpoints and ties in the scores make a wrong rounding visible."""
    from dsv4_ops.reference import fp8_cache as fp8
    from dsv4_ops.reference import ops as ref

    torch.manual_seed(7)
    B, S, HI, DI, N, k = 2, 3, 4, 32, 48, 8
    keys = torch.empty(fp8.IndexerLayout(DI, 16).shape(B, N), dtype=torch.uint8)
    ref._write_entries_fp8(keys, torch.randn(B, N, DI), torch.arange(N, dtype=torch.int32).expand(B, N).contiguous())
    q = fp8.rotate(torch.randn(B, S, HI, DI))
    q[0, 0, 0, :8] = torch.tensor([1.0, 1.0625, 1.125, 1.1875, 2.25, 2.375, -1.0625, 0.0]) * 32  # midpoints
    q[1] = 0.0  # all scores 0: every pick decided by the tie rule
    w = torch.randn(B, S, HI)
    vis = torch.tensor([[N, 20, 0], [N, 7, 33]], dtype=torch.int32)

    def pick(q, w, keys, vis):
        return dsv4_ops.indexer_topk(q, w, keys, vis, k)
    want = pick(q, w, keys, vis)
    assert torch.equal(want, ref.indexer_topk(q, w, keys, vis, k))
    assert torch.equal(torch.compile(pick, fullgraph=True)(q, w, keys, vis), want)


def test_unknown_cache_dtype_is_refused_naming_the_argument(model):
    with pytest.raises(ValueError, match=r"setup_caches: kv_cache_dtype must be one of .*'fp16'"):
        model.setup_caches(1, 16, kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of"):
        Generator(model, max_batch_size=1, max_seq_len=16, compile=False, kv_cache_dtype=torch.float8_e4m3fn)


def test_fp8_cache_is_refused_where_it_cannot_be_read():
    # the tiny default keeps 64 - 16 = 48 nope dims: no whole 64-value scale block
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' needs head_dim - rope_head_dim .* 48"):
        random_model(DSV4Config.tiny(num_hidden_layers=1)).setup_caches(1, 16, kv_cache_dtype="fp8")
    # no kernel reads it on the meta device (nor on any device type but cpu / cuda)
    meta = DeepseekV4ForCausalLM(CFG, device="meta")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8': no kernel reads the FP8 cache on device 'meta'"):
        meta.setup_caches(1, 16, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"power-of-two index_head_dim"):
        check_kv_cache_dtype("export: kv_cache_dtype", "fp8", DSV4Config.tiny(head_dim=144, index_head_dim=48), "cpu")


def test_speculative_decoding_over_the_fp8_cache_keeps_the_greedy_tokens(model):
    """MTP drafts (the MTP block gets its own FP8 window) + verify steps over FP8 caches: the same
    tokens as plain greedy decoding over FP8 caches."""
    kw = dict(max_batch_size=2, max_seq_len=80, prefill_chunk=16, compile=False, kv_cache_dtype="fp8")
    prompts = [[3, 1, 4, 1, 5], list(range(30))]
    plain = Generator(model, **kw).generate(prompts, max_new_tokens=16)
    assert Generator(model, spec_steps=2, **kw).generate(prompts, max_new_tokens=16) == plain


# V4's attention widths (64 heads x 512 = 448 nope + 64 rope, window 128, indexer 64 heads x 128,
# top-512) around a tiny rest: the launch configs the Flash-width kernels really take (block
# sizes, stages, shared memory), which the head_dim-144 model above never reaches.
V4_ATTENTION = DSV4Config.tiny(head_dim=512, rope_head_dim=64, num_attention_heads=64, o_groups=8,
                               sliding_window=128, index_n_heads=64, index_head_dim=128, index_topk=512,
                               num_hidden_layers=3, hca_ratio=128, max_position_embeddings=8192)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_fp8_cache_at_v4_attention_widths_matches_the_fp8_reference(dtype, bound):
    """Prefill of 2100 tokens (the CSA pool passes top-512, HCA emits blocks of 128) in 64-token
    chunks, then decode: the FP8 cache's logits equal the simulated FP8 numerics on float caches.
    The cache values are identical (e4m3 codes times a power of two are exact in bf16), so what
    remains is kernel noise; found on the H200: at these widths the FP8 attention config asked
    more shared memory than sm_90 has."""
    m = random_model(V4_ATTENTION, dtype=dtype, device="cuda")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, V4_ATTENTION.vocab_size, (n,), generator=g).tolist() for n in (2100, 700)]
    feed = torch.randint(0, V4_ATTENTION.vocab_size, (8, 2), generator=g).cuda()

    def run(kv_cache_dtype):
        gen = Generator(m, max_batch_size=2, max_seq_len=2200, prefill_chunk=64, compile=False,
                        kv_cache_dtype=kv_cache_dtype)
        return torch.stack([gen.prefill(prompts)] + [gen.decode(feed[t]) for t in range(len(feed))], 1).float()

    # the Triton kernels on both sides (not the sm_90 Gluon route, which serves FP8 pages from batch 1):
    # the same 32-row blocks, so the bf16 rounding of P is the same, and what is compared is the cache's
    # numerics, not two kernels' rounding, which these logits amplify. The Gluon FP8 reader inside this
    # model: tests/ops/sparse_attention/test_sparse_attention_sm90_fp8.py, call by call against the Triton kernel
    with triton_attention():
        fp8_logits = run("fp8")
    m.simulate_fp8_cache(True)
    try:
        with triton_attention():
            want = run("auto")
    finally:
        m.simulate_fp8_cache(False)
    err = _rel(fp8_logits, want)
    print(f"{dtype}: fp8 cache vs fp8 reference numerics at V4 attention widths, max rel err {err:.2e}")
    assert fp8_logits.isfinite().all() and err <= bound


@pytest.mark.gpu
def test_compiled_cuda_graphed_fp8_generator_keeps_the_eager_tokens():
    """The FP8 kernels inside compiled graphs (Inductor copies each wrap_triton kernel's source;
    the copies once failed with NameError) and CUDA-graph replays: the greedy tokens of the eager
    FP8 generator, no recompile."""
    m = random_model(CFG, device="cuda")
    kw = dict(max_batch_size=4, max_seq_len=96, prefill_chunk=16, kv_cache_dtype="fp8")
    want = Generator(m, compile=False, **kw).generate(PROMPTS, 24)
    gen = Generator(m, compile=True, cuda_graphs=True, **kw)
    gen.generate(PROMPTS, 2)  # compile + record
    with torch.compiler.set_stance("fail_on_recompile"):
        assert gen.generate(PROMPTS, 24) == want
    assert gen.stats["recompiles"] == 0 and gen.stats["cuda_graph_replays"] > 0
