"""DeepSeek-V4 model building blocks (HF parameter names)."""
from .hyper_connection import HyperConnection, HyperHead
from .moe import MLP, MoE, Experts, Router

__all__ = ["HyperConnection", "HyperHead", "MoE", "Experts", "Router", "MLP"]
