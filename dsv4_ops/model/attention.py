"""The model's attention layer: the reference layer's step, with every stateful kernel call
(plan, cache_write, compress, indexer_topk, sparse_attention) going through the registered
``torch.ops.dsv4`` ops. Same parameters, same math; the ops are the contract (DESIGN rule 5)."""
from .. import ops
from ..reference.layer import ReferenceAttention


class Attention(ReferenceAttention):
    kernels = ops
