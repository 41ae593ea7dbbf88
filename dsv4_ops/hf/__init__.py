"""transformers glue: ``enable``/``disable`` run HF's own DeepseekV4ForCausalLM on the ops in place
(``inplace.py``); ``from_hf`` builds a dsv4_ops model that shares an HF model's weights;
``load_pretrained`` reads a checkpoint directory in HF's format (``checkpoint.py``)."""
from __future__ import annotations

import os

import torch

from ..checkpoint import check_load, finish_meta_model, load_checkpoint
from ..config import DSV4Config
from ..model.model import DeepseekV4ForCausalLM

__all__ = ["from_hf", "load_pretrained"]


def from_hf(hf_model, dtype: torch.dtype | None = None, max_positions: int | None = None) -> DeepseekV4ForCausalLM:
    """A ``dsv4_ops.DeepseekV4ForCausalLM`` with the weights of a transformers
    ``DeepseekV4ForCausalLM`` (same device; big weights in ``dtype``, default the HF model's
    dtype; fp32-only parameters stay fp32).

    No second copy: the model is built on the meta device and every HF tensor whose dtype
    and device already match is SHARED (``load_state_dict(..., assign=True)``), so the two
    models alias those weights (an in-place edit of one shows in the other); the rest are
    cast copies.

    HF transformers drops the MTP block's weights, so ``model.mtp`` gets a fresh
    initialisation (speculative decoding stays exact, only acceptance suffers);
    ``load_pretrained`` of an official checkpoint loads them. Raises ``ValueError`` if any
    other parameter of ours has no counterpart in the HF state dict.
    """
    cfg = DSV4Config.from_hf(hf_model.config)
    ref = hf_model.get_input_embeddings().weight
    model = DeepseekV4ForCausalLM(cfg, dtype=dtype or ref.dtype, device="meta", max_positions=max_positions)
    want = model.state_dict()
    sd = {k: v if k not in want else v.to(device=ref.device, dtype=want[k].dtype)
          for k, v in hf_model.state_dict().items()}
    check_load("from_hf", model, model.load_state_dict(sd, strict=False, assign=True))
    return finish_meta_model(model, ref.device).eval()


def load_pretrained(path: str | os.PathLike, dtype: torch.dtype | None = None, device=None,
                    max_positions: int | None = None, process_group=None) -> DeepseekV4ForCausalLM:
    """A ``dsv4_ops.DeepseekV4ForCausalLM`` from a checkpoint directory (``config.json`` + safetensors,
    HF or DeepSeek names, bf16 / FP8 / FP4: ``checkpoint.load_checkpoint`` says exactly what loads).
    ``process_group``: load this rank's tensor/expert-parallel shard only
    (``dsv4_ops.parallel.load_pretrained``; call it on every rank of the group)."""
    if process_group is not None:
        from ..parallel.load import load_pretrained as load_shard

        return load_shard(path, process_group, dtype=dtype, device=device, max_positions=max_positions)
    return load_checkpoint(path, dtype, device, max_positions)


from .inplace import disable, enable, is_enabled  # noqa: E402

__all__ += ["enable", "disable", "is_enabled"]
