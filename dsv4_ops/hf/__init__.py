"""transformers glue: ``from_hf`` copies an HF ``DeepseekV4ForCausalLM`` into a dsv4_ops model."""
from __future__ import annotations

import torch

from ..checkpoint import check_load, load_pretrained
from ..config import DSV4Config
from ..model.model import DeepseekV4ForCausalLM

__all__ = ["from_hf", "load_pretrained"]


def from_hf(hf_model, dtype: torch.dtype | None = None, max_positions: int | None = None) -> DeepseekV4ForCausalLM:
    """A ``dsv4_ops.DeepseekV4ForCausalLM`` with the weights of a transformers
    ``DeepseekV4ForCausalLM`` (copied; same device; big weights in ``dtype``, default the HF
    model's dtype; fp32-only parameters stay fp32).

    HF transformers drops the MTP block's weights, so ``model.mtp`` keeps its initialisation
    (speculative decoding stays exact, only acceptance suffers); ``load_pretrained`` of an
    official checkpoint loads them. Raises ``ValueError`` if any other parameter of ours has
    no counterpart in the HF state dict.
    """
    cfg = DSV4Config.from_hf(hf_model.config)
    ref = hf_model.get_input_embeddings().weight
    model = DeepseekV4ForCausalLM(cfg, dtype=dtype or ref.dtype, device=ref.device, max_positions=max_positions)
    check_load("from_hf", model, model.load_state_dict(hf_model.state_dict(), strict=False))
    return model.eval()


from .inplace import disable, enable, is_enabled  # noqa: E402

__all__ += ["enable", "disable", "is_enabled"]
