"""How the package is put together (DESIGN.md §3, rule 6).

Specification:
* no import cycle among the package's modules, counting imports inside functions;
* data flows one way: model / generator -> ops (the contract) -> lowering (the kernels); the kernels and the
  reference never import the ops or their callers, the model never picks a kernel;
* no module imports a private name (``_x``) from another package of ours;
* the kernels' package has one module identity, ``dsv4_ops.lowering``;
* importing dsv4_ops changes nothing in torch (no patched classes, no raised dynamo limits), and importing every
  kernel module under ``TRITON_INTERPRET=1`` nothing in Triton (the interpreter's numpy fix is conftest's, tests only);
* the shipped code carries no lab notes (``DIAG_`` switches, "session N" history);
* every module under ``tests/`` has a name of its own (pytest imports test files and helpers by their basename,
  from folders without ``__init__.py``), conftest.py aside.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ((ROOT / "dsv4_ops", "dsv4_ops"), (ROOT / "lowering", "dsv4_ops.lowering"))


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package's __init__), with lowering/ under its installed name."""
    mods = {}
    for base, prefix in PACKAGES:
        for f in base.rglob("*.py"):
            parts = [p for p in f.relative_to(base).with_suffix("").parts if p != "__init__"]
            mods[".".join([prefix, *parts])] = (f, f.name == "__init__.py")
    return mods


def _imports(mods) -> dict[str, set[tuple[str, str, int]]]:
    """Module -> {(imported module, imported name or "", line)}: every import of the package's own modules,
    at module level and inside functions; ``from pkg import sub`` counts as an import of ``pkg.sub``."""
    out = {}
    for mod, (f, is_pkg) in mods.items():
        pkg = mod if is_pkg else mod.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                for alias in node.names:
                    sub = f"{src}.{alias.name}"
                    found.add((sub, "", node.lineno) if sub in mods else (src, alias.name, node.lineno))
            elif isinstance(node, ast.Import):
                found.update((alias.name, "", node.lineno) for alias in node.names)
        out[mod] = {(m, n, line) for m, n, line in found if m in mods and m != mod}
    return out


MODS = _modules()
IMPORTS = _imports(MODS)


def test_no_import_cycles():
    graph = {m: {t for t, _, _ in deps} for m, deps in IMPORTS.items()}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while not comp or v not in comp:
                comp.add(stack.pop())
            on_stack.difference_update(comp)
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def _layer(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


# what each layer may import of the package (besides itself); ``native`` loads the C++ ops' library
ALLOWED = {
    "lowering": {"lowering", "reference"},
    "reference": {"reference"},
    "ops": {"ops", "lowering", "reference", "native"},
}


def test_data_flows_one_way():
    wrong = []
    for mod, deps in IMPORTS.items():
        allowed = ALLOWED.get(_layer(mod))
        for target, _, line in deps:
            if allowed is not None and _layer(target) not in allowed:
                wrong.append(f"{mod}:{line} imports {target}")
            if _layer(mod) == "model" and _layer(target) == "lowering":
                wrong.append(f"{mod}:{line} imports {target}: the model calls ops, the ops pick the kernels")
    assert not wrong, wrong


def test_no_private_names_imported_across_packages():
    wrong = []
    for mod, deps in IMPORTS.items():
        pkg = mod if MODS[mod][1] else mod.rsplit(".", 1)[0]
        for target, name, line in deps:
            tpkg = target if MODS[target][1] else target.rsplit(".", 1)[0]
            private = name.startswith("_") or target.rsplit(".", 1)[-1].startswith("_")
            if private and tpkg != pkg:
                wrong.append(f"{mod}:{line} imports {target}{'.' + name if name else ''}")
    assert not wrong, wrong


def test_the_kernels_package_has_one_module_identity():
    res = subprocess.run([sys.executable, "-c", "import dsv4_ops, lowering"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode != 0 and "import it under that name" in res.stderr, res.stderr[-2000:]
    res = subprocess.run([sys.executable, "-c", "import dsv4_ops.lowering.triton.plan as p; print(p.__name__)"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.stdout.strip() == "dsv4_ops.lowering.triton.plan", res.stderr[-2000:]


def test_importing_dsv4_ops_changes_nothing_in_torch():
    probe = """
import torch, torch._dynamo
from torch._inductor import cudagraph_trees as ct
before = (ct.CUDAGraphNode.run, torch._dynamo.config.recompile_limit, torch._dynamo.config.cache_size_limit)
import dsv4_ops
gen = dsv4_ops.Generator(dsv4_ops.DeepseekV4ForCausalLM(dsv4_ops.DSV4Config.tiny()), max_batch_size=1,
                         max_seq_len=32, compile=True)
after = (ct.CUDAGraphNode.run, torch._dynamo.config.recompile_limit, torch._dynamo.config.cache_size_limit)
print(before == after)
"""
    res = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.stdout.strip() == "True", res.stdout + res.stderr[-2000:]


def test_importing_the_kernels_leaves_the_interpreter_alone():
    """The numpy-2.4 fix of Triton's interpreter is a test-only patch (conftest.py): importing
    the package and every kernel module under ``TRITON_INTERPRET=1`` modifies nothing in Triton."""
    code = ("import triton.runtime.interpreter as i; before = i._patch_lang_tensor\n"
            "import dsv4_ops, importlib\n"
            "for m in ('sparse_attention', 'indexer', 'plan', 'cache_write', 'compress', 'sinkhorn'):\n"
            "    importlib.import_module('dsv4_ops.lowering.triton.' + m)\n"
            "assert i._patch_lang_tensor is before and not hasattr(i, '_dsv4_index_fix')\n")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_shipped_code_carries_no_lab_notes():
    pattern = re.compile(r"DIAG_|[Ss]ession [0-9]")
    hits = []
    for folder in ("dsv4_ops", "lowering", "csrc"):
        for f in sorted((ROOT / folder).rglob("*")):
            if f.suffix in (".py", ".cu", ".cpp", ".h", ".cuh", ".md", ".txt", ".sh") and f.is_file():
                for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
                    if pattern.search(line):
                        hits.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not hits, hits


def test_every_test_module_name_is_unique():
    names = {}
    for f in sorted((ROOT / "tests").rglob("*.py")):
        if f.name != "conftest.py" and "fake_flashmla" not in f.parts:
            names.setdefault(f.stem, []).append(str(f.relative_to(ROOT)))
    assert not {n: fs for n, fs in names.items() if len(fs) > 1}
