"""DeepSeek's official checkpoint names of a layer's tensors, for the loading tests.

``OFFICIAL``: dsv4_ops name (inside ``layers.N.`` or ``mtp.0.``) -> DeepSeek's checkpoint name, written out
independently of ``dsv4_ops.checkpoint``'s rename table so that the tests check it."""

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
