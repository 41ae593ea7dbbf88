"""Checkpoints on disk: ``load_pretrained`` builds a dsv4_ops model from a checkpoint directory
(HF or DeepSeek tensor names)."""
from __future__ import annotations

import json
import os
import re

import torch

from .config import DSV4Config
from .model.model import DeepseekV4ForCausalLM

__all__ = ["load_pretrained", "check_load"]


def check_load(where: str, model, result) -> None:
    """Every parameter must be loaded, except the MTP block's when the source has no MTP
    tensors at all (HF transformers drops them); source tensors must all be used, except
    extra MTP layers (``mtp.N`` beyond the one block we build)."""
    missing = list(result.missing_keys)
    ours_mtp = {k for k in model.state_dict() if k.startswith("mtp.")}
    if ours_mtp and ours_mtp <= set(missing):  # the source has no MTP weights at all
        missing = [k for k in missing if k not in ours_mtp]
    if missing:
        raise ValueError(f"{where}: the checkpoint lacks {len(missing)} parameters, e.g. {missing[:5]}")
    ours = len(getattr(model, "mtp", []))
    unexpected = [
        k for k in result.unexpected_keys
        if not (k.startswith("mtp.") and int(k.split(".")[1]) >= ours)
    ]
    if unexpected:
        raise ValueError(f"{where}: {len(unexpected)} checkpoint tensors have no dsv4_ops counterpart, "
                         f"e.g. {unexpected[:5]}")


# --------------------------------------------------------------------------------------
# checkpoints on disk
# --------------------------------------------------------------------------------------
# DeepSeek's own tensor names -> HF / dsv4_ops names. transformers 5.x ``save_pretrained``
# writes this format too (it reverts its load-time conversion). Applied in order, each at
# most once per key, exactly as transformers' ``conversion_mapping["deepseek_v4"]`` does;
# per-expert w1/w2/w3 are fused afterwards. Keys are handled without their "model." prefix.
_RENAMES = [
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"),
    (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"),
    (r"^hc_head_base", "hc_head.hc_base"),
    (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"),
    (r"\.hc_attn_base", ".attn_hc.base"),
    (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"),
    (r"\.hc_ffn_base", ".ffn_hc.base"),
    (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]
_RENAMES = [(re.compile(p), t) for p, t in _RENAMES]
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<w>w[123])\.weight$")
_TOP_LEVEL = ("embed_tokens.", "layers.", "norm.", "hc_head.")
# MTP: `mtp.0.<layer names>` use the layer rules above; its own head / input tensors map here
_MTP_OWN = re.compile(r"^(?P<prefix>mtp\.\d+\.)(?P<rest>(?:enorm|hnorm|e_proj|h_proj|norm)\.weight|hc_head_(?:fn|base|scale))$")
_MTP_HEAD = {"hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}


def _convert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (DeepSeek or HF names) -> HF-named state dict, experts fused."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for key, t in tensors.items():
        name = key[len("model."):] if key.startswith("model.") else key
        mtp = _MTP_OWN.match(name)
        if mtp:  # the MTP block's own tensors: enorm, hnorm, e_proj, h_proj, norm, hc_head_*
            out[mtp["prefix"] + _MTP_HEAD.get(mtp["rest"], mtp["rest"])] = t
            continue
        for pattern, target in _RENAMES:  # main layers and the MTP block's decoder layer alike
            name = pattern.sub(target, name, count=1)
        m = _EXPERT.match(name)
        if m:
            experts.setdefault(m["prefix"], {}).setdefault(m["w"], {})[int(m["e"])] = t
            continue
        out["model." + name if name.startswith(_TOP_LEVEL) else name] = t
    for prefix, ws in experts.items():
        n = 1 + max(max(d) for d in ws.values())
        for w, d in ws.items():
            if sorted(d) != list(range(n)) or len(ws) != 3:
                raise ValueError(f"load_pretrained: {prefix} needs w1, w2 and w3 for experts 0..{n - 1}; "
                                 f"found {w} for {sorted(d)} (and {sorted(ws)})")
        stack = {w: torch.stack([ws[w][e] for e in range(n)]) for w in ws}
        name = "model." + prefix if prefix.startswith(_TOP_LEVEL) else prefix
        out[name + ".gate_up_proj"] = torch.cat([stack["w1"], stack["w3"]], dim=1)  # [E, 2I, D]: gate rows first
        out[name + ".down_proj"] = stack["w2"]  # [E, D, I]
    return out


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"load_pretrained: no *.safetensors files in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(os.path.join(path, name)))
    return tensors


def load_pretrained(path: str | os.PathLike, dtype: torch.dtype | None = None, device=None,
                    max_positions: int | None = None) -> DeepseekV4ForCausalLM:
    """A ``dsv4_ops.DeepseekV4ForCausalLM`` from a checkpoint directory: ``config.json`` (a
    transformers ``DeepseekV4Config``) plus safetensors (one file or shards with
    ``model.safetensors.index.json``), in HF names or in DeepSeek's own names (what
    ``DeepseekV4ForCausalLM.save_pretrained`` writes in transformers 5.x). No HF model is
    built. ``dtype`` defaults to the config's dtype (fp32 if unset); fp32-only parameters
    stay fp32. FP8-quantised checkpoints are not supported.

    MTP tensors (``mtp.0.*``, DeepSeek or dsv4_ops names; see ``model/mtp.py`` for the
    mapping) load into ``model.mtp``; a checkpoint without any keeps the MTP block's
    initialisation, extra MTP layers (``mtp.1.*`` ...) are ignored. Raises ``ValueError`` when
    any other parameter is missing or a tensor has no counterpart.
    """
    from transformers import DeepseekV4Config

    path = os.fspath(path)
    hf_config = DeepseekV4Config.from_pretrained(path)
    cfg = DSV4Config.from_hf(hf_config)
    if dtype is None:
        dtype = getattr(hf_config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
    tensors = _convert(_read_safetensors(path))
    scales = [k for k in tensors if k.endswith("scale_inv") or (k.endswith(".scale") and not k.endswith("_hc.scale"))]
    if scales:
        raise ValueError(f"load_pretrained: FP8-quantised checkpoints are not supported (found {scales[:3]})")
    if cfg.tie_word_embeddings and "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]  # tied: saved once
    model = DeepseekV4ForCausalLM(cfg, dtype=dtype, device=device, max_positions=max_positions)
    check_load("load_pretrained", model, model.load_state_dict(tensors, strict=False))
    return model.eval()
