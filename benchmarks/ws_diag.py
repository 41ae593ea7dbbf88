"""Where the bf16 warp-specialised attention spends its time: today's kernel timed against copies of itself with
one part left out (results are wrong; only the times mean something).

    PYTHONPATH=$PWD python3 benchmarks/ws_diag.py [--out DIR]     # on the GPU box

Each variant is today's ``lowering/gluon/sparse_attention_ws.py`` with an exact piece of its text replaced
(``DIAGS``; a piece that is no longer there stops the script, so the variants cannot silently drift from the
kernel), written to ``DIR`` and timed by ``benchmarks/ws_ab.py`` against today's kernel, alternating, same cases:

- ``nocopy``: the producer's row copies all masked (zero-fill, no HBM read); index loads, issue and publishing stay.
- ``nocompute``: nothing is computed: the scorer frees each block as soon as it has landed (its index loads stay),
  the helper takes no block.
- ``neither``: both of the above: what is left is the launch, q, the index loads, the partitions' handshakes
  and the epilogue.
- ``noblocks``: no block at all in either partition: launch, q and the epilogue.
- ``noblocks_noq``, ``noblocks_noout``, ``noblocks_neither``: that, and q not read (zeros staged), or no epilogue
  (neither the output nor the split's partials stored), or both: the fixed cost taken apart.

``--consumer --kernel ws23.py``: session 23's 8-warp consumer loop (``git show d3234e6:lowering/gluon/
sparse_attention_ws.py > ws23.py``) taken apart instead (``CONSUMER_DIAGS``), each variant on top of its ``nocopy``:
the scores over half or a quarter of D (16 or 8 dependent wgmmas instead of 32), no P @ rows, no P store (nor its
fence and second barrier), no first barrier (the row maxima read unwaited).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL = ROOT / "lowering/gluon/sparse_attention_ws.py"

# today's kernel (session 24: scorer, helper and producer partitions)
_COPY = "        valid = _valid(v, idx, hi, W, N_KV, N_CMP)\n"
_NO_COPY = "        valid = _valid(v, idx, hi, W, N_KV, N_CMP) & (v < 0)  # diag: every copy masked (zero-fill)\n"
_SCORER_LOOP_END = "    acc = warpgroup_mma_wait(0, deps=[acc])\n    ml_smem.index(0).store(m_i)"
_NO_COMPUTE_LOOP = '''    for j in range(n_blocks):  # diag: no compute, each block freed once it has landed
        slot = j % NUM_STAGES
        bias = gl.where(_valid(v, _pick_entry_index(v, loaded, W, K), hi, W, N_KV, N_CMP), 0.0, float("-inf"))
        v = v + BLOCK_N
        loaded = _load_entry_index(v, W, K, widx_row, swi_w, cidx_row, sci_k)
        mbarrier.wait(full.index(slot), (j // NUM_STAGES) & 1)
        l_i = l_i + gl.sum(gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_l) + bias[None, :], 1)
        gl.thread_barrier()
        mbarrier.arrive(empty.index(slot))
'''
_RANGE = "    lo, hi, n_blocks = _split_range(cmp_len_row, N_CMP, W, K, pid_sp, NUM_SPLITS, BLOCK_N)\n"
_NO_BLOCKS = _RANGE + "    n_blocks = n_blocks * 0  # diag: no blocks\n"
_EMPTY_COUNT = "        mbarrier.init(empty.index(st), count=2)\n"


def _no_copy(text: str) -> str:
    return _replace(text, _COPY, _NO_COPY, 1)


def _no_compute(text: str) -> str:
    """The scorer frees each block as soon as it has landed (one arrival: ``empty`` counts one); the helper takes
    no block."""
    start = text.find("    for j in range(n_blocks):", text.find("def _scorer"))
    end = text.find(_SCORER_LOOP_END)
    helper = text.find("def _helper")
    if start < 0 or end < start or helper < end:
        raise SystemExit(f"ws_diag: the scorer's loop in {KERNEL} no longer reads as this script expects")
    helper_range = text.find(_RANGE, helper)
    text = (text[:start] + _NO_COMPUTE_LOOP + text[end:helper_range] + _NO_BLOCKS
            + text[helper_range + len(_RANGE):])
    return _replace(text, _EMPTY_COUNT, _EMPTY_COUNT.replace("count=2)", "count=1)  # diag: the scorer alone"), 1)


def _no_blocks(text: str) -> str:
    return _replace(text, _RANGE, _NO_BLOCKS, 3)


def _replace(text: str, old: str, new: str, count: int) -> str:
    if text.count(old) != count:
        raise SystemExit(f"ws_diag: expected {count} of {old!r} in {KERNEL}, found {text.count(old)}")
    return text.replace(old, new)


_Q_LOAD = "    q_smem.store(gl.load(q_row + offs_hq[:, None] * sq_h + offs_dq[None, :]))\n"
_NO_Q_LOAD = "    q_smem.store(gl.zeros([BLOCK_H, D], gl.bfloat16, q_l))  # diag: q not read\n"
_EPILOGUE = "    _epilogue(acc, "
_NO_EPILOGUE = "    if pid_t < 0:  # diag: no epilogue (never true)\n        _epilogue(acc, "


def _no_q(text: str) -> str:
    return _replace(text, _Q_LOAD, _NO_Q_LOAD, 1)


def _no_out(text: str) -> str:
    return _replace(text, _EPILOGUE, _NO_EPILOGUE, 2)


DIAGS = {"nocopy": _no_copy, "nocompute": _no_compute, "neither": lambda t: _no_copy(_no_compute(t)),
         "noblocks": _no_blocks, "noblocks_noq": lambda t: _no_q(_no_blocks(t)),
         "noblocks_noout": lambda t: _no_out(_no_blocks(t)), "noblocks_neither": lambda t: _no_out(_no_q(_no_blocks(t)))}

# the 8-warp consumer loop of the session-23 kernel (d3234e6) taken apart (``--consumer --kernel FILE``), each on
# top of its ``nocopy`` so that the loop sets the time: what showed the scores' shared-memory operands to be the cost
_COPY_23 = "cp.async_copy_global_to_shared(ring.index(slot), row[:, None] + offs_d[None, :], mask=valid[:, None])"
_NO_COPY_23 = ("cp.async_copy_global_to_shared(ring.index(slot), row[:, None] + offs_d[None, :], "
               "mask=(valid & (v < 0))[:, None])")
_SCORES = "s = warpgroup_mma(q_smem, e.permute((1, 0)), s_zero, use_acc=False, is_async=True)"
_PV = "acc = warpgroup_mma(p_smem, e, acc, is_async=True)"
_P_STORE = "        p_smem.store(p.to(gl.bfloat16))\n        fence_async_shared()  # P visible to wgmma\n        gl.thread_barrier()  # B2\n"
_B1 = "        gl.thread_barrier()  # B1: maxima stored; both warpgroups done with block j - 1 and P\n"


def _no_copy_23(text: str) -> str:
    return _replace(text, _COPY_23, _NO_COPY_23, 1)


def _scores_over(fraction: int):
    """The scores over the first ``D / fraction`` dims only: ``32 / fraction`` dependent wgmmas a block."""
    part = (f"s = warpgroup_mma(q_smem.slice(0, D // {fraction}, dim=1), "
            f"e.slice(0, D // {fraction}, dim=1).permute((1, 0)), s_zero, use_acc=False, is_async=True)")
    return lambda text: _replace(_no_copy_23(text), _SCORES, part, 1)


def _no_pv(text: str) -> str:
    return _replace(_no_copy_23(text), _PV, "acc = warpgroup_mma_init(acc)  # diag: no P @ rows", 1)


def _no_p_store(text: str) -> str:
    """P is neither stored nor fenced and the second barrier goes; P @ rows reads whatever P buffer holds."""
    return _replace(_no_copy_23(text), _P_STORE, "", 1)


def _no_b1(text: str) -> str:
    """The first barrier goes: each warpgroup reads the other's maxima without waiting for them (the slot of
    block j - 1 may be freed before the other warpgroup's P @ rows has read it)."""
    return _replace(_no_copy_23(text), _B1, "", 1)


