"""The ``torch.ops.dsv4`` operators: importing this package registers every op.

One module per op family (schema, fake, default implementation, validated public wrapper).
"""
from .attention import sparse_attention
from .cache_write import cache_write
from .compressor import compress
from .indexer import indexer_topk
from .plan import Plan, plan

__all__ = ["Plan", "plan", "cache_write", "compress", "indexer_topk", "sparse_attention"]
