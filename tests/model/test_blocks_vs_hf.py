"""mHC and MoE blocks match HF transformers' DeepSeek-V4 modules (fp32, same weights) and compile
with fullgraph=True. HF's init leaves zeros / torch.empty garbage, so every parameter and buffer is
overwritten with fresh random values before loading."""
import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from dsv4_ops.model import HyperConnection, HyperHead, MoE

HASH_LAYER, BIASED_LAYER = 0, 1


def tiny_hf_config() -> DeepseekV4Config:
    cfg = DeepseekV4Config(
        vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        index_n_heads=2, index_head_dim=16, index_topk=4, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention"],  # attention is stubbed out here
        mlp_layer_types=["hash_moe", "moe"],
        n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=1.5,
        swiglu_limit=3.0,  # low enough that random activations hit the clamp
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
    )
    cfg._experts_implementation = "eager"  # HF's reference loop, not grouped_mm
    return cfg


def randomize_(module: nn.Module, cfg: DeepseekV4Config, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            std = 0.1 if name.endswith("fn") else 0.3  # keep mHC mixes O(1): sigmoid/softmax not saturated
            p.copy_(torch.randn(p.shape, generator=g) * std)
            if name.endswith("scale"):
                p.add_(1.0)
        for name, b in module.named_buffers():
            if name.endswith("tid2eid"):  # rows may repeat an expert: both picks must count
                b.copy_(torch.randint(0, cfg.n_routed_experts, b.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.5)
    return module


def our_hc(cfg):
    return HyperConnection(cfg.hidden_size, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)


def our_moe(cfg, layer_idx):
    is_hash = cfg.mlp_layer_types[layer_idx] == "hash_moe"
    return MoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
               cfg.routed_scaling_factor, cfg.swiglu_limit, hash_vocab_size=cfg.vocab_size if is_hash else 0)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert ours.shape == ref.shape and ours.dtype == ref.dtype, (ours.shape, ref.shape, ours.dtype, ref.dtype)
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def inputs(cfg, seed, B=2, S=7):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, cfg.hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    return x, ids


class StubAttention(nn.Module):
    """Stands in for DeepseekV4Attention so a whole HF decoder layer runs without attention inputs."""

    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x, **kwargs):
        return torch.tanh(self.proj(x)), None


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class OurLayer(nn.Module):
    """HF DeepseekV4DecoderLayer's wiring, built from our blocks; same state_dict keys."""

    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.self_attn = StubAttention(cfg.hidden_size)
        self.mlp = our_moe(cfg, layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc, self.ffn_hc = our_hc(cfg), our_hc(cfg)

    def forward(self, x, input_ids):  # x: [B, S, N, D] streams
        u, post, comb = self.attn_hc.collapse(x)
        x = self.attn_hc.expand(self.self_attn(self.input_layernorm(u))[0], x, post, comb)
        u, post, comb = self.ffn_hc.collapse(x)
        return self.ffn_hc.expand(self.mlp(self.post_attention_layernorm(u), input_ids), x, post, comb)


def test_hyper_connection_collapse_and_expand_match_hf(tol):
    cfg = tiny_hf_config()
    ref = randomize_(hf.DeepseekV4HyperConnection(cfg), cfg, seed=0)
    ours = our_hc(cfg)
    ours.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, cfg.hc_mult, cfg.hidden_size, generator=g)
    y = torch.randn(2, 7, cfg.hidden_size, generator=g)

    post_r, comb_r, u_r = ref(x)
    u, post, comb = ours.collapse(x)
    # expand as DeepseekV4DecoderLayer.forward does it
    out_r = post_r.unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb_r.transpose(-1, -2), x)
    out = ours.expand(y, x, post, comb)
    errs = {k: rel_err(a, b) for k, a, b in
            [("collapse", u, u_r), ("post", post, post_r), ("comb", comb, comb_r), ("expand", out, out_r)]}
    print("hyper_connection rel errors:", errs)
    assert max(errs.values()) <= tol("hf_parity_fp32")["rel"], errs
    # comb is about doubly stochastic; the last Sinkhorn step normalises columns exactly
    torch.testing.assert_close(comb.sum(-2), torch.ones_like(comb.sum(-2)), **tol("sinkhorn_column_sums"))
    torch.testing.assert_close(comb.sum(-1), torch.ones_like(comb.sum(-1)), **tol("sinkhorn_row_sums_after_20_iters"))


