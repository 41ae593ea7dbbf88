"""Tensor and expert parallelism on ``torch.distributed`` (issue #16): the model across ranks,
compiled with ``fullgraph=True`` and, on GPUs, replayed as CUDA graphs.

    device = dsv4_ops.parallel.init_distributed()            # under torchrun: NCCL on GPUs, gloo on CPU
    model = dsv4_ops.parallel.load_pretrained(path, device=device)   # this rank's shard only
    # or: model = dsv4_ops.parallel.shard_model(DeepseekV4ForCausalLM(cfg, device=device))
    gen = dsv4_ops.Generator(model, ...)                     # unchanged; every rank runs the same calls

What is sharded and why: ``layout.py`` (attention: heads / output groups, one all-reduce per
block; everything else replicated) and ``experts.py`` (MoE: expert parallelism, one all-reduce).
Demo: ``torchrun --nproc-per-node 2 -m dsv4_ops.parallel.demo``.
"""
from .experts import ExpertShard
from .layout import SHARDED_DIMS, TensorParallel
from .load import ShardLoadError, load_pretrained, raise_if_any_rank_failed
from .process_group import init_distributed
from .shard import shard_layer, shard_model, shard_with

__all__ = ["ExpertShard", "SHARDED_DIMS", "ShardLoadError", "TensorParallel", "init_distributed", "load_pretrained",
           "raise_if_any_rank_failed", "shard_layer", "shard_model", "shard_with"]
