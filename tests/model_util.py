"""``random_model``: a dsv4_ops model with EVERY parameter and buffer drawn fresh (norm gains
around 1, biases and sinks away from 0, valid hash-routing ids), at scales that keep
activations O(1); tests compare such models across paths (eager / compiled / exported)."""
from __future__ import annotations

import torch

from dsv4_ops import DeepseekV4ForCausalLM, DSV4Config


def random_model(cfg: DSV4Config, dtype=torch.float32, device="cpu", seed: int = 0) -> DeepseekV4ForCausalLM:
    torch.manual_seed(seed)
    m = DeepseekV4ForCausalLM(cfg, dtype=dtype, device=device).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
            else:
                p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2)
        for name, b in m.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, cfg.n_routed_experts, b.shape))
            elif name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    return m
