"""The ``torch.ops.dsv4`` operators: importing this package registers every op.

One module per op family: a ``torch.library.triton_op`` (schema from type hints; its body is
also its fake) with a static device branch -- Triton kernels for CUDA/ROCm tensors when the
backend is ``triton``, the plain-aten reference otherwise (see ``_backend.py``) -- and the
validated public wrapper (``with value_checks(False):`` keeps only its metadata checks).
"""
from .attention import sparse_attention
from .cache_write import cache_write
from .compressor import compress
from .gemv import gemv
from .indexer import indexer_topk
from .moe_gemv import moe_gemv
from .plan import Plan, plan
from .sinkhorn import sinkhorn
from .validate import value_checks
from .direct import dsv4 as _direct

_direct.add_registered()  # the model's calls of the ops just registered (direct.py)

__all__ = ["Plan", "plan", "cache_write", "compress", "indexer_topk", "sparse_attention", "sinkhorn", "moe_gemv", "gemv",
           "value_checks"]
