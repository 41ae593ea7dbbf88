"""Where the bf16 warp-specialised attention spends its time: today's kernel timed against copies of itself with
one part left out (results are wrong; only the times mean something).

    PYTHONPATH=$PWD python3 benchmarks/ws_diag.py [--out DIR]     # on the GPU box

Each variant is today's ``lowering/gluon/sparse_attention_ws.py`` with an exact piece of its text replaced
(``DIAGS``; a piece that is no longer there stops the script, so the variants cannot silently drift from the
kernel), written to ``DIR`` and timed by ``benchmarks/ws_ab.py`` against today's kernel, alternating, same cases:

- ``nocopy``: the producer's row copies all masked (zero-fill, no HBM read); index loads, issue and publishing stay.
- ``nocompute``: the consumers compute nothing: each block is freed as soon as it has landed (its index loads stay).
- ``neither``: both of the above: what is left is the launch, q, the index loads, the two partitions' handshakes
  and the epilogue.
- ``noblocks``: no block at all in either partition: launch, q and the epilogue.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL = ROOT / "lowering/gluon/sparse_attention_ws.py"

_COPY = "cp.async_copy_global_to_shared(ring.index(slot), row[:, None] + offs_d[None, :], mask=valid[:, None])"
_NO_COPY = "cp.async_copy_global_to_shared(ring.index(slot), row[:, None] + offs_d[None, :], mask=(valid & (v < 0))[:, None])"
_LOOP_START = "    for j in range(n_blocks):\n        slot = j % NUM_STAGES\n        e = ring.index(slot)\n"
_LOOP_END = "    acc = warpgroup_mma_wait(0, deps=[acc])\n    return acc, m_i, gl.sum(l_i, 1)"
_NO_COMPUTE_LOOP = '''    for j in range(n_blocks):  # diag: no compute, each block freed once it has landed
        slot = j % NUM_STAGES
        bias = gl.where(_valid(v, _pick_entry_index(v, loaded, W, K), hi, W, N_KV, N_CMP), 0.0, float("-inf"))
        v = v + BLOCK_N
        loaded = _load_entry_index(v, W, K, widx_row, swi_w, cidx_row, sci_k)
        mbarrier.wait(full.index(slot), (j // NUM_STAGES) & 1)
        l_i = l_i + bias[None, :]
        gl.thread_barrier()
        mbarrier.arrive(empty.index(slot))
'''
_RANGE = "    lo, hi, n_blocks = _split_range(cmp_len_row, N_CMP, W, K, pid_sp, NUM_SPLITS, BLOCK_N)\n"


def _no_copy(text: str) -> str:
    return _replace(text, _COPY, _NO_COPY, 1)


def _no_compute(text: str) -> str:
    start, end = text.find(_LOOP_START), text.find(_LOOP_END)
    if start < 0 or end < start:
        raise SystemExit(f"ws_diag: the consumer's loop in {KERNEL} no longer reads as this script expects")
    return text[:start] + _NO_COMPUTE_LOOP + text[end:]


def _no_blocks(text: str) -> str:
    return _replace(text, _RANGE, _RANGE + "    n_blocks = n_blocks * 0  # diag: no blocks\n", 2)


def _replace(text: str, old: str, new: str, count: int) -> str:
    if text.count(old) != count:
        raise SystemExit(f"ws_diag: expected {count} of {old!r} in {KERNEL}, found {text.count(old)}")
    return text.replace(old, new)


DIAGS = {"nocopy": _no_copy, "nocompute": _no_compute, "neither": lambda t: _no_copy(_no_compute(t)),
         "noblocks": _no_blocks}


def write_variants(out: Path) -> list[Path]:
    """One module file a diag, named ``diag_<name>.py`` (ws_ab labels each by its stem)."""
    text = KERNEL.read_text()
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, edit in DIAGS.items():
        path = out / f"diag_{name}.py"
        path.write_text(edit(text))
        paths.append(path)
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="where the variants are written (default: a temp dir)")
    parser.add_argument("--write-only", action="store_true", help="write the variants and stop (no GPU needed)")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="ws_diag_"))
    paths = write_variants(out)
    print("ws_diag: " + ", ".join(str(p) for p in paths), flush=True)
    if args.write_only:
        return 0
    sys.path.insert(0, str(ROOT))
    from benchmarks import ws_ab  # noqa: PLC0415 (imports torch and the kernels)

    return ws_ab.main([str(p) for p in paths])


if __name__ == "__main__":
    sys.exit(main())
