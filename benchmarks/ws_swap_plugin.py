"""pytest plugin: the sm_90 attention tests against a candidate ``ws`` kernel, before it replaces today's.

    WS_VARIANT=cand.py PYTHONPATH=$PWD python3 -m pytest -p benchmarks.ws_swap_plugin -m "gpu or not gpu" \
        tests/ops/test_sparse_attention_sm90.py       # on the GPU box
    FP8_WS_SETTING=Q_REG_COLS=128,HELPER_REGS=168 PYTHONPATH=$PWD python3 -m pytest -p benchmarks.ws_swap_plugin \
        -m "gpu or not gpu" tests/ops/test_sparse_attention_sm90_fp8.py

bf16: the file named in ``$WS_VARIANT`` is imported as ``lowering.gluon.sparse_attention_ws_variant`` and put where
``gluon_config`` finds the ``ws`` kernel, as ``benchmarks/ws_ab.py`` does for its timings (session 24 checked each
candidate this way: oracle, edge cases, poisoned shared memory). FP8: ``$FP8_WS_SETTING`` sets constants of
``sparse_attention_fp8_ws`` (``ws_ab.py --fp8``'s form), which its launcher passes to the kernel. Either or both.
"""
import importlib.util
import os
import sys

import lowering.gluon as pkg

_path = os.environ.get("WS_VARIANT")
if _path:
    _spec = importlib.util.spec_from_file_location("lowering.gluon.sparse_attention_ws_variant", _path)
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _mod
    _spec.loader.exec_module(_mod)
    sys.modules["lowering.gluon.sparse_attention_ws"] = _mod
    pkg.sparse_attention_ws = _mod
    print(f"swap_ws: lowering.gluon.sparse_attention_ws is {_path}", file=sys.stderr)
_setting = os.environ.get("FP8_WS_SETTING")
if _setting:
    from benchmarks.ws_ab import fp8_setting
    from lowering.gluon import sparse_attention_fp8_ws

    for _name, _value in fp8_setting(_setting).items():
        setattr(sparse_attention_fp8_ws, _name, _value)
    print(f"swap_ws: sparse_attention_fp8_ws {_setting}", file=sys.stderr)
