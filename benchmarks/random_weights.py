"""The model every benchmark times: a ``DeepseekV4ForCausalLM`` with the model's own random
initialisation under a fixed seed. Timings do not depend on weight values except through MoE
routing, which the random router (and random hash ids) spreads over the experts."""
from __future__ import annotations

import torch

from dsv4_ops import DeepseekV4ForCausalLM, DSV4Config


def bench_model(cfg: DSV4Config, dtype: torch.dtype = torch.bfloat16, device="cuda", seed: int = 0):
    torch.manual_seed(seed)
    return DeepseekV4ForCausalLM(cfg, dtype=dtype, device=device).eval()


def bench_setup(args, script: str, bench_config):
    """``(device, cfg, model)`` of a benchmark run: the bench config in bf16 on CUDA, or with
    ``--smoke`` the tiny config in fp32 on any device."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not args.smoke:
        raise SystemExit(f"{script}: no CUDA device; on CPU run the tiny --smoke grid")
    cfg = DSV4Config.tiny() if args.smoke else bench_config(args.layers)
    return device, cfg, bench_model(cfg, dtype=torch.float32 if args.smoke else torch.bfloat16, device=device)
