"""pytest plugin: the sm_90 attention tests against a candidate bf16 ``ws`` module, before it replaces today's.

    WS_VARIANT=cand.py PYTHONPATH=$PWD python3 -m pytest -p benchmarks.ws_swap_plugin -m "gpu or not gpu" \
        tests/ops/test_sparse_attention_sm90.py       # on the GPU box

The file named in ``$WS_VARIANT`` is imported as ``lowering.gluon.sparse_attention_ws_variant`` and put where
``gluon_config`` finds the ``ws`` kernel, as ``benchmarks/ws_ab.py`` does for its timings (session 24 checked each
candidate this way: oracle, edge cases, poisoned shared memory).
"""
import importlib.util
import os
import sys

import lowering.gluon as pkg

_path = os.environ["WS_VARIANT"]
_spec = importlib.util.spec_from_file_location("lowering.gluon.sparse_attention_ws_variant", _path)
_mod = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _mod
_spec.loader.exec_module(_mod)
sys.modules["lowering.gluon.sparse_attention_ws"] = _mod
pkg.sparse_attention_ws = _mod
print(f"swap_ws: lowering.gluon.sparse_attention_ws is {_path}", file=sys.stderr)
