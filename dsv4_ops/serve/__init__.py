"""Serving: continuous batching over a paged, prefix-cached KV pool (``Engine``)."""
from .engine import Engine, RequestOutput

__all__ = ["Engine", "RequestOutput"]
