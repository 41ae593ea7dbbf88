"""transformers glue: build a dsv4_ops model from an HF ``DeepseekV4ForCausalLM``."""
from __future__ import annotations

import torch

from .config import DSV4Config
from .model.model import DeepseekV4ForCausalLM

__all__ = ["from_hf"]


def from_hf(hf_model, dtype: torch.dtype | None = None, max_positions: int | None = None) -> DeepseekV4ForCausalLM:
    """A ``dsv4_ops.DeepseekV4ForCausalLM`` with the weights of a transformers
    ``DeepseekV4ForCausalLM`` (copied; same device; big weights in ``dtype``, default the HF
    model's dtype; fp32-only parameters stay fp32).

    Raises ``ValueError`` if a parameter of ours has no counterpart in the HF state dict.
    """
    cfg = DSV4Config.from_hf(hf_model.config)
    ref = hf_model.get_input_embeddings().weight
    model = DeepseekV4ForCausalLM(cfg, dtype=dtype or ref.dtype, device=ref.device, max_positions=max_positions)
    result = model.load_state_dict(hf_model.state_dict(), strict=False)
    if result.missing_keys:
        raise ValueError(f"from_hf: the HF state dict lacks {len(result.missing_keys)} parameters, "
                         f"e.g. {result.missing_keys[:5]}")
    unexpected = [k for k in result.unexpected_keys if not k.startswith("mtp.")]
    if unexpected:
        raise ValueError(f"from_hf: HF parameters with no dsv4_ops counterpart: {unexpected[:5]}")
    return model.eval()
