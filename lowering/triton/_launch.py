"""The one place kernels are launched from, so a ``triton_op`` can route launches
through ``torch.library.wrap_triton`` (Inductor then sees and schedules the kernel)."""
from __future__ import annotations

import torch


def launch(kernel, grid, *args, wrap: bool = False, **meta) -> None:
    """``kernel[grid](*args, **meta)``, or the same through ``torch.library.wrap_triton``."""
    if wrap:
        torch.library.wrap_triton(kernel)[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a GPU device (static: read from the device properties, not
    from data); 132 (H100/H200) on a device without properties, e.g. the interpreter."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def backend() -> str:
    """``"hip"`` on a ROCm build of torch, else ``"cuda"`` (static, decided by the build)."""
    return "hip" if torch.version.hip else "cuda"


def _fix_interpreter_numpy24() -> None:
    """Let ``TRITON_INTERPRET=1`` run loops with runtime bounds under numpy >= 2.4.

    Triton 3.6's interpreter converts a scalar to a Python int with ``int(ndarray)``,
    which numpy 2.4 rejects for the shape-(1,) arrays it uses for scalars
    (triton-lang/triton#9171, fixed upstream with ``.squeeze()``). We apply the same fix
    on top of the interpreter's per-launch patching; a no-op when not interpreting or
    when the interpreter layout differs.
    """
    try:
        import numpy as np
        import triton
        from triton.runtime import interpreter
    except ImportError:
        return
    if not triton.knobs.runtime.interpret or getattr(interpreter, "_dsv4_index_fix", False):
        return
    if tuple(int(x) for x in np.__version__.split(".")[:2]) < (2, 4):
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor
    interpreter._dsv4_index_fix = True


_fix_interpreter_numpy24()
