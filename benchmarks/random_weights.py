"""The models benchmarks time.

``bench_model``: a ``DeepseekV4ForCausalLM`` with the model's own random initialisation under a
fixed seed (the historical "bench config"). ``flash_slice_config`` + ``random_init_model``: the
"Flash slice" (DESIGN.md §6), V4-Flash widths and layer mix in miniature, built on the meta
device and drawn directly on the target device in its dtype: no CPU copy, no second copy, seconds
on a GPU. Timings do not depend on weight values except through MoE routing, which the random
router (and random hash ids) spreads over the experts."""
from __future__ import annotations

import torch

from dsv4_ops import DeepseekV4ForCausalLM, DSV4Config
from dsv4_ops.config import CSA, HCA, SLIDING
from dsv4_ops.model.model import rope_tables_for

CONFIGS = ("bench", "flash-slice")


def bench_model(cfg: DSV4Config, dtype: torch.dtype = torch.bfloat16, device="cuda", seed: int = 0):
    torch.manual_seed(seed)
    return DeepseekV4ForCausalLM(cfg, dtype=dtype, device=device).eval()


def flash_slice_config() -> DSV4Config:
    """V4-Flash as shipped (hidden 4096, 64 heads x 512, window 128, CSA m=4 with the indexer,
    HCA m=128, mHC x4, 256 routed experts top-6 x 2048 + 1 shared, vocab 129280, 1 MTP block)
    cut to its real layer mix in miniature: 2 sliding-window layers with hash MoE, then one CSA
    and one HCA layer with biased top-k. bf16: 55 GB main model + 13 GB MTP block (68 GB)."""
    return DSV4Config(num_hidden_layers=4, layer_types=[SLIDING, SLIDING, CSA, HCA],
                      mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], num_nextn_predict_layers=1)


@torch.no_grad()
def random_init_model(cfg: DSV4Config, dtype: torch.dtype = torch.bfloat16, device="cuda", seed: int = 0,
                      max_positions: int | None = None) -> DeepseekV4ForCausalLM:
    """``DeepseekV4ForCausalLM(cfg)`` built on the meta device, then allocated once on ``device``
    (``to_empty``) and drawn there in place: matrices ~ N(0, 1/fan_in), norm gains ~ N(1, 0.2),
    other vectors ~ N(0, 0.2) (as tests/model_util.random_model), valid hash ids, router bias
    ~ N(0, 0.1); the RoPE tables are recomputed for ``device``."""
    device = torch.device(device)
    model = DeepseekV4ForCausalLM(cfg, dtype=dtype, device="meta", max_positions=max_positions)
    max_positions = model.max_positions
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.normal_(0, p.shape[-1] ** -0.5, generator=g)
        else:
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2, generator=g)
    rope = rope_tables_for(cfg, max_positions, device)
    for layer in [*model.model.layers, *model.mtp]:
        attn = layer.self_attn
        attn.cos, attn.sin = rope["main" if attn.ratio == 0 else "compress"]
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            b.random_(0, cfg.n_routed_experts, generator=g)
        elif name.endswith("e_score_correction_bias"):
            b.normal_(0, 0.1, generator=g)
        elif not name.endswith((".cos", ".sin")):
            raise AssertionError(f"random_init_model: unhandled buffer {name}; initialise it")
    return model.eval()


@torch.no_grad()
def spread_hash_tables(hf, n_experts: int) -> None:
    """Random expert ids in a transformers model's hash-layer tables. HF's init zeroes ``tid2eid``
    (a checkpoint fills it), which would send every token of those layers to expert 0: a timed
    step would read one expert there instead of the ones a real table spreads tokens over."""
    for name, b in hf.named_buffers():
        if name.endswith("tid2eid"):
            b.random_(0, n_experts)


def bench_setup(args, script: str, bench_config):
    """``(device, cfg, model)`` of a benchmark run: the bench config (or ``--config flash-slice``)
    in bf16 on CUDA, or with ``--smoke`` the tiny config in fp32 on any device."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not args.smoke:
        raise SystemExit(f"{script}: no CUDA device; on CPU run the tiny --smoke grid")
    if args.smoke:
        cfg = DSV4Config.tiny()
        return device, cfg, bench_model(cfg, dtype=torch.float32, device=device)
    if getattr(args, "config", "bench") == "flash-slice":
        cfg = flash_slice_config()
        return device, cfg, random_init_model(cfg, dtype=torch.bfloat16, device=device)
    cfg = bench_config(args.layers)
    return device, cfg, bench_model(cfg, dtype=torch.bfloat16, device=device)
