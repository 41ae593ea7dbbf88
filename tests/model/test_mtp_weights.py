"""The MTP block's weights load from DeepSeek's official checkpoint names (``mtp.0.attn.wq_a``,
``mtp.0.ffn.experts.N.w1``, ``mtp.0.hc_head_fn``, ...) and from a dsv4_ops state dict; a
checkpoint without MTP tensors (HF transformers drops them) leaves only ``mtp.*`` unloaded."""
from __future__ import annotations

import torch

import dsv4_ops
from dsv4_ops import DSV4Config, DeepseekV4ForCausalLM
from model_util import random_model
from official_names import OFFICIAL


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
