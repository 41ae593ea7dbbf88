"""``dsv4_ops.hf.enable``: HF transformers' own DeepseekV4ForCausalLM, in place, on the dsv4 ops.

The oracle is unpatched HF (same object, before ``enable`` / after ``disable``): its forward
logits, and its greedy / seeded-sampling ``generate`` of each prompt ALONE at batch 1 (HF's own
padded batches are not an oracle: its compressors see pad tokens). What could be silently wrong
and is checked here: pad tokens leaking into a window / compressed entry / indexer (a
left-padded batch must give each row what it gets alone, over >= 200 tokens so windows and both
compression rates wrap), stale state between generate calls (a second generate with other
prompt lengths), recompiles (counted), parameters copied instead of shared, `disable` leaving
anything behind (bit-identical outputs).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import dsv4_ops  # noqa: E402
from dsv4_ops.config import CSA, HCA, SLIDING, DSV4Config  # noqa: E402

from hf_util import make_hf, rel  # noqa: E402

# all three layer types, hash + biased MoE, 16 indexer heads; hc_mult 4 (tiny) and 2
CONFIGS = {
    "hc4": DSV4Config.tiny(),
    "hc2": DSV4Config.tiny(hc_mult=2, num_hidden_layers=5, layer_types=[SLIDING, CSA, HCA, CSA, HCA],
                           mlp_layer_types=["hash_moe", "moe", "hash_moe", "moe", "moe"]),
}
NEW_TOKENS = 200
PROMPT_LENGTHS = [5, 37, 18]  # ragged: the batch is left-padded to 37


def _left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    S = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), S, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, S - len(p):], mask[i, S - len(p):] = p, 1
    return ids, mask


def _prompts(cfg: DSV4Config, lengths, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, cfg.vocab_size, (n,), generator=g) for n in lengths]


def _generate(hf, ids, mask, **kw) -> torch.Tensor:
    out = hf.generate(ids, attention_mask=mask, pad_token_id=0, **kw)
    return out[:, ids.shape[1]:]


def _alone(hf, prompts, **kw) -> list[torch.Tensor]:
    """Each prompt generated alone (batch 1, no padding) by whatever ``hf`` runs now."""
    return [_generate(hf, p[None], torch.ones(1, len(p), dtype=torch.long, device=p.device), **kw)[0] for p in prompts]


@pytest.fixture(scope="module")
def hc4_model():
    """The tiny HF model and unpatched HF's greedy continuation of each prompt alone."""
    cfg = CONFIGS["hc4"]
    hf = make_hf(cfg, seed=11)
    prompts = _prompts(cfg, PROMPT_LENGTHS, seed=5)
    greedy = _alone(hf, prompts, max_new_tokens=NEW_TOKENS, do_sample=False)
    return cfg, hf, prompts, greedy


def _off(hf):
    """Leave a shared model disabled for the next test."""
    dsv4_ops.hf.disable(hf)
    assert not dsv4_ops.hf.is_enabled(hf)


# ------------------------------------------------------------------------------ forward
@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_after_enable_equals_hf_at_every_position(name, tol):
    cfg = CONFIGS[name]
    hf = make_hf(cfg, seed=3)
    ids = torch.randint(0, cfg.vocab_size, (2, 70))  # > window, > 4 HCA blocks
    with torch.no_grad():
        ref = hf(ids).logits
    assert dsv4_ops.hf.enable(hf) is hf
    with torch.no_grad():
        out = hf(ids).logits
    assert out.shape == ref.shape
    for b in range(ids.shape[0]):
        for s in range(ids.shape[1]):
            assert rel(out[b, s], ref[b, s]) <= tol("hf_model_parity_fp32")["rel"], (b, s)
    assert "OnDeepseekV4Attention" in type(hf.model.layers[1].self_attn).__name__  # really on our code


