"""Build the dsv4_ops package (DESIGN.md §3); the top-level `lowering/` (backend kernels)
installs as `dsv4_ops.lowering` via package_dir.

Where the installing torch is a CUDA build and nvcc is found, the package also gets its native
library `dsv4_ops._C` (csrc/kernels: the C++ op `dsv4::topk_rows_cuda`), built with
torch.utils.cpp_extension and loaded at import by `torch.ops.load_library` (dsv4_ops/native.py);
an editable install (`pip install -e .`) builds it in place, next to `dsv4_ops/__init__.py`.
It links no libtorch_python (py_limited_api), so the C++ runner (csrc/runner) can dlopen it too.
Elsewhere (a CPU or ROCm torch, no nvcc) the install is pure Python and the Triton kernels serve.

`DSV4_USE_CPP`: unset = build when possible, and a failed build leaves a pure-Python install
(its error in dsv4_ops/_C.build-error, which the import reports); `0` = never build; `1` = build or
fail. `TORCH_CUDA_ARCH_LIST` picks the GPU architectures; unset, the visible GPUs' (else 9.0).
"""
from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Mapping, Sequence

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
KERNELS = os.path.join("csrc", "kernels")
NATIVE_SOURCES = [os.path.join(KERNELS, "topk_rows_op.cpp"), os.path.join(KERNELS, "topk_rows.cu")]
NATIVE_HEADERS = [os.path.join(KERNELS, "topk_rows.h")]
BUILD_ERROR = os.path.join("dsv4_ops", "_C.build-error")  # read by dsv4_ops/native.py
DEFAULT_ARCH = "9.0"  # the H100 / H200
ENV = "DSV4_USE_CPP"


def native_build(torch_cuda: str | None, nvcc: str | None, env: Mapping[str, str]) -> tuple[bool, str]:
    """Whether to build ``dsv4_ops._C``, and why (a pure function of the installing torch's CUDA
    version, the nvcc found and the environment). ``DSV4_USE_CPP=1`` where it cannot be built
    is a RuntimeError."""
    choice = env.get(ENV, "").strip()
    if choice not in ("", "0", "1"):
        raise ValueError(f"{ENV}={choice!r}: must be 0 (never build the native library), 1 (always) or unset")
    if choice == "0":
        return False, f"{ENV}=0"
    if torch_cuda is None:
        why = "the installing torch is not a CUDA build"
    elif nvcc is None:
        why = "nvcc not found (set CUDA_HOME)"
    else:
        return True, f"torch CUDA {torch_cuda}, {nvcc}"
    if choice == "1":
        raise RuntimeError(f"{ENV}=1 but {why}")
    return False, why


def cuda_arch_list(env_value: str | None, capabilities: Sequence[tuple[int, int]]) -> str:
    """``TORCH_CUDA_ARCH_LIST`` for the build: the given one, else the visible GPUs' compute
    capabilities (each once, ascending), else ``DEFAULT_ARCH``. Set explicitly, so that torch never
    builds for every architecture it knows."""
    if env_value and env_value.strip():
        return env_value.strip()
    archs = sorted(set(capabilities))
    return ";".join(f"{major}.{minor}" for major, minor in archs) if archs else DEFAULT_ARCH


def find_nvcc(cuda_home: str | None) -> str | None:
    """``cuda_home/bin/nvcc`` when it is there and executable, else None."""
    if not cuda_home:
        return None
    path = os.path.join(cuda_home, "bin", "nvcc")
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def find_cuda_home(env: Mapping[str, str], nvcc_on_path: str | None) -> str | None:
    """The CUDA toolkit to build with: the first of ``$CUDA_HOME``, ``$CUDA_PATH``, the toolkit of
    the nvcc on PATH (through symlinks) and ``/usr/local/cuda`` that holds ``bin/nvcc`` and
    ``include/cuda_runtime.h`` (torch would take the parent of PATH's nvcc as is: a wrapper script
    in /usr/local/bin would make it /usr/local, which has no CUDA headers)."""
    candidates = [env.get("CUDA_HOME"), env.get("CUDA_PATH")]
    if nvcc_on_path:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc_on_path))))
    candidates.append("/usr/local/cuda")
    for home in candidates:
        if home and find_nvcc(home) and os.path.isfile(os.path.join(home, "include", "cuda_runtime.h")):
            return home
    return None


