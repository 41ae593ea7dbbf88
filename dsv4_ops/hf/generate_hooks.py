"""What an enabled model changes in HF's ``generate`` loop: per-step host work it does not need.

HF's decode loop waits for the device every step (``unfinished_sequences.max() == 0``), so every
microsecond of Python between two compiled steps is a microsecond the GPU sits idle. An enabled
model addresses its pool by absolute position (each row's count of processed tokens lives on the
device, ``_dsv4_seen``), so a decode step needs only the new token ids and the cache:

* ``create_masks_for_generate`` -> ``None``: no three ``[B, 1, S, max_cache_len]`` masks per step.
* ``prepare_inputs_for_generation``: for a plain one-token decode step with a cache, only
  ``input_ids[:, -1:]`` (a contiguous copy: the compiled step guards on strides), the cache and
  the caller's other keyword arguments; no position ids, no mask, and none of the generic
  function's signature inspection. Every other call (prefill, ``inputs_embeds``, several new tokens
  per step as in assisted decoding) goes to HF's own function unchanged.

Both are instance attributes, so ``disable`` removes them and HF's class is never touched.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["install", "remove"]

_HOOKS = ("create_masks_for_generate", "prepare_inputs_for_generation")
# what a decode step never needs: the step derives positions and padding from its own state
_DROPPED_AT_DECODE = frozenset({"position_ids", "attention_mask", "labels", "next_sequence_length",
                                "token_type_ids", "cache_position"})


def _no_masks(*args, **kwargs) -> None:
    return None


def _lean_prepare(model: nn.Module):
    hf_prepare = type(model).prepare_inputs_for_generation.__get__(model)

    def prepare_inputs_for_generation(input_ids, next_sequence_length=None, cache=None, attention_mask=None,
                                      inputs_embeds=None, is_first_iteration=False, **kwargs):
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        decode = (next_sequence_length == 1 and cache is not None and not is_first_iteration
                  and input_ids is not None and input_ids.dim() == 2
                  and not any(k in kwargs for k in ("mm_token_type_ids", "moe_mm_token_type_ids")))
        if not decode:
            return hf_prepare(input_ids, next_sequence_length=next_sequence_length, cache=cache,
                              attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                              is_first_iteration=is_first_iteration, **kwargs)
        inputs = {k: v for k, v in kwargs.items() if k not in _DROPPED_AT_DECODE}
        # a fresh [B, 1] copy: a slice keeps the row stride S, which grows every step (a new graph each time)
        inputs["input_ids"] = input_ids[:, -1:].clone(memory_format=torch.contiguous_format)
        inputs["cache"] = cache
        return inputs

    return prepare_inputs_for_generation


def install(model: nn.Module) -> None:
    """Set the hooks on a ``DeepseekV4ForCausalLM`` (instance attributes)."""
    model.__dict__["create_masks_for_generate"] = _no_masks
    model.__dict__["prepare_inputs_for_generation"] = _lean_prepare(model)


def remove(model: nn.Module) -> None:
    for name in _HOOKS:
        model.__dict__.pop(name, None)
