"""Inductor compiles a ``wrap_triton`` kernel from a copy of its source plus the jit functions
and constants it names (``user_defined_triton_kernel_transitive_closure_source_code``), in a
module of its own that imports only ``triton`` and ``triton.language as tl``. A kernel that
reaches a helper any other way (``fc.pow2`` through a module alias) runs eagerly and under the
interpreter, and fails only in a compiled graph with ``NameError`` -- found on the H200 for the
FP8 cache's kernels. Here, without a GPU: every kernel of every op, rebuilt from exactly the
source Inductor would emit, resolves every global name it loads.

Runs in a subprocess without ``TRITON_INTERPRET`` (conftest sets it for this process, and
interpreted kernels are not ``triton.JITFunction``s)."""
import json
import sys
from pathlib import Path

import pytest
from compiled_worker import ROOT, run_worker
from test_triton_op_trace import OP_KERNELS

MODULES = ("cache_write", "compress", "gemv", "indexer", "moe_gemv", "plan", "sinkhorn", "sparse_attention")
HEADER = "import triton\nimport triton.language as tl\n"  # what Inductor's kernel module imports
NAMES = sorted({k for ks in OP_KERNELS.values() for k in ks})


def _worker():
    import dis
    import importlib
    import importlib.util
    import tempfile
    import types

    sys.path.insert(0, str(ROOT))
    import triton
    from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code

    kernels = {}
    for mod in MODULES:
        m = importlib.import_module(f"dsv4_ops.lowering.triton.{mod}")
        kernels.update({n: k for n, k in vars(m).items() if isinstance(k, triton.JITFunction)})
    report, workdir = {}, Path(tempfile.mkdtemp())
    for name in NAMES:
        if name not in kernels:
            report[name] = "not found"
            continue
        # a file of its own, as Inductor writes it (@triton.jit reads its function's source file)
        path = workdir / f"inductor_copy_of_{name}.py"
        source = user_defined_triton_kernel_transitive_closure_source_code(kernels[name])
        path.write_text(HEADER + source)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        namespace = vars(module)
        unresolved = {}
        for fn_name, fn in namespace.items():
            # the kernel itself is copied without its decorator (Inductor adds its own): a function
            fn = fn.fn if isinstance(fn, triton.JITFunction) else fn
            if isinstance(fn, types.FunctionType) and fn.__module__ == module.__name__:
                loads = {i.argval for i in dis.Bytecode(fn) if i.opname == "LOAD_GLOBAL"}
                missing = sorted(n for n in loads if n not in namespace and not hasattr(__builtins__, n)
                                 and n not in getattr(__builtins__, "__dict__", __builtins__))
                if missing:
                    unresolved[fn_name] = missing
        report[name] = dict(unresolved=unresolved, backslash_lines=[ln for ln in source.splitlines() if "\\" in ln])
    print(json.dumps(report))


@pytest.fixture(scope="module")
def report():
    return run_worker(__file__)


@pytest.mark.parametrize("name", NAMES)
def test_inductor_source_of_the_kernel_resolves_every_name(report, name):
    assert report[name] != "not found", f"{name}: no such kernel in dsv4_ops.lowering.triton"
    assert report[name]["unresolved"] == {}, f"names Inductor's copy of {name} cannot resolve: {report[name]}"


@pytest.mark.parametrize("name", NAMES)
def test_inductor_source_of_the_kernel_holds_no_backslash(report, name):
    """torch 2.11 splices that source into a ``'''``-string unescaped (pytorch/pytorch#183420, fixed in later
    releases): an escape such as the ``\\n`` of a multi-line string constant's repr turns into a real newline,
    and the kernel's module fails to import with ``SyntaxError`` -- on the GPU box, in every compiled graph."""
    assert report[name] != "not found", f"{name}: no such kernel in dsv4_ops.lowering.triton"
    assert report[name]["backslash_lines"] == [], f"{name}'s Inductor source: {report[name]['backslash_lines']}"


if __name__ == "__main__":
    _worker()