def _visible_capabilities(torch) -> list[tuple[int, int]]:
    try:
        if not torch.cuda.is_available():
            return []
        return [tuple(torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001  (no driver, no device: the default architecture)
        return []


def _native_extension():
    """(ext_modules, cmdclass) for the native library, or ([], {}) for a pure-Python install."""
    cuda_home = find_cuda_home(os.environ, shutil.which("nvcc"))
    if cuda_home is not None:
        os.environ["CUDA_HOME"] = cuda_home  # before torch.utils.cpp_extension reads it
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:  # no torch in the build environment (build isolation): pure Python
        print("[dsv4_ops] not building the native library: torch is not importable at build time")
        return [], {}
    build, why = native_build(torch.version.cuda, find_nvcc(cuda_home), os.environ)
    if not build:
        print(f"[dsv4_ops] not building the native library: {why}")
        return [], {}
    cpp_extension.CUDA_HOME = cuda_home  # (in case torch imported it before: the toolkit found above)
    arch = cuda_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST"), _visible_capabilities(torch))
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch  # what BuildExtension turns into -gencode flags
    print(f"[dsv4_ops] building the native library dsv4_ops._C ({why}; TORCH_CUDA_ARCH_LIST={arch})")
    required = os.environ.get(ENV, "").strip() == "1"
    torch_lib = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "lib")
    ext = cpp_extension.CUDAExtension(
        name="dsv4_ops._C",
        sources=NATIVE_SOURCES,
        depends=NATIVE_HEADERS,
        include_dirs=[os.path.join(HERE, KERNELS)],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]},
        # the runner dlopens the library beside its own libtorch; a Python process has torch loaded
        extra_link_args=[f"-Wl,-rpath,{torch_lib}"],
        py_limited_api=True,  # no libtorch_python: loadable without Python (the C++ runner)
    )

    class BuildNative(cpp_extension.BuildExtension):
        """BuildExtension that, unless ``DSV4_USE_CPP=1``, turns a failed build into a pure-Python
        install (no library left from an earlier build) and records why in ``dsv4_ops/_C.build-error``."""

        def run(self):
            error = os.path.join(HERE, BUILD_ERROR)
            try:
                super().run()
            except Exception as e:  # noqa: BLE001  (nvcc / ninja / the linker, in whatever form)
                if required:
                    raise
                for stale in glob.glob(os.path.join(HERE, "dsv4_ops", "_C*.so")):  # an earlier build's
                    os.unlink(stale)
                with open(error, "w") as f:
                    f.write(f"{type(e).__name__}: {e}\n(the compiler's output: DSV4_USE_CPP=1 pip install -v --no-deps "
                            "--no-build-isolation -e .)\n")
                print(f"[dsv4_ops] WARNING: the native library did not build ({type(e).__name__}: {e}); "
                      "installing without it (the Triton top-k serves)")
                return
            if os.path.exists(error):
                os.unlink(error)

    return [ext], {"build_ext": BuildNative}


if __name__ == "__main__":
    ext_modules, cmdclass = _native_extension()
    setup(
        name="dsv4_ops",
        version="0.1.0",
        description="torch.compile-native operators and runtime for DeepSeek-V4 attention",
        packages=find_packages(include=["dsv4_ops", "dsv4_ops.*"]) + ["dsv4_ops.lowering", "dsv4_ops.lowering.triton",
                                                                     "dsv4_ops.lowering.gluon", "dsv4_ops.lowering.aten"],
        package_dir={"dsv4_ops.lowering": "lowering"},
        package_data={"dsv4_ops": ["assets/tiny/*"]},  # the bundled trained model (dsv4_ops.pretrained.tiny())
        python_requires=">=3.10",
        install_requires=["torch>=2.11", "triton>=3.6", "tokenizers", "safetensors"],
        ext_modules=ext_modules,
        cmdclass=cmdclass,
    )