CONSUMER_DIAGS = {"nocopy": _no_copy_23, "halfscores": _scores_over(2), "quarterscores": _scores_over(4),
                  "nopv": _no_pv, "nopstore": _no_p_store, "nob1": _no_b1}


def write_variants(out: Path, diags: dict | None = None, kernel: Path | None = None) -> list[Path]:
    """One module file a diag (``DIAGS`` unless told) of ``kernel`` (today's unless told), named ``diag_<name>.py``
    (ws_ab labels each by its stem)."""
    text = (kernel or KERNEL).read_text()
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, edit in (DIAGS if diags is None else diags).items():
        path = out / f"diag_{name}.py"
        path.write_text(edit(text))
        paths.append(path)
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="where the variants are written (default: a temp dir)")
    parser.add_argument("--write-only", action="store_true", help="write the variants and stop (no GPU needed)")
    parser.add_argument("--consumer", action="store_true",
                        help="the session-23 kernel's consumer loop taken apart (CONSUMER_DIAGS; needs --kernel)")
    parser.add_argument("--kernel", type=Path, default=None, help="the kernel file the variants are made from")
    args = parser.parse_args(argv)
    if args.consumer and args.kernel is None:
        parser.error("--consumer takes the session-23 kernel: git show d3234e6:lowering/gluon/sparse_attention_ws.py"
                     " > ws23.py, then --kernel ws23.py")
    out = args.out or Path(tempfile.mkdtemp(prefix="ws_diag_"))
    paths = write_variants(out, CONSUMER_DIAGS if args.consumer else DIAGS, args.kernel)
    print("ws_diag: " + ", ".join(str(p) for p in paths), flush=True)
    if args.write_only:
        return 0
    sys.path.insert(0, str(ROOT))
    from benchmarks import ws_ab  # noqa: PLC0415 (imports torch and the kernels)

    return ws_ab.main([str(p) for p in paths])


if __name__ == "__main__":
    sys.exit(main())
