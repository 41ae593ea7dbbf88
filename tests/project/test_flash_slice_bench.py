"""The "Flash slice" benchmark config and the decode floor of the routing a step actually did
(benchmarks/random_weights.py, benchmarks/bench_model.py), on CPU in seconds:

* the preset has V4-Flash widths and its layer mix in miniature, 55 GB of bf16 main model plus a
  13 GB MTP block, and builds on the meta device without allocating;
* ``random_init_model`` draws every parameter and buffer in place on the target device
  (valid hash ids, the RoPE tables of a normally built model), and the model runs;
* the routing floor counts exactly the unique (layer, expert) pairs a step routed to (hash ids
  and a forcing router bias make them known), an expert named twice once, and adds their bytes
  to the dense weights, embedding rows and KV;
* ``--config flash-slice`` is an option of bench_model.py, the historical config the default."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` is a package at the repo root

from benchmarks import bench_model as BM  # noqa: E402
from benchmarks.random_weights import flash_slice_config, random_init_model  # noqa: E402
from dsv4_ops import DeepseekV4ForCausalLM, DSV4Config  # noqa: E402


def test_flash_slice_preset_is_v4_flash_in_miniature():
    cfg = flash_slice_config()
    assert cfg.layer_types == ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                               "heavily_compressed_attention"]
    assert cfg.mlp_layer_types == ["hash_moe", "hash_moe", "moe", "moe"]
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.vocab_size) == (4096, 64, 512, 129280)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.n_shared_experts,
            cfg.num_nextn_predict_layers) == (256, 6, 2048, 1, 1)
    meta = DeepseekV4ForCausalLM(cfg, dtype=torch.bfloat16, device="meta")  # no memory
    main = sum(p.nbytes for n, p in meta.named_parameters() if not n.startswith("mtp."))
    mtp = sum(p.nbytes for p in meta.mtp.parameters())
    assert 54e9 < main < 56e9 and 13e9 < mtp < 14e9, (main, mtp)


def test_random_init_model_draws_everything_on_the_device():
    cfg = DSV4Config.tiny()
    model = random_init_model(cfg, dtype=torch.float32, device="cpu", seed=1)
    plain = DeepseekV4ForCausalLM(cfg)
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and p.dtype == plain.get_parameter(name).dtype, name
        assert torch.isfinite(p).all() and (p != 0).all(), name
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            assert 0 <= b.min() and b.max() < cfg.n_routed_experts and b.unique().numel() > 1
        elif name.endswith((".cos", ".sin")):
            torch.testing.assert_close(b, plain.get_buffer(name), rtol=0, atol=0)
    assert torch.isfinite(model(torch.randint(0, cfg.vocab_size, (2, 9)))).all()
    with torch.no_grad():  # bf16 weights stay bf16, fp32-only parameters fp32
        bf16 = random_init_model(cfg, dtype=torch.bfloat16, device="cpu")
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    assert bf16.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    assert bf16.model.norm.weight.dtype == torch.float32


def _known_routing_model():
    """Tiny model whose routing is known: hash layers 0 and 1 by tid2eid, biased layers 2 and 3
    forced to experts 6 and 7 by a bias no score can overcome."""
    cfg = DSV4Config.tiny()  # 8 experts top-2; mlp: hash, hash, moe, moe
    model = random_init_model(cfg, dtype=torch.float32, device="cpu", seed=2)
    with torch.no_grad():
        t0, t1 = model.model.layers[0].mlp.gate.tid2eid, model.model.layers[1].mlp.gate.tid2eid
        t0[10], t0[20] = torch.tensor([1, 1]), torch.tensor([3, 5])  # expert 1 named twice: read once
        t1[10], t1[20] = torch.tensor([2, 4]), torch.tensor([4, 2])  # both tokens: the same two experts
        for layer in model.model.layers[2:]:
            layer.mlp.gate.e_score_correction_bias.zero_()[6:8] = 100.0
    expected = {(0, 1), (0, 3), (0, 5), (1, 2), (1, 4), (2, 6), (2, 7), (3, 6), (3, 7)}
    return cfg, model, torch.tensor([10, 20]), expected


def test_recorder_counts_unique_layer_expert_pairs():
    cfg, model, ids, expected = _known_routing_model()
    with BM.RoutingRecorder(model) as rec:
        model(ids.view(2, 1))  # cache-free forward of the two tokens
    assert rec.pairs == expected
    model(ids.view(2, 1))  # the hooks are gone after the block
    assert rec.pairs == expected


def test_decode_probe_records_a_cached_step_and_leaves_the_lengths():
    cfg, model, ids, expected = _known_routing_model()
    model.setup_caches(max_batch_size=2, max_seq_len=32)
    lengths = torch.tensor([5, 9], dtype=torch.int32)
    model(torch.randint(0, cfg.vocab_size, (2, 9)), torch.zeros(2, dtype=torch.int32), lengths)  # some context
    assert BM.probe_decode_routing(model, ids, lengths) == expected
    assert lengths.tolist() == [5, 9]


def test_routed_floor_adds_exactly_the_routed_experts():
    cfg, model, ids, pairs = _known_routing_model()
    parts = BM.routed_floor_parts(model, cfg, pairs, batch=2, ctx=40)
    per_expert = 4 * (64 * 64 + 64 * 32)  # fp32 gate_up [64, 64] + down [64, 32] of one expert
    assert parts["experts_routed"] == 9 and parts["experts"] == 9 * per_expert
    expected = BM.floor_parts(model, cfg, batch=2, ctx=40)  # same dense weights, embedding rows and KV
    for key in ("weights", "embed", "kv"):
        assert parts[key] == expected[key], key
    assert parts["total"] == parts["weights"] + 9 * per_expert + parts["embed"] + parts["kv"]
    assert parts["floor_ms"] == pytest.approx(parts["total"] / 4.3e12 * 1e3)
    assert BM.routed_floor_parts(model, cfg, set(), 2, 40)["experts"] == 0


def test_bench_model_takes_the_flash_slice_config():
    assert BM.parse_args(["--out", "x"]).config == "bench"
    args = BM.parse_args(["--out", "x", "--config", "flash-slice"])
    assert args.config == "flash-slice" and args.hf_points == []  # HF would build 68 GB in fp32 first
    with pytest.raises(SystemExit):
        BM.parse_args(["--out", "x", "--config", "flash"])


@pytest.mark.gpu
@pytest.mark.whole_gpu
def test_flash_slice_builds_on_the_gpu_in_seconds_as_one_copy():
    import time

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    model = random_init_model(flash_slice_config(), dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    params = sum(p.nbytes for p in model.parameters())
    peak = torch.cuda.max_memory_allocated() - before
    print(f"flash slice: {params / 1e9:.1f} GB built in {build_s:.1f} s, peak {peak / 1e9:.1f} GB")
    assert build_s < 60 and peak < params * 1.05 + 2e9  # never two copies (RoPE tables: a few MB)
    ids = torch.randint(0, 129280, (1, 4), device="cuda")
    with BM.RoutingRecorder(model) as rec:
        logits = model(ids)
    assert torch.isfinite(logits).all()
    assert 6 <= len({e for layer, e in rec.pairs if layer == 3}) <= 24  # 4 tokens x top-6
    del model, logits
    torch.cuda.empty_cache()