def test_parameters_are_shared_not_copied_and_save_pretrained_round_trips(tmp_path):
    from transformers import DeepseekV4ForCausalLM

    cfg = CONFIGS["hc4"]
    hf = make_hf(cfg, seed=4)
    before = hf.state_dict()
    dsv4_ops.hf.enable(hf)
    after = hf.state_dict()
    assert list(after) == list(before)
    for k in before:
        assert after[k].data_ptr() == before[k].data_ptr() and after[k].dtype == before[k].dtype, k
    hf.save_pretrained(tmp_path)
    back = DeepseekV4ForCausalLM.from_pretrained(tmp_path)
    for k, v in back.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_disable_restores_bit_identical_hf_and_enable_twice_is_harmless(tol):
    cfg = CONFIGS["hc4"]
    hf = make_hf(cfg, seed=6)
    classes = {n: type(m) for n, m in hf.named_modules()}
    gen = (hf.generation_config.cache_implementation, hf.generation_config.compile_config)
    ids = torch.randint(0, cfg.vocab_size, (2, 40))
    with torch.no_grad():
        ref = hf(ids).logits
    dsv4_ops.hf.enable(hf)
    dsv4_ops.hf.enable(hf)  # no-op
    with torch.no_grad():
        once = hf(ids).logits
    assert rel(once, ref) <= tol("hf_model_parity_fp32")["rel"]
    # run a cached generate so the pool exists, then disable
    _generate(hf, ids[:1, :10], torch.ones(1, 10, dtype=torch.long), max_new_tokens=3, do_sample=False)
    dsv4_ops.hf.disable(hf)
    dsv4_ops.hf.disable(hf)  # no-op
    assert {n: type(m) for n, m in hf.named_modules()} == classes
    assert not [n for n, _ in hf.named_buffers() if n.rsplit(".", 1)[-1] in ("window", "pool", "cos", "_dsv4_seen")]
    assert (hf.generation_config.cache_implementation, hf.generation_config.compile_config) == gen
    assert not {"prepare_inputs_for_generation", "create_masks_for_generate"} & set(vars(hf))  # HF's own again
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, ref)


def test_decode_step_inputs_are_only_the_new_token_and_the_cache():
    """generate's per-step host work: an enabled model's decode step gets [B, 1] fresh ids, the cache
    and the caller's flags (no position ids, no masks); a prefill still goes through HF's function."""
    from transformers import StaticCache

    cfg = CONFIGS["hc4"]
    hf = dsv4_ops.hf.enable(make_hf(cfg, seed=7))
    cache = StaticCache(config=hf.config, max_cache_len=64)
    ids = torch.randint(0, cfg.vocab_size, (3, 20))
    pos = torch.arange(20).expand(3, -1)
    kw = dict(cache=cache, attention_mask=torch.ones_like(ids), position_ids=pos, use_cache=True)
    step = hf.prepare_inputs_for_generation(ids, next_sequence_length=1, **kw)
    assert sorted(step) == ["cache", "input_ids", "use_cache"] and step["cache"] is cache
    assert torch.equal(step["input_ids"], ids[:, -1:]) and step["input_ids"].stride() == (1, 1)
    prefill = hf.prepare_inputs_for_generation(ids, is_first_iteration=True, **kw)
    assert torch.equal(prefill["position_ids"], pos) and prefill["input_ids"].shape == (3, 20)


def test_enable_rejects_a_model_that_is_not_deepseek_v4():
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(TypeError, match="DeepseekV4ForCausalLM"):
        dsv4_ops.hf.enable(llama)
    with pytest.raises(TypeError, match="DeepseekV4ForCausalLM"):
        dsv4_ops.hf.enable(torch.nn.Linear(2, 2))