def test_hyper_connection_weights_are_fp32_for_bf16_streams():
    cfg = tiny_hf_config()
    hc = randomize_(our_hc(cfg), cfg, seed=0)
    x = torch.randn(1, 3, cfg.hc_mult, cfg.hidden_size).bfloat16()
    u, post, comb = hc.collapse(x)
    assert (u.dtype, post.dtype, comb.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    assert hc.expand(u, x, post, comb).dtype == torch.bfloat16
    _, post32, comb32 = hc.collapse(x.float())  # weights from bf16 streams == from their fp32 upcast
    torch.testing.assert_close((post, comb), (post32, comb32), rtol=0, atol=0)


def test_hyper_head_matches_hf(tol):
    cfg = tiny_hf_config()
    ref = randomize_(hf.DeepseekV4HyperHead(cfg), cfg, seed=2)
    ours = HyperHead(cfg.hidden_size, cfg.hc_mult, cfg.hc_eps, cfg.rms_norm_eps)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 7, cfg.hc_mult, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    err = rel_err(ours(x), ref(x))
    print("hyper_head rel error:", err)
    assert err <= tol("hf_parity_fp32")["rel"]


@pytest.mark.parametrize("layer_idx", [HASH_LAYER, BIASED_LAYER], ids=["hash", "biased"])
def test_moe_matches_hf(layer_idx, tol):
    cfg = tiny_hf_config()
    ref = randomize_(hf.DeepseekV4SparseMoeBlock(cfg, layer_idx), cfg, seed=10 + layer_idx)
    ours = our_moe(cfg, layer_idx)
    ours.load_state_dict(ref.state_dict())  # strict: same names, shapes, buffers
    x, ids = inputs(cfg, seed=20 + layer_idx)

    err = rel_err(ours(x, ids), ref(x, input_ids=ids))
    print(f"moe[{'hash' if ref.is_hash else 'biased'}] rel error:", err)
    assert err <= tol("hf_parity_fp32")["rel"]

    # the test exercises what it claims to: the SwiGLU clamp bites, and the bias (not just the
    # scores) decides the biased top-k
    flat = x.flatten(0, 1)
    assert (torch.matmul(flat, ref.experts.gate_up_proj.transpose(1, 2)).abs() > cfg.swiglu_limit).any()
    if not ref.is_hash:
        scores = torch.nn.functional.softplus(flat @ ref.gate.weight.T).sqrt()
        unbiased = scores.topk(cfg.num_experts_per_tok).indices.sort(-1).values
        assert (ours.gate(flat)[1].sort(-1).values != unbiased).any()


def test_moe_hash_routing_needs_input_ids():
    cfg = tiny_hf_config()
    with pytest.raises(ValueError, match="input_ids"):
        our_moe(cfg, HASH_LAYER)(torch.randn(1, 2, cfg.hidden_size))


def test_decoder_layer_pattern_matches_hf(tol):
    # HF's real DeepseekV4DecoderLayer.forward (attention stubbed) vs the same wiring of our blocks
    cfg = tiny_hf_config()
    for layer_idx in (HASH_LAYER, BIASED_LAYER):
        ref = hf.DeepseekV4DecoderLayer(cfg, layer_idx)
        ref.self_attn = StubAttention(cfg.hidden_size)
        randomize_(ref, cfg, seed=30 + layer_idx)
        ours = OurLayer(cfg, layer_idx)
        ours.load_state_dict(ref.state_dict())
        x, ids = inputs(cfg, seed=40 + layer_idx)
        streams = x.unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1) + 0.1 * torch.randn(*x.shape[:2], cfg.hc_mult, x.shape[-1])
        err = rel_err(ours(streams, ids), ref(streams, input_ids=ids))
        print(f"decoder layer {layer_idx} rel error:", err)
        assert err <= tol("hf_parity_fp32")["rel"]


@pytest.mark.parametrize("layer_idx", [HASH_LAYER, BIASED_LAYER], ids=["hash", "biased"])
def test_moe_compiles_fullgraph_without_recompiles(layer_idx, tol):
    torch._dynamo.reset()
    cfg = tiny_hf_config()
    moe = randomize_(our_moe(cfg, layer_idx), cfg, seed=50 + layer_idx)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(moe, fullgraph=True, backend=counter)  # fullgraph: a graph break raises
    with torch.no_grad():
        for seed in (60, 61):  # same shapes, different tokens -> different routing
            x, ids = inputs(cfg, seed=seed)
            err = rel_err(compiled(x, ids), moe(x, ids))
            assert err <= tol("compiled_vs_eager_rel_fp32")["rel"], err
    assert counter.frame_count == 1


def test_decoder_layer_pattern_compiles_fullgraph(tol):
    torch._dynamo.reset()
    cfg = tiny_hf_config()
    layer = randomize_(OurLayer(cfg, HASH_LAYER), cfg, seed=70)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    with torch.no_grad():
        for seed in (71, 72):
            x, ids = inputs(cfg, seed=seed)
            streams = x.unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)
            assert rel_err(compiled(streams, ids), layer(streams, ids)) <= tol("compiled_vs_eager_rel_fp32")["rel"]
    assert counter.frame_count == 1
