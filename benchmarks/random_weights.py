"""The model every benchmark times: a ``DeepseekV4ForCausalLM`` with the model's own random
initialisation under a fixed seed. Timings do not depend on weight values except through MoE
routing, which the random router (and random hash ids) spreads over the experts."""
from __future__ import annotations

import torch

from dsv4_ops import DeepseekV4ForCausalLM, DSV4Config


def bench_model(cfg: DSV4Config, dtype: torch.dtype = torch.bfloat16, device="cuda", seed: int = 0):
    torch.manual_seed(seed)
    return DeepseekV4ForCausalLM(cfg, dtype=dtype, device=device).eval()
