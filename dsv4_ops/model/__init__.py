"""DeepSeek-V4 model on the dsv4 ops (HF parameter names)."""
from .attention import Attention, AttentionState
from .hyper_connection import HyperConnection, HyperHead
from .model import CacheConfig, DeepseekV4ForCausalLM, DeepseekV4Model
from .moe import MLP, Experts, MoE, Router

__all__ = ["Attention", "AttentionState", "CacheConfig", "DeepseekV4ForCausalLM", "DeepseekV4Model",
           "HyperConnection", "HyperHead", "MoE", "Experts", "Router", "MLP"]
