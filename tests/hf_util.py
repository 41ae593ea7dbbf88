"""Shared helpers for whole-model tests against HF transformers' ``DeepseekV4ForCausalLM``.

``make_hf(cfg, seed)`` builds the HF model with EVERY loaded parameter and buffer drawn fresh
(HF's init leaves zeros / ``torch.empty`` in sinks, position biases, the router bias and
``tid2eid``); ``hf_and_ours(cfg, seed)`` adds our model loaded from it with ``from_hf``.
``HFRow`` runs one sequence incrementally through HF at batch 1 (HF's own ``DynamicCache`` via
the ``cache=`` kwarg; ``past_key_values`` is its deprecated alias in transformers 5.x), so HF
padding semantics never enter a comparison. ``rel`` is the one error metric.

The RoPE ``inv_freq`` buffers are the only buffers not randomised: they are derived from the
config (non-persistent, never in a checkpoint), and both sides compute them from it.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

import dsv4_ops
from dsv4_ops.config import DSV4Config

__all__ = ["make_hf", "randomize_hf_", "hf_and_ours", "HFRow", "rel", "random_prompts"]


def rel(ours: Tensor, ref: Tensor) -> float:
    """``||ours - ref|| / ||ref||`` over the whole tensor, in float64."""
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return ((ours.double() - ref.double()).norm() / ref.double().norm()).item()


def randomize_hf_(hf: nn.Module, cfg: DSV4Config, seed: int) -> nn.Module:
    """Fresh random values for every parameter and loaded buffer, scaled so activations stay
    O(1) and the mHC sigmoid / softmax / Sinkhorn mixes are not saturated. Never zeros."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight"):  # RMSNorm gains (incl. q_a_norm, kv_norm)
                r = 1 + 0.2 * r
            elif leaf in ("scale", "hc_scale"):  # mHC scales
                r = 1 + 0.3 * r
            elif leaf in ("base", "hc_base", "sinks"):
                r = 0.5 * r
            elif leaf in ("fn", "hc_fn"):  # mHC mixing projections
                r = 0.1 * r
            elif leaf == "position_bias":
                r = 0.5 * r
            elif leaf == "gate_up_proj":  # [E, 2I, D]
                r = r / p.shape[-1] ** 0.5
            elif leaf == "down_proj" and p.dim() == 3:  # [E, D, I]
                r = r / p.shape[-1] ** 0.5
            elif p.dim() == 2:  # Linear / Embedding [out, in]
                r = r / p.shape[1] ** 0.5
            p.copy_(r.to(p.dtype))
        for name, b in hf.named_buffers():
            if name.endswith("tid2eid"):  # valid expert ids; a row may repeat an expert (counts twice)
                b.copy_(torch.randint(0, cfg.n_routed_experts, b.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.5)
            elif "inv_freq" in name:
                continue  # derived from the config; see the module docstring
            else:
                raise AssertionError(f"randomize_hf_: unhandled HF buffer {name}; randomise it")
    return hf


def make_hf(cfg: DSV4Config, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A transformers ``DeepseekV4ForCausalLM`` for ``cfg`` with fully random weights (eval mode)."""
    from transformers import DeepseekV4ForCausalLM as HFModel

    hcfg = cfg.to_hf(attn_implementation="eager")
    hcfg._experts_implementation = "eager"  # HF's reference expert loop
    torch.manual_seed(seed)  # HF's own init draws from the global generator; make it reproducible
    hf = HFModel(hcfg).eval()
    randomize_hf_(hf, cfg, seed)
    return hf.to(dtype) if dtype != torch.float32 else hf


def hf_and_ours(cfg: DSV4Config, seed: int = 0, **from_hf_kwargs):
    """``(hf, ours)``: a random HF model and ``dsv4_ops.from_hf`` of it (fp32 unless told)."""
    hf = make_hf(cfg, seed)
    return hf, dsv4_ops.from_hf(hf, **from_hf_kwargs)


def random_prompts(lengths, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


class HFRow:
    """One sequence through HF, incrementally, at batch 1: ``prefill(ids) -> logits [vocab]`` at
    the last prompt position (and ``self.prompt_logits [S, vocab]`` for all of them), then
    ``decode(tok) -> logits [vocab]``. HF's own ``DynamicCache`` carries the state."""

    def __init__(self, hf) -> None:
        self.hf, self.cache = hf, None

    @torch.no_grad()
    def prefill(self, ids: list[int]) -> Tensor:
        out = self.hf(input_ids=torch.tensor([ids]), use_cache=True)
        self.cache = out.cache
        self.prompt_logits = out.logits[0].float()
        return self.prompt_logits[-1]

    @torch.no_grad()
    def decode(self, tok: int) -> Tensor:
        out = self.hf(input_ids=torch.tensor([[tok]]), cache=self.cache, use_cache=True)
        self.cache = out.cache
        return out.logits[0, -1].float()
