"""``dsv4_ops.hf.enable(model)``: HF transformers' own DeepSeek-V4 model, running on dsv4_ops.

The HF model object stays what it is (its class, ``generate``, logits processors,
``save_pretrained``, parameters and ``state_dict``); its decoder stack adopts dsv4_ops' code
(see ``adopt.py``): attention with its compressor and lightning indexer on the ``torch.ops.dsv4``
ops, and the mHC and MoE of ``dsv4_ops.model`` — static shapes throughout, so HF's compiled
decode (``cache_implementation="static"``) traces with ``fullgraph=True``.

How a forward maps onto a dsv4_ops step (one ``plan`` per forward, every layer reads it):

* Row ``b`` brings ``n[b]`` real tokens starting at position ``start[b]``. From a 2-D
  ``attention_mask`` (left or right padding); otherwise from ``position_ids`` (what ``generate``
  passes: a left-padded prompt ends with its last real token, so ``n = min(S, pos[:, -1] + 1)``);
  otherwise all ``S`` tokens are real.
* Left padding is rotated to the right before the stack and back after it, so pad tokens never
  enter a window, a compressed entry or the indexer: a padded row gets exactly what it gets alone.
* With a static cache, the pool lives in the attention modules as non-persistent buffers (sized on
  the eager prefill from the batch and the cache's ``max_cache_len``) and is addressed by
  absolute position; without a cache the step uses scratch state (a cache-free forward).
* A forward with a cache of more than ``PREFILL_TOKENS`` tokens (all rows together) runs as several cached steps
  of at most that many, as ``Generator``'s prefill does, so a long prompt's activations stay bounded (a 128K-token
  prompt in one step would hold its MoE intermediates for 768K routed rows at once). A cache-free forward is one step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..config import DSV4Config
from ..generation_loop import DEFAULT_MAX_PREFILL_TOKENS
from ..model.attention import Attention
from ..model.model import DEFAULT_MAX_POSITIONS, DeepseekV4Model, rope_tables_for, set_rope
from ..model.plan import plan_step, ring_sizes
from ..ops.validate import reads_values
from . import generate_hooks
from .adopt import adopt, is_adopted, release
from .static_cache import static_capacity

__all__ = ["enable", "disable", "is_enabled"]

# A forward of several tokens runs them right-padded to a multiple of this: Triton specialises integer
# arguments on their divisibility by 16, so a prompt length of another residue than the last one's
# would compile the prefill's kernels again inside the user's call.
PREFILL_MULTIPLE = 64
PREFILL_TOKENS = DEFAULT_MAX_PREFILL_TOKENS  # the most tokens of one cached prefill step, all rows together


@dataclass
class _Step:
    meta: object  # StepMeta
    states: list | None  # scratch AttentionStates (cache-free), or None: each layer's own cache buffers
    rows: int


class HFAttentionOnOps(Attention):
    """Our attention reading its state from the step: scratch state (cache-free) or its own buffers."""

    def forward(self, x: Tensor, meta, step: _Step) -> Tensor:
        state = step.states[self.layer_idx] if step.states is not None else self.cache_state().rows(step.rows)
        return Attention.forward(self, x, meta, state)


class HFModelOnOps(DeepseekV4Model):
    """HF ``DeepseekV4Model.forward`` on the dsv4_ops decoder stack (HF signature and outputs)."""

    def forward(self, input_ids: Tensor | None = None, attention_mask=None, position_ids: Tensor | None = None,
                cache=None, inputs_embeds: Tensor | None = None, use_cache: bool | None = None, **kwargs):
        from transformers.modeling_outputs import MoeModelOutputWithPast

        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        with torch.no_grad():  # the dsv4 ops are inference kernels (no backward)
            hidden = self._dsv4_run(input_ids, attention_mask, position_ids, cache, inputs_embeds)
        return MoeModelOutputWithPast(last_hidden_state=hidden, cache=cache)

    # ---------------------------------------------------------------- one step
    def _dsv4_run(self, input_ids, attention_mask, position_ids, cache, inputs_embeds) -> Tensor:
        cfg: DSV4Config = self._dsv4_cfg
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("dsv4_ops.hf: pass exactly one of input_ids or inputs_embeds")
        if input_ids is None and any(t == "hash_moe" for t in cfg.mlp_layer_types):
            raise ValueError("dsv4_ops.hf: this model has hash-routed MoE layers, which route by token id: "
                             "pass input_ids, not inputs_embeds")
        ref = input_ids if input_ids is not None else inputs_embeds
        B, S = ref.shape[:2]
        device = ref.device
        n, shift, start = self._dsv4_rows(attention_mask, position_ids, B, S, device)
        S_run = S if S == 1 else -(-S // PREFILL_MULTIPLE) * PREFILL_MULTIPLE  # padded after the real tokens
        eager = not torch.compiler.is_compiling()
        if cache is not None:
            if eager:
                self._dsv4_prepare_cache(cache, B, device)
            if start is None:
                start = self._dsv4_seen[:B]
            states, rings = None, self._dsv4_rings
        else:
            if start is None:
                start = torch.zeros(B, dtype=torch.int32, device=device)
            states = [layer.self_attn.new_state(B, S_run, None, self._dsv4_dtype(), device) for layer in self.layers]
            rings = ring_sizes(cfg)
        if eager and reads_values(start, n):
            self._dsv4_check_positions(start, n, S, cache)

        if S > 1:  # left padding -> right padding: real tokens first in every row, then S_run - S more
            # columns (repeats; n counts the real tokens, and the plan gives the others no writes)
            to_front = (torch.arange(S_run, device=device).clamp(max=S - 1) + shift[:, None]) % S
            if input_ids is not None:
                input_ids = input_ids.gather(1, to_front)
            else:
                inputs_embeds = inputs_embeds.gather(1, to_front[..., None].expand(-1, -1, inputs_embeds.shape[-1]))
        width = S_run if cache is None or not eager else prefill_columns(B)
        if S_run <= width:
            hidden = self._dsv4_step(input_ids, inputs_embeds, start, n, S_run, states, rings)[:, :S]
        else:  # several cached steps; a row whose tokens ended stays at its next position with none new
            parts = []
            for at in range(0, S_run, width):
                w = min(width, S_run - at)
                done = n.clamp(max=at)
                parts.append(self._dsv4_step(None if input_ids is None else input_ids[:, at:at + w],
                                             None if inputs_embeds is None else inputs_embeds[:, at:at + w],
                                             start + done, (n - done).clamp(max=w), w, states, rings))
            hidden = torch.cat(parts, 1)[:, :S]
        if cache is not None:
            self._dsv4_seen[:B].copy_(start + n)
        if S > 1:
            back = (torch.arange(S, device=device) - shift[:, None]) % S
            hidden = hidden.gather(1, back[..., None].expand_as(hidden))
        return hidden

    def _dsv4_step(self, input_ids, inputs_embeds, start: Tensor, n: Tensor, S: int, states, rings) -> Tensor:
        """One step of the stack: ``S`` columns, ``n[b]`` real tokens of row ``b`` from position ``start[b]``."""
        cfg: DSV4Config = self._dsv4_cfg
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        x = h.unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1).contiguous()
        step = _Step(plan_step(cfg, start, n, S, rings), states, h.shape[0])
        for layer in self.layers:
            x = layer(x, step.meta, step, input_ids)  # our DecoderLayer hands `step` to the attention
        return self.norm(self.hc_head(x))

    @staticmethod
    def _dsv4_rows(attention_mask, position_ids, B: int, S: int, device):
        """Per row: real new tokens ``n``, left pads ``shift``, first position ``start`` (None: unknown)."""
        if isinstance(attention_mask, Tensor) and attention_mask.dim() == 2:
            m = attention_mask[:, -S:].to(torch.int32)
            n = m.sum(-1, dtype=torch.int32)
            shift = (m.cumsum(-1) == 0).sum(-1, dtype=torch.int32)
            if reads_values(m) and not torch.compiler.is_compiling():
                j = torch.arange(S, device=m.device)
                contiguous = (j >= shift[:, None]) & (j < (shift + n)[:, None])
                if not torch.equal(contiguous.to(torch.int32), m):
                    raise ValueError("dsv4_ops.hf: attention_mask must mark one contiguous run of real tokens "
                                     "per row (left or right padding), got holes")
        elif position_ids is not None:
            n = torch.clamp(position_ids[:, -1] + 1, max=S).to(torch.int32)
            shift = S - n
        else:
            n = torch.full((B,), S, dtype=torch.int32, device=device)
            shift = torch.zeros(B, dtype=torch.int32, device=device)
        start = None
        if position_ids is not None:
            first = shift.clamp(max=S - 1).long()[:, None]
            start = position_ids.expand(B, S).gather(1, first)[:, 0].to(torch.int32)
        return n, shift.to(torch.int64), start

    def _dsv4_dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def _dsv4_check_positions(self, start: Tensor, n: Tensor, S: int, cache) -> None:
        if bool((start < 0).any()):
            raise ValueError(f"dsv4_ops.hf: negative positions {start.tolist()}")
        end = int((start + n).max())
        if cache is None:
            if bool((start != 0).any()):
                raise ValueError(f"dsv4_ops.hf: position_ids start at {start.tolist()} but no cache was passed "
                                 "(a forward without a cache runs whole sequences from position 0)")
            if end > self._dsv4_max_positions():
                self._dsv4_set_rope(end)
        elif end > self._dsv4_capacity:
            raise ValueError(f"dsv4_ops.hf: {end} positions exceed the static cache's max_cache_len "
                             f"{self._dsv4_capacity}: generate with a larger max_new_tokens budget or pass a "
                             "StaticCache with a larger max_cache_len")

    # ---------------------------------------------------------------- the pool
    def _dsv4_prepare_cache(self, cache, B: int, device) -> None:
        from transformers.cache_utils import DynamicCache, StaticCache

        if isinstance(cache, DynamicCache) or not isinstance(cache, StaticCache):
            raise ValueError(f"dsv4_ops.hf: a model on dsv4_ops needs a static cache, got {type(cache).__name__}: "
                             "generate(..., cache_implementation='static') (enable() makes it the default) or "
                             "pass transformers.StaticCache(config=model.config, max_cache_len=N)")
        need = static_capacity(cache) or self._dsv4_max_positions()
        dtype = self._dsv4_dtype()
        self._dsv4_capacity = need  # positions this cache admits (the pool may hold more)
        held = getattr(self, "_dsv4_pool_key", None)
        if held is not None and held[0] == B and held[2:] == (dtype, str(device)) and held[1] >= need:
            return  # the pool holds it: the same buffers, so the same compiled step and CUDA graphs
        capacity = max(need, min(pool_bucket(need), self._dsv4_cfg.max_position_embeddings))
        key = (B, capacity, dtype, str(device))
        if capacity > self._dsv4_max_positions():
            self._dsv4_set_rope(capacity)
        for layer in self.layers:
            layer.self_attn.setup_cache(B, capacity, self._dsv4_rings, dtype)
        self.register_buffer("_dsv4_seen", torch.zeros(B, dtype=torch.int32, device=device), persistent=False)
        self._dsv4_pool_key = key

    def _dsv4_clear_pool(self) -> None:
        for layer in self.layers:
            layer.self_attn.clear_cache()
        self._buffers.pop("_dsv4_seen", None)
        self._dsv4_pool_key = None

    def _dsv4_max_positions(self) -> int:
        return self.layers[0].self_attn.cos.shape[0]

    def _dsv4_set_rope(self, n: int) -> None:
        set_rope([layer.self_attn for layer in self.layers], self._dsv4_cfg, n, self.embed_tokens.weight.device)


def prefill_columns(rows: int) -> int:
    """Columns of one cached prefill step of ``rows`` rows: ``PREFILL_TOKENS`` shared by the rows, a multiple of
    ``PREFILL_MULTIPLE`` (at least one)."""
    return max(PREFILL_MULTIPLE, PREFILL_TOKENS // rows // PREFILL_MULTIPLE * PREFILL_MULTIPLE)


def pool_bucket(positions: int) -> int:
    """The pool's capacity for a static cache of ``positions``: a power of two up to 8192, then a
    multiple of 8192. A larger ``max_new_tokens`` or prompt within the bucket keeps the pool, and
    with it the compiled decode step (its shapes include the pool's); a pool is never shrunk."""
    return max(256, 1 << (positions - 1).bit_length()) if positions <= 8192 else -(-positions // 8192) * 8192


# ---------------------------------------------------------------------------- enable / disable
def _base_model(model: nn.Module) -> nn.Module:
    try:
        from transformers import DeepseekV4ForCausalLM, DeepseekV4Model
    except ImportError as e:  # pragma: no cover - transformers without DeepSeek-V4
        raise TypeError("dsv4_ops.hf.enable needs transformers >= 5.24 (DeepseekV4ForCausalLM; requirements.txt)") from e
    if isinstance(model, DeepseekV4ForCausalLM):
        return model.model
    if isinstance(model, DeepseekV4Model):
        return model
    raise TypeError(f"dsv4_ops.hf.enable: expected a transformers DeepseekV4ForCausalLM or DeepseekV4Model, "
                    f"got {type(model).__name__}")


def is_enabled(model: nn.Module) -> bool:
    return is_adopted(_base_model(model))


def enable(model: nn.Module) -> nn.Module:
    """Run HF's ``DeepseekV4ForCausalLM`` / ``DeepseekV4Model`` on dsv4_ops, in place; returns ``model``.

    Parameters are shared, not copied (``state_dict`` keys and tensors unchanged). ``generate``
    then defaults to ``cache_implementation="static"`` and, for a model not on the CPU, a
    ``CompileConfig(fullgraph=True)`` (HF compiles the decode step on CUDA, or on any device with
    ``compile_config._compile_all_devices``).
    Calling it again is a no-op. ``disable(model)`` restores HF's own code.
    """
    base = _base_model(model)
    if is_adopted(base):
        return model
    cfg = DSV4Config.from_hf(base.config)
    device = base.embed_tokens.weight.device
    rope = rope_tables_for(cfg, min(cfg.max_position_embeddings, DEFAULT_MAX_POSITIONS), device)  # real: HF gets them
    with torch.device("meta"):  # parameters only as a layout to adopt; HF's own are used
        ours = DeepseekV4Model(cfg, rope)
    for i, layer in enumerate(ours.layers):  # the attention reads its state from the step
        layer.self_attn.__class__ = HFAttentionOnOps
        layer.self_attn.layer_idx = i
    ours.__class__ = HFModelOnOps
    ours._dsv4_cfg, ours._dsv4_rings, ours._dsv4_pool_key = cfg, ring_sizes(cfg), None
    adopt(base, ours)

    gen = getattr(model, "generation_config", None)
    if gen is not None:
        from transformers import CompileConfig

        saved = (gen.cache_implementation, gen.compile_config)
        base.__dict__["_dsv4_generation_defaults"] = (gen, saved)
        if gen.cache_implementation is None:
            gen.cache_implementation = "static"
        if gen.compile_config is None and device.type != "cpu":
            # where HF compiles the decode step (on CPU HF would only warn that it cannot); a model
            # moved to CUDA later gets HF's default CompileConfig, which our graph-break-free step also meets
            gen.compile_config = CompileConfig(fullgraph=True, dynamic=False)
    if model is not base:  # generate: no per-step work the step never reads (generate_hooks.py)
        generate_hooks.install(model)
    return model


def disable(model: nn.Module) -> nn.Module:
    """Undo ``enable``: HF's own classes and code again, the dsv4_ops pool freed. Returns ``model``."""
    base = _base_model(model)
    if not is_adopted(base):
        return model
    base._dsv4_clear_pool()
    generate_hooks.remove(model)
    gen, saved = base.__dict__.pop("_dsv4_generation_defaults", (None, None))
    if gen is not None:
        gen.cache_implementation, gen.compile_config = saved
    release(base)
    return model
