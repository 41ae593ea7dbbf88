"""dsv4_ops: torch.compile-native DeepSeek-V4 attention ops and runtime.

Importing registers every ``torch.ops.dsv4`` op. Public API: DESIGN.md §2.
"""
from . import ops  # registers every torch.ops.dsv4 op
from .config import DSV4Config
from .generator import Generator
from .hf import from_hf
from .model.model import DeepseekV4ForCausalLM
from .ops import Plan, cache_write, compress, indexer_topk, plan, sparse_attention  # noqa: F401

__all__ = ["DSV4Config", "DeepseekV4ForCausalLM", "Generator", "from_hf", "ops"]
