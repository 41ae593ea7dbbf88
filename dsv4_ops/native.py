"""The package's native library, ``dsv4_ops/_C*.so``: C++ ops registered with torch's dispatcher.

setup.py builds it from ``csrc/kernels`` where the installing torch is a CUDA build and nvcc is
found (an editable install puts it next to this file). Importing dsv4_ops loads it with
``torch.ops.load_library``, which registers ``dsv4::topk_rows_cuda`` (schema and CUDA kernel in
C++; its fake kernel is ``dsv4_ops/ops/topk_cuda.py``'s). Where it is absent or does not load,
:func:`library_path` is None and :func:`unavailable_reason` says why; nothing is logged, and the
ops keep their Triton kernels.

The same file serves the C++ runner of exported packages (``build/dsv4_run --library PATH``):
it links no libtorch_python. ``python -c "import dsv4_ops.native as n; print(n.library_path())"``
prints its path.
"""
from __future__ import annotations

import importlib.machinery
from pathlib import Path
from typing import Sequence

import torch

HERE = Path(__file__).resolve().parent
BUILD_ERROR = HERE / "_C.build-error"  # written by setup.py when the build failed


def candidates(folder: Path = HERE) -> list[Path]:
    """Where the library may be: ``_C`` with each extension-module suffix of this Python, in its order."""
    return [folder / f"_C{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]


def load(paths: Sequence[Path], torch_cuda: str | None, build_error: Path | None = None) -> tuple[Path | None, str | None]:
    """Load the first of ``paths`` that exists; ``(path, None)``, or ``(None, why not)``. Never raises."""
    found = next((p for p in paths if p.is_file()), None)
    if found is None:
        why = (f"dsv4_ops was installed without its native library (no {paths[0].parent / '_C*.so'}: setup.py builds "
               "it where the installing torch is a CUDA build and nvcc is found, unless DSV4_USE_CPP=0)")
        if build_error is not None and build_error.is_file():
            lines = build_error.read_text(errors="replace").strip().splitlines()
            why = f"the native library failed to build ({lines[0][:500] if lines else 'no message'}; {build_error})"
        return None, why
    if torch_cuda is None:
        return None, f"torch {torch.__version__} is not a CUDA build: {found.name} not loaded"
    try:
        torch.ops.load_library(str(found))
    except (OSError, RuntimeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return None, f"{found} did not load ({first})"
    return found, None


_path, _reason = load(candidates(), torch.version.cuda, BUILD_ERROR)


def library_path() -> str | None:
    """The loaded native library's path, or None."""
    return str(_path) if _path is not None else None


def unavailable_reason() -> str | None:
    """Why the native library is not loaded (None when it is)."""
    return _reason
