"""HF's ``cache_implementation="static"`` for DeepSeek-V4 after ``dsv4_ops.hf.enable``.

transformers 5.x builds a ``StaticCache`` from ``config.layer_types`` through a registry keyed by
layer type, and has no entry for V4's compressed types (``KeyError: 'compressed_sparse_attention'``).
Defining a ``StaticLayer`` subclass with ``_layer_type`` set registers it. These layers only
carry the capacity (``max_cache_len``): the KV pool of an enabled model lives in its attention
modules as buffers (one static address for compiled graphs and CUDA graphs), addressed by
absolute position, so HF's layers are never written. The sliding-window key is shared with
other models and is left alone (HF's layer for it is created but, lazily allocated, never used).
"""
from __future__ import annotations

from transformers.cache_utils import StaticLayer

from ..config import CSA, HCA

__all__ = ["DSV4StaticLayer", "static_capacity"]


class DSV4StaticLayer(StaticLayer):
    def __init__(self, max_cache_len: int, config=None, **kwargs) -> None:
        super().__init__(max_cache_len=max_cache_len)

    def update(self, *args, **kwargs):
        raise RuntimeError("this static DeepSeek-V4 cache serves models running on dsv4_ops: call "
                           "dsv4_ops.hf.enable(model) before generate(..., cache_implementation='static')")

    def lazy_initialization(self, *args, **kwargs) -> None:  # holds no tensors of its own
        self.is_initialized = False


class CSAStaticLayer(DSV4StaticLayer):
    _layer_type = CSA


class HCAStaticLayer(DSV4StaticLayer):
    _layer_type = HCA


def static_capacity(cache) -> int | None:
    """Positions a static cache was sized for (``None`` if it has no compressed layer to say)."""
    for layer in getattr(cache, "layers", ()):
        if isinstance(layer, DSV4StaticLayer):
            return int(layer.max_cache_len)
    return None
