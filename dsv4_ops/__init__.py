from . import ops  # registers every torch.ops.dsv4 op
from .ops import Plan, cache_write, compress, indexer_topk, plan, sparse_attention  # noqa: F401
