"""The MTP block's weights load from DeepSeek's official checkpoint names (``mtp.0.attn.wq_a``,
``mtp.0.ffn.experts.N.w1``, ``mtp.0.hc_head_fn``, ...) and from a dsv4_ops state dict; a
checkpoint without MTP tensors (HF transformers drops them) leaves only ``mtp.*`` unloaded."""
from __future__ import annotations

import torch

import dsv4_ops
from dsv4_ops import DSV4Config, DeepseekV4ForCausalLM
from model_util import random_model

# dsv4_ops name (inside mtp.0.) -> DeepSeek's checkpoint name, written out independently of
# dsv4_ops.checkpoint's rename table so that the test checks it
OFFICIAL = {
    "enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "e_proj.weight": "e_proj.weight",
    "h_proj.weight": "h_proj.weight", "norm.weight": "norm.weight",
    "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale",
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn", "attn_hc.base": "hc_attn_base", "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn", "ffn_hc.base": "hc_ffn_base", "ffn_hc.scale": "hc_ffn_scale",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight", "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight", "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight", "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight", "self_attn.sinks": "attn.attn_sink",
    "mlp.gate.weight": "ffn.gate.weight", "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
}


def official_mtp_tensors(model: DeepseekV4ForCausalLM) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in model.state_dict().items():
        if not name.startswith("mtp.0."):
            continue
        rest = name[len("mtp.0."):]
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, D] -> per-expert w1 (gate) / w3 (up)
            w1, w3 = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"mtp.0.ffn.experts.{e}.w1.weight"] = w1[e].contiguous()
                out[f"mtp.0.ffn.experts.{e}.w3.weight"] = w3[e].contiguous()
        elif rest == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[f"mtp.0.ffn.experts.{e}.w2.weight"] = t[e].contiguous()
        else:
            out["mtp.0." + OFFICIAL[rest]] = t.contiguous()
    return out


def test_mtp_loads_from_official_names(tmp_path):
    from safetensors.torch import save_file

    cfg = DSV4Config.tiny(num_hidden_layers=2)
    src = random_model(cfg, seed=4)
    # main weights in HF names plus the MTP block in DeepSeek's names, one safetensors file
    main = {k: v.contiguous() for k, v in src.state_dict().items() if not k.startswith("mtp.")}
    cfg.to_hf().save_pretrained(tmp_path)
    save_file({**main, **official_mtp_tensors(src)}, tmp_path / "model.safetensors")
    loaded = dsv4_ops.load_pretrained(tmp_path)
    want = src.state_dict()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, want[k]), k  # every MTP tensor landed under its dsv4_ops name


def test_mtp_loads_from_a_dsv4_ops_state_dict():
    cfg = DSV4Config.tiny(num_hidden_layers=2)
    src = random_model(cfg, seed=5)
    dst = DeepseekV4ForCausalLM(cfg)
    result = dst.load_state_dict(src.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(dst.mtp[0].e_proj.weight, src.mtp[0].e_proj.weight)


def test_checkpoint_without_mtp_leaves_only_mtp_unloaded(tmp_path):
    from safetensors.torch import save_file

    cfg = DSV4Config.tiny(num_hidden_layers=2)
    src = random_model(cfg, seed=6)
    cfg.to_hf().save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in src.state_dict().items() if not k.startswith("mtp.")},
              tmp_path / "model.safetensors")
    loaded = dsv4_ops.load_pretrained(tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (1, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids), src(ids))  # main model loaded exactly
