"""A/B of the bf16 warp-specialised Gluon attention against other versions of its module, in one process.

    git show REV:lowering/gluon/sparse_attention_ws.py > old_ws.py      # on the checkout, before the device call
    PYTHONPATH=$PWD python3 benchmarks/ws_ab.py old_ws.py [other.py ...] # on the GPU box

Each file is imported as ``lowering.gluon.sparse_attention_ws_<stem>`` (its relative imports resolve
against today's ``lowering.gluon.sparse_attention``, so it must still find the helpers it names) and
swapped in for ``lowering.gluon.sparse_attention_ws`` around each launch; ``sparse_attention_gluon``
is called directly (``variant="ws"``). The files must be in the tree (untracked is fine) to reach the
GPU box, with distinct names, and the run belongs under ``timeout``: a candidate whose partitions
deadlock hangs it (session 23); ``benchmarks/ws_swap_plugin.py`` runs the sm_90 tests against a
candidate. A candidate may name its own ``BLOCKS`` (rows, stages) and ``NUM_WARPS`` (``gluon_config``
reads both). Cases: the per-kernel benchmark's V4-Flash inputs (``benchmarks/kernel_bench/cases.py``) for HCA and CSA at B = 64, 128. Each is timed by
``benchmarks/timing.kernel_time`` (CUDA graphs, L2-cold input copies) three times per version,
alternating, and each file's output is compared with today's (max abs difference: 0 when only the
schedule changed). One line a case: ``... new <best> us [...] <stem> <best> us [...] ... max|new-<stem>| ...``.

    PYTHONPATH=$PWD python3 benchmarks/ws_ab.py --fp8 Q_REG_COLS=128,HELPER_REGS=168 [...]

The FP8 reader (``sparse_attention_fp8_ws.py``) the same way, on FP8 caches (``cache="fp8"``), its versions being
settings of that module's constants (the launcher passes them to the kernel, so each is its own compilation), or of
its shared-memory rings, ``NUM_STAGES`` (byte blocks) and ``E_BUFS`` (decoded blocks), the launcher's default config.

    PYTHONPATH=$PWD python3 benchmarks/ws_ab.py --combine 32,128,4 [...]

The bf16 op with ``combine_kernel``'s launch (``sparse_attention.COMBINE_TILE`` heads x columns, ``COMBINE_WARPS``)
set to each ``HEADS,COLUMNS,WARPS``; it runs at two splits or more (the B=64 cases).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import lowering.gluon as gluon_pkg  # noqa: E402
import lowering.gluon.sparse_attention_ws as new  # noqa: E402
from benchmarks.kernel_bench import cases as C  # noqa: E402
from benchmarks.timing import kernel_time, l2_bytes, rotation_copies  # noqa: E402
from lowering.gluon import sparse_attention as ga  # noqa: E402
from lowering.gluon import sparse_attention_fp8 as fp8_reader  # noqa: E402
from lowering.gluon import sparse_attention_fp8_ws as fp8_ws  # noqa: E402
from lowering.gluon.sparse_attention_fp8 import sparse_attention_gluon_fp8  # noqa: E402

CASES = [("hca", 128, 32768), ("hca", 128, 131072), ("hca", 64, 131072), ("csa", 64, 32768), ("csa", 128, 32768)]
REPEATS = 3


def load_old(path: str):
    spec = importlib.util.spec_from_file_location(f"lowering.gluon.sparse_attention_ws_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def use_module(module) -> None:
    """The module ``gluon_config`` imports for ``variant="ws"``."""
    sys.modules["lowering.gluon.sparse_attention_ws"] = module
    gluon_pkg.sparse_attention_ws = module


# --fp8 names that are the launcher's default config for variant ws (``sparse_attention_fp8.VARIANTS["ws"]``: byte
# blocks and decoded blocks in shared memory), not constants of the kernel's module
FP8_RINGS = {"NUM_STAGES": 1, "E_BUFS": 2}


def fp8_setting(spec: str) -> dict:
    """``NAME=int,...`` -> constants of ``sparse_attention_fp8_ws`` (or ``FP8_RINGS``); ValueError naming a bad one."""
    setting = {}
    for item in spec.split(","):
        name, _, value = item.partition("=")
        if not (hasattr(fp8_ws, name) or name in FP8_RINGS) or not value.lstrip("-").isdigit():
            raise ValueError(f"ws_ab --fp8: {item!r} is not NAME=int for a constant of sparse_attention_fp8_ws "
                             f"or one of {sorted(FP8_RINGS)}")
        setting[name] = int(value)
    return setting


def ws_op(*args):
    """The bf16 reader, variant ws, through its launcher (the module ``gluon_config`` finds, the combine it builds)."""
    return ga.sparse_attention_gluon(*args, variant="ws")


def fp8_value(name: str) -> int:
    """Today's value of an ``fp8_setting`` name."""
    return fp8_reader.VARIANTS["ws"][FP8_RINGS[name]] if name in FP8_RINGS else getattr(fp8_ws, name)


