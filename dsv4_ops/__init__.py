"""dsv4_ops: torch.compile-native DeepSeek-V4 attention ops and runtime.

Importing registers every ``torch.ops.dsv4`` op. Public API: DESIGN.md §2.
"""
import importlib.util as _ilu
import sys as _sys
from pathlib import Path as _Path


def _expose_checkout_lowering() -> None:
    """In a source checkout that is not pip-installed, make ``../lowering`` importable as
    ``dsv4_ops.lowering`` (what setup.py's ``package_dir`` does on install). The checkout's
    own ``../lowering`` wins over an installed one: an editable install made from another
    checkout (a git worktree sharing the venv) would otherwise pair this package with that
    checkout's kernels."""
    root = _Path(__file__).resolve().parent.parent / "lowering"
    if not (root / "__init__.py").is_file() and _ilu.find_spec(__name__ + ".lowering") is not None:
        return
    spec = _ilu.spec_from_file_location(__name__ + ".lowering", root / "__init__.py",
                                        submodule_search_locations=[str(root)])
    module = _ilu.module_from_spec(spec)
    _sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    globals()["lowering"] = module


_expose_checkout_lowering()

from . import ops  # noqa: E402  (registers every torch.ops.dsv4 op)
from . import pretrained  # noqa: E402  (dsv4_ops.pretrained.tiny(): the bundled trained model)
from . import text  # noqa: E402  (tokenizer, chat format, streaming detokenisation)
from .config import DSV4Config
from .aoti_generator import AOTIGenerator
from .aoti_export import export
from .generator import Generator
from .hf import from_hf, load_pretrained
from .model.model import DeepseekV4ForCausalLM
from .ops import Plan, cache_write, compress, indexer_topk, plan, sinkhorn, sparse_attention  # noqa: F401

__all__ = ["AOTIGenerator", "DSV4Config", "DeepseekV4ForCausalLM", "Generator", "export", "from_hf",
           "load_pretrained", "ops", "pretrained", "text"]
