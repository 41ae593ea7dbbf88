"""Expert parallelism: a rank's share of the routed experts, combined by one all-reduce.

Choice (issue #16: "EP or TP of each expert — choose"): expert parallelism with the router
replicated. Every rank routes every token identically (same replicated hidden state, same router),
runs the token's assignments that land on ITS experts, and the per-rank partial sums are added by
one fp32 all-reduce per MoE layer. Why this and not all-to-all dispatch: decode is bound by reading
expert weights, and here each rank reads only the routed experts it owns (a 2-GPU split halves
the bytes); an all-to-all would move fewer activations but needs data-dependent shapes (tokens per
rank), which breaks static shapes, ``fullgraph=True`` and CUDA-graph replay (DESIGN rule 2). The
all-reduce moves ``T x hidden`` fp32 per layer (16 KB per token at V4-Flash widths), the same
message as the attention block's.

Shape-static trick: an assignment to another rank's expert gets id -1, so ``dsv4::moe_gemv`` sees
``T*K`` assignments whatever the routing (the same static layout as single-GPU ``Experts``) and skips
it: its GEMV kernels (decode) read no weight for it; its grouped paths run it on local expert 0 and
drop the row, a little compute and no extra weight bytes on the grouped GEMMs (expert 0 is read once),
expert 0's gather where single-GPU gathers the real expert on the blocked path (the same bytes).

The shared expert stays replicated (``MoE`` adds it after this all-reduce, in fp32, exactly as the
single-GPU model): it is ~1/(E/K+1) of a layer's routed bytes per token, and replicating it keeps
``MoE.forward`` unchanged and the combine to one collective.
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from ..model.moe import Experts
from ..ops.direct import dsv4

__all__ = ["ExpertShard"]


class ExpertShard(Experts):
    """Experts ``first .. first + n_local - 1`` of a full ``Experts`` (same parameter names, so a
    rank's state dict holds its slice); ``forward`` takes global expert ids and returns the
    all-reduced sum over every rank's experts, fp32 ``[T, D]``, like ``Experts``."""

    def __init__(self, gate_up_proj: Tensor, down_proj: Tensor, first: int, swiglu_limit: float, group) -> None:
        nn.Module.__init__(self)  # the parameters are given: skip Experts' random init
        self.swiglu_limit = swiglu_limit
        self.gate_up_proj = nn.Parameter(gate_up_proj)
        self.down_proj = nn.Parameter(down_proj)
        self.first, self.n_local, self.group = first, gate_up_proj.shape[0], group

    def forward(self, x: Tensor, indices: Tensor, weights: Tensor) -> Tensor:
        # the op skips ids outside [0, n_local) (zero contribution; the GEMV kernels read no weight for
        # them), so other ranks' assignments cost nothing here
        local = indices - self.first
        local = torch.where((local >= 0) & (local < self.n_local), local, -1)
        partial = dsv4.moe_gemv(x, local, weights, self.gate_up_proj, self.down_proj, float(self.swiglu_limit))
        return funcol.all_reduce(partial, "sum", self.group)

    def extra_repr(self) -> str:
        return f"experts {self.first}..{self.first + self.n_local - 1}"