# ------------------------------------------------------------------------------ generate
def test_left_padded_greedy_batch_equals_each_prompt_alone(hc4_model):
    cfg, hf, prompts, greedy = hc4_model
    ids, mask = _left_padded(prompts)
    dsv4_ops.hf.enable(hf)
    try:
        out = _generate(hf, ids, mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        for i, ref in enumerate(greedy):
            assert torch.equal(out[i], ref), f"row {i} (prompt {len(prompts[i])}): first diff at " \
                f"{(out[i] != ref).nonzero()[:1].flatten().tolist()}"
        # a second call with a different batch (and a fresh HF cache) sees no stale state
        out = _generate(hf, *_left_padded(prompts[::-1]), max_new_tokens=NEW_TOKENS, do_sample=False)
        for i, ref in enumerate(greedy[::-1]):
            assert torch.equal(out[i], ref), i
    finally:
        _off(hf)


def test_prompts_of_any_length_reach_the_ops_at_a_multiple_of_64_tokens(hc4_model):
    """A forward of several tokens runs them right-padded to a multiple of 64, so a new prompt length
    brings the kernels the integer arguments of one they ran before (Triton compiles a variant per
    divisibility by 16); each prompt still gets what it gets alone."""
    from dsv4_ops.hf.inplace import PREFILL_MULTIPLE

    cfg, hf, prompts, greedy = hc4_model
    dsv4_ops.hf.enable(hf)
    seen = []
    hook = hf.model.layers[0].register_forward_pre_hook(lambda layer, args: seen.append(args[0].shape[1]))
    try:
        for i in (1, 2):  # 37 and 18 tokens
            ones = torch.ones(1, len(prompts[i]), dtype=torch.long)
            out = _generate(hf, prompts[i][None], ones, max_new_tokens=3, do_sample=False, disable_compile=True)
            assert torch.equal(out[0], greedy[i][:3])
    finally:
        hook.remove()
        _off(hf)
    assert PREFILL_MULTIPLE == 64 and seen == [64, 1, 1, 64, 1, 1]


def test_a_long_prompt_runs_as_cached_steps_of_the_prefill_budget_and_each_row_gets_what_it_gets_alone(
        hc4_model, monkeypatch):
    """A forward with a cache runs at most ``PREFILL_TOKENS`` tokens a step (all rows together): a left-padded
    batch of prompts longer than one step, cut at 64 columns (3 rows x 64 > the 128-token budget set here), crosses
    windows and both compression rates between steps, and still gives each row what unpatched HF gives it alone."""
    from dsv4_ops.hf import inplace

    cfg, hf, _, _ = hc4_model
    prompts = _prompts(cfg, [150, 70, 5], seed=9)
    alone = _alone(hf, prompts, max_new_tokens=24, do_sample=False)
    monkeypatch.setattr(inplace, "PREFILL_TOKENS", 128)
    assert inplace.prefill_columns(3) == 64 and inplace.prefill_columns(1) == 128
    dsv4_ops.hf.enable(hf)
    seen = []
    hook = hf.model.layers[0].register_forward_pre_hook(lambda layer, args: seen.append(args[0].shape[1]))
    try:
        out = _generate(hf, *_left_padded(prompts), max_new_tokens=24, do_sample=False, disable_compile=True)
        for i, ref in enumerate(alone):
            assert torch.equal(out[i], ref), f"row {i} (prompt {len(prompts[i])}): first diff at " \
                f"{(out[i] != ref).nonzero()[:1].flatten().tolist()}"
        assert seen[:4] == [64, 64, 64, 1]  # 150 tokens padded to 192 columns: three steps, then decode
    finally:
        hook.remove()
        _off(hf)


def test_compiled_decode_same_tokens_and_no_new_graphs_after_warm_up(hc4_model):
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    cfg, hf, prompts, greedy = hc4_model
    dsv4_ops.hf.enable(hf)
    compile_config = CompileConfig(fullgraph=True, dynamic=False)
    compile_config._compile_all_devices = True  # HF compiles on CUDA only unless told (the CPU CI)
    hf.generation_config.compile_config = compile_config
    try:
        torch._dynamo.reset()
        counters.clear()
        warm = _left_padded([prompts[0], prompts[2]])
        out = _generate(hf, *warm, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert counters["stats"]["unique_graphs"] == 1  # fullgraph: one graph, the decode step
        assert torch.equal(out[0], greedy[0]) and torch.equal(out[1], greedy[2])
        graphs = counters["stats"]["unique_graphs"]
        # other prompt lengths and contents, same batch size and cache size: no new graph
        again = _left_padded([prompts[2][:11], prompts[0]])
        out = _generate(hf, *again, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert counters["stats"]["unique_graphs"] == graphs
        assert torch.equal(out[1], greedy[0])
        # a larger max_new_tokens: HF sizes a larger static cache (18 + 230 positions), which the pool's
        # bucket (256) holds: the same pool, so no new graph
        out = _generate(hf, *warm, max_new_tokens=NEW_TOKENS + 30, do_sample=False)
        assert counters["stats"]["unique_graphs"] == graphs
        assert torch.equal(out[0, :NEW_TOKENS], greedy[0]) and out.shape[1] == NEW_TOKENS + 30
    finally:
        _off(hf)


def test_seeded_sampling_equals_hf_and_is_reproducible(hc4_model):
    cfg, hf, prompts, _ = hc4_model
    kw = dict(max_new_tokens=40, do_sample=True, temperature=0.8, top_k=50, top_p=0.9)

    def sample():
        torch.manual_seed(1234)
        return _generate(hf, prompts[1][None], torch.ones(1, len(prompts[1]), dtype=torch.long), **kw)[0]

    ref = sample()  # unpatched HF
    dsv4_ops.hf.enable(hf)
    try:
        first, second = sample(), sample()
    finally:
        _off(hf)
    assert torch.equal(first, second)
    assert torch.equal(first, ref)
    assert len(set(first.tolist())) > 5  # really sampled, not a constant stream


def test_eos_stops_each_row_where_hf_stops(hc4_model):
    cfg, hf, prompts, greedy = hc4_model
    eos = int(greedy[0][7])  # row 0 emits it at step 7 (or earlier)
    alone = _alone(hf, prompts, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    dsv4_ops.hf.enable(hf)
    try:
        out = _generate(hf, *_left_padded(prompts), max_new_tokens=30, do_sample=False, eos_token_id=eos)
    finally:
        _off(hf)
    stop = int((greedy[0] == eos).nonzero()[0])
    assert out.shape[1] <= 30
    for i, ref in enumerate(alone):  # HF pads finished rows with pad_token_id (0)
        assert torch.equal(out[i, :len(ref)], ref), i
    assert int(out[0, stop]) == eos and bool((out[0, stop + 1:] == 0).all())


# ------------------------------------------------------------------------------ bad input
def test_prompt_past_the_static_cache_size_is_a_clear_error():
    from transformers import StaticCache

    cfg = CONFIGS["hc4"]
    hf = dsv4_ops.hf.enable(make_hf(cfg, seed=8))
    cache = StaticCache(config=hf.config, max_cache_len=16)
    with pytest.raises(ValueError, match="max_cache_len 16"):
        hf(torch.randint(0, cfg.vocab_size, (1, 20)), cache=cache, use_cache=True)


def test_dynamic_cache_is_a_clear_error_naming_the_static_switch():
    cfg = CONFIGS["hc4"]
    hf = dsv4_ops.hf.enable(make_hf(cfg, seed=9))
    ids = torch.randint(1, cfg.vocab_size, (1, 8))
    with pytest.raises(ValueError, match="cache_implementation='static'"):
        hf.generate(ids, max_new_tokens=2, do_sample=False, cache_implementation="dynamic", pad_token_id=0)


def test_bf16_forward_after_enable_is_as_close_to_fp32_as_hf_bf16():
    """bf16 rounds differently along different op orders, so bf16-vs-bf16 is no oracle; both bf16
    runs are measured against the fp32 model: ours must be no further from it than HF's own
    (summed over three random models; on these tiny random models either side alone varies
    between ~5% and ~10%)."""
    cfg = CONFIGS["hc4"]
    ours_err = hf_err = 0.0
    for seed in range(3):
        ids = torch.randint(0, cfg.vocab_size, (4, 48))
        with torch.no_grad():
            fp32 = make_hf(cfg, seed=seed)(ids).logits
            hf = make_hf(cfg, seed=seed, dtype=torch.bfloat16)
            hf_err += rel(hf(ids).logits.float(), fp32)
            dsv4_ops.hf.enable(hf)
            ours = hf(ids).logits
        assert ours.dtype == torch.bfloat16
        ours_err += rel(ours.float(), fp32)
    assert ours_err <= 1.3 * hf_err, (ours_err, hf_err)


# ------------------------------------------------------------------------------ CUDA
@pytest.mark.gpu
def test_cuda_enabled_generate_eager_and_compiled_equals_hf_alone(tol):
    """On CUDA the ops run the Triton kernels and HF compiles the decode step itself (CUDA graphs,
    ``mode="reduce-overhead"``): fp32 forward parity, and both the eager and the compiled padded
    batch equal unpatched HF's tokens for each prompt alone."""
    cfg = CONFIGS["hc4"]
    hf = make_hf(cfg, seed=12).cuda()
    prompts = [p.cuda() for p in _prompts(cfg, PROMPT_LENGTHS, seed=6)]
    greedy = _alone(hf, prompts, max_new_tokens=96, do_sample=False)
    ids = torch.randint(0, cfg.vocab_size, (2, 70), device="cuda")
    with torch.no_grad():
        ref = hf(ids).logits
    dsv4_ops.hf.enable(hf)
    with torch.no_grad():
        assert rel(hf(ids).logits, ref) <= tol("hf_model_parity_fp32")["rel"]
    batch = [t.cuda() for t in _left_padded(prompts)]
    hf.generation_config.disable_compile = True
    eager = _generate(hf, *batch, max_new_tokens=96, do_sample=False)
    hf.generation_config.disable_compile = False
    compiled = _generate(hf, *batch, max_new_tokens=96, do_sample=False)
    for i, want in enumerate(greedy):
        assert torch.equal(eager[i], want), i
        assert torch.equal(compiled[i], want), i


@pytest.mark.gpu
def test_cuda_new_prompt_lengths_and_max_new_tokens_compile_nothing_after_warm_up():
    """After one warm-up, generate with new prompt lengths (of other residues mod 16) and larger
    ``max_new_tokens`` within the pool's bucket compiles no Triton kernel (Triton's compilation
    listener sees every new variant a process builds, from its disk cache or not) and no dynamo
    graph, and each prompt still gets unpatched HF's tokens alone."""
    import triton
    from torch._dynamo.utils import counters

    cfg = CONFIGS["hc4"]
    hf = make_hf(cfg, seed=13).cuda()
    prompts = [p.cuda() for p in _prompts(cfg, [24, 37, 50, 61], seed=8)]
    new = [40, 40, 60, 90]  # 61 + 90 positions: still the 256-position bucket of the warm-up's 24 + 40
    want = [_alone(hf, [p], max_new_tokens=n, do_sample=False)[0] for p, n in zip(prompts, new)]
    dsv4_ops.hf.enable(hf)
    compiled: list[str] = []
    try:
        torch._dynamo.reset()
        got = [_alone(hf, [prompts[0]], max_new_tokens=new[0], do_sample=False)[0] for _ in range(2)]  # warm-up
        graphs = counters["stats"]["unique_graphs"]
        triton.knobs.compilation.listener = lambda src, **kw: compiled.append(getattr(src, "name", str(src)))
        got += [_alone(hf, [p], max_new_tokens=n, do_sample=False)[0] for p, n in zip(prompts[1:], new[1:])]
    finally:
        triton.knobs.compilation.listener = None
        _off(hf)
    assert compiled == [] and counters["stats"]["unique_graphs"] == graphs
    for i, w in enumerate([want[0]] + want):
        assert torch.equal(got[i], w), i