def combine_setting(spec: str) -> tuple:
    """``HEADS,COLUMNS,WARPS`` -> ``(COMBINE_TILE, COMBINE_WARPS)``; ValueError unless each is a power of two that
    divides H = 64 / D = 512 (warps: 1-16)."""
    parts = spec.split(",")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 and int(p) & (int(p) - 1) == 0 for p in parts):
        raise ValueError(f"ws_ab --combine: {spec!r} is not HEADS,COLUMNS,WARPS (powers of two)")
    heads, columns, warps = map(int, parts)
    if heads > ga.BLOCK_H or columns > ga.HEAD_DIM or warps > 16:
        raise ValueError(f"ws_ab --combine: {spec!r}: heads <= {ga.BLOCK_H}, columns <= {ga.HEAD_DIM}, warps <= 16")
    return (heads, columns), warps


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    fp8 = bool(args) and args[0] == "--fp8"
    combine = bool(args) and args[0] == "--combine"
    args = args[1:] if fp8 or combine else args
    if not args:
        print(__doc__)
        return 2
    if not torch.cuda.is_available():
        print("ws_ab: needs a CUDA GPU", file=sys.stderr)
        return 2
    if fp8:
        today = {name: fp8_value(name) for spec in args for name in fp8_setting(spec)}
        versions = (("new", today),) + tuple((spec, fp8_setting(spec)) for spec in args)
        op = sparse_attention_gluon_fp8

        def use(setting):
            for name, value in setting.items():
                if name in FP8_RINGS:
                    rings = list(fp8_reader.VARIANTS["ws"])
                    rings[FP8_RINGS[name]] = value
                    fp8_reader.VARIANTS["ws"] = tuple(rings)
                else:
                    setattr(fp8_ws, name, value)
    elif combine:
        versions = (("new", (ga.COMBINE_TILE, ga.COMBINE_WARPS)),) + tuple((spec, combine_setting(spec)) for spec in args)

        def use(setting):
            ga.COMBINE_TILE, ga.COMBINE_WARPS = setting

        op = ws_op
    else:
        stems = [Path(path).stem for path in args]
        if len(set(stems)) != len(stems) or "new" in stems:
            print(f"ws_ab: the module files need distinct names other than 'new', got {stems}", file=sys.stderr)
            return 2
        versions = (("new", new),) + tuple((Path(path).stem, load_old(path)) for path in args)
        use = use_module
        op = ws_op
    dev = torch.device("cuda")
    for kind, B, ctx in [c for c in CASES if c[1] == 64] if combine else CASES:  # (B=128: one split, no combine)
        case = C.sparse_attention_case(C.FLASH, kind, B, ctx, "flash", cache="fp8" if fp8 else "bf16")
        first = case.make(dev)
        size = sum(t.numel() * t.element_size() for t in first if isinstance(t, torch.Tensor))
        copies = [first] + [case.make(dev) for _ in range(rotation_copies(size // 2, size, l2_bytes(dev), 20 * 2**30) - 1)]
        times, outs = {name: [] for name, _ in versions}, {}
        for _ in range(REPEATS):
            for name, module in versions:
                use(module)
                outs[name] = op(*first)
                calls = [lambda a=a: op(*a) for a in copies]
                times[name].append(kernel_time(calls, dev, 30.0).us)
        use(versions[0][1])
        diffs = "  ".join(f"max|new-{name}| {(outs['new'].float() - outs[name].float()).abs().max().item():.3g}"
                          for name, _ in versions[1:])
        print(f"{kind} B={B} ctx={ctx}: " + "  ".join(f"{n} {min(t):.2f} us {[round(x, 2) for x in t]}"
                                                     for n, t in times.items()) + "  " + diffs, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
