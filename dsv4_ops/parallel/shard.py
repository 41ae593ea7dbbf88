"""``shard_model``: turn a ``DeepseekV4ForCausalLM`` (real or on the meta device) into this rank's
tensor/expert-parallel shard, in place.

gpt-fast's recipe: plain tensors, sliced once; the only communication is a functional-collective
all-reduce (``torch.distributed._functional_collectives``) at the end of each attention block
(a forward hook on the attention module) and of each routed-expert block (``ExpertShard``).
Functional collectives are ordinary traceable ops, so the step still compiles with
``fullgraph=True`` and, with NCCL, replays inside CUDA graphs. Every rank runs the same step on
the same inputs; after each all-reduce the hidden state is identical on every rank, so the
replicated parts (router, indexer top-k, KV cache, sampling) make identical decisions
everywhere and the ``Generator`` runs unchanged.
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

from ..model.decoder_layer import DecoderLayer
from .experts import ExpertShard
from .layout import TensorParallel

__all__ = ["shard_model", "shard_with", "shard_layer"]


def _all_reduce_output(group):
    def hook(module, args, output):
        return funcol.all_reduce(output, "sum", group)

    return hook


def _keep(param: torch.Tensor, part: torch.Tensor) -> nn.Parameter:
    # an own copy of the slice: a view would keep the full tensor alive
    return nn.Parameter(part.clone(), requires_grad=param.requires_grad)


@torch.no_grad()
def shard_layer(layer: DecoderLayer, tp: TensorParallel) -> None:
    """Shard one decoder layer (a main layer or the MTP block) in place; a no-op when it
    already is."""
    attn = layer.self_attn
    if getattr(attn, "tensor_parallel", None) is not None:
        return
    for name in ("q_b_proj", "o_a_proj", "o_b_proj"):
        lin = getattr(attn, name)
        lin.weight = _keep(lin.weight, tp.take(f"self_attn.{name}.weight", lin.weight))
        lin.out_features, lin.in_features = lin.weight.shape
    attn.sinks = _keep(attn.sinks, tp.take("self_attn.sinks", attn.sinks))
    attn.num_heads //= tp.size
    attn.o_groups //= tp.size
    attn.register_forward_hook(_all_reduce_output(tp.group))  # o_b_proj's partial sums
    attn.tensor_parallel = tp

    ex = layer.mlp.experts
    first, end = tp.expert_range(ex.gate_up_proj.shape[0])
    layer.mlp.experts = ExpertShard(ex.gate_up_proj[first:end].clone(), ex.down_proj[first:end].clone(), first,
                                    ex.swiglu_limit, tp.group)


def shard_model(model, group=None):
    """Keep only this rank's shard of ``model`` (a ``DeepseekV4ForCausalLM``, real or on the
    meta device), in place; returns it. ``group``: the tensor-parallel process group (default:
    the whole world). Parameter names are unchanged (a rank's ``state_dict`` is its slice of
    the full one, see ``TensorParallel.take``). Raises ``ValueError`` naming the config field
    when heads, output groups or routed experts do not divide by the group size.

    Call it before ``setup_caches`` / ``Generator``; every rank then runs the same calls with the
    same inputs and gets the same logits (the single-process model's, up to the order of the
    all-reduced sums)."""
    return shard_with(model, TensorParallel.of(group))


def shard_with(model, tp: TensorParallel):
    """``shard_model`` for an explicit ``TensorParallel`` (rank, size, group)."""
    tp.check(model.config)
    if tp.size > 1:
        for layer in [*model.model.layers, *model.mtp]:
            shard_layer(layer, tp)
    model.tensor_parallel = tp
    return model
