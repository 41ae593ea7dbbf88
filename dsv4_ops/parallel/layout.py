"""Which tensors a tensor-parallel rank holds a slice of, and which slice.

One table (``SHARDED_DIMS``) says it for every parameter, by name suffix: a sharded tensor is cut
into ``size`` equal contiguous chunks along one dim and rank ``r`` keeps chunk ``r``. The same rule
slices a real model, a meta model (shapes only) and checkpoint tensors while they stream in, so
the three can never disagree. Everything not in the table is replicated.

Attention (the plan of torchtitan / SGLang for V4, anchors_kernels_hf_aoti_tp.md §6):
  * ``q_b_proj`` column-parallel by heads (rows ``h*D .. (h+1)*D`` are head ``h``), ``sinks`` by
    heads, ``o_a_proj`` by whole output groups (rows ``j*r .. (j+1)*r`` are group ``j``; group ``j``
    reads heads ``j*H/g ..``, so a rank's groups read exactly its heads), ``o_b_proj`` row-parallel
    (its input columns are the groups): each rank's output is a partial sum, all-reduced once per
    attention block.
  * Replicated: ``q_a_proj`` + norm (its latent ``qr`` also feeds the indexer), ``kv_proj`` + norm
    (one KV head), the compressor, the indexer and its top-k (it sums over all index heads, so
    sharding it would need an all-reduce of the scores before top-k), and so the whole KV cache.

MoE: expert parallelism, each rank holds ``E / size`` consecutive routed experts (``ExpertShard``).
The shared expert is replicated (see ``experts.py`` for why).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..config import DSV4Config

__all__ = ["SHARDED_DIMS", "TensorParallel"]

# parameter-name suffix -> the dim cut into `size` chunks (main layers and the MTP block alike)
SHARDED_DIMS = {
    "self_attn.q_b_proj.weight": 0,
    "self_attn.sinks": 0,
    "self_attn.o_a_proj.weight": 0,
    "self_attn.o_b_proj.weight": 1,
    "mlp.experts.gate_up_proj": 0,
    "mlp.experts.down_proj": 0,
}


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``size`` in the tensor-parallel process group ``group`` (``None``: no
    communication; for slicing state dicts offline)."""

    rank: int
    size: int
    group: object = None

    @classmethod
    def of(cls, group) -> "TensorParallel":
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError("tensor parallel: torch.distributed is not initialised "
                             "(torch.distributed.init_process_group, e.g. under torchrun)")
        group = group or dist.group.WORLD
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def check(self, cfg: DSV4Config) -> None:
        """Every sharded count must divide by ``size``; ``ValueError`` naming the config field."""
        for field in ("num_attention_heads", "o_groups", "n_routed_experts"):
            value = getattr(cfg, field)
            if value % self.size:
                raise ValueError(f"tensor parallel: config.{field} = {value} does not divide by tp_size = "
                                 f"{self.size} (each rank holds an equal share of the {field.split('_')[-1]})")

    def dim_of(self, name: str) -> int | None:
        """The dim ``name`` is sharded along, or ``None`` when it is replicated."""
        for suffix, dim in SHARDED_DIMS.items():
            if name.endswith(suffix):
                return dim
        return None

    def take(self, name: str, t: Tensor) -> Tensor:
        """This rank's slice of the full tensor ``name`` (the tensor itself when replicated); a
        view: ``clone`` it to let the full tensor go."""
        dim = self.dim_of(name)
        if dim is None:
            return t
        n = t.shape[dim]
        if n % self.size:
            raise ValueError(f"tensor parallel: {name} has {n} rows along dim {dim}, which does not divide "
                             f"by tp_size = {self.size}")
        return t.narrow(dim, self.rank * (n // self.size), n // self.size)

    def expert_range(self, n_experts: int) -> tuple[int, int]:
        """``[first, end)``: the routed experts this rank holds."""
        per = n_experts // self.size
        return self.rank * per, (self.rank + 1) * per

    def shard_state_dict(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """This rank's part of a full state dict (sharded tensors cloned, the rest shared)."""
        return {k: (self.take(k, v).clone() if self.dim_of(k) is not None else v) for k, v in state_dict.items()}
