"""tools/ncu_summary.py on a hand-written Nsight Compute SASS export: the phases split at
the hottest backward branch, the shares are of all samples, stalls are summed per reason."""
import gzip
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import ncu_summary  # noqa: E402

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
          '"stall_barrier","stall_long_sb","stall_barrier (Not Issued)"')


def _row(addr, src, samples, execs, barrier, long_sb):
    return f'"{addr}","      {src}","{samples}","{execs}","{barrier}","{long_sb}","0"'


def _export(tmp_path):
    attn = [_row("0x100", "LDG.E R2, desc[UR4][R4.64]", 10, 1, 0, 10),
            _row("0x110", "HGMMA.64x16x16.F32.BF16 R8, gdesc[UR8], R8", 30, 8, 30, 0),
            _row("0x120", "@P0 BRA 0x110", 20, 8, 5, 15),
            _row("0x130", "STG.E desc[UR4][R6.64], R8", 40, 1, 0, 40)]
    topk = [_row("0x200", "VOTE.ANY R1, PT, P0", 5, 4, 0, 5)]
    text = ('"Kernel Name","attention",\n' + HEADER + "\n" + "\n".join(attn) + "\n"
            + '"Kernel Name","topk",\n' + HEADER + "\n" + "\n".join(topk) + "\n")
    path = tmp_path / "sass.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write(text)
    return str(path)


def test_kernels_are_split_by_name(tmp_path):
    found = ncu_summary.kernels(_export(tmp_path))
    assert list(found) == ["attention", "topk"]
    assert [len(rows) for rows in found.values()] == [4, 1]


def test_phases_split_at_the_hot_loop_and_stalls_are_summed(tmp_path):
    rows = ncu_summary.kernels(_export(tmp_path))["attention"]
    text = ncu_summary.summarize("attention", rows, top=2)
    # loop = [0x110, 0x120] (the branch back to 0x110): 50 of 100 samples
    assert "prologue 10.0%, main loop 50.0%, epilogue 40.0%" in text
    assert "long_sb 65.0%" in text and "barrier 35.0%" in text
    assert "HGMMA 30.0%" in text
    top = text.splitlines()[4:]
    assert top[0].split()[0] == "40.0%" and "STG.E" in top[0] and top[0].endswith("long_sb")
    assert len(top) == 2


def test_straight_line_code_has_no_loop_phase(tmp_path):
    rows = ncu_summary.kernels(_export(tmp_path))["topk"]
    assert "no backward branch" in ncu_summary.summarize("topk", rows, top=1)
