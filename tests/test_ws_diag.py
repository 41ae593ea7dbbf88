"""``benchmarks/ws_diag.py`` builds its timing variants from today's warp-specialised kernel by exact text
replacement; these tests fail when the kernel is edited so that a variant would no longer be what its name says."""
import ast

import pytest
import torch

from benchmarks import ws_diag


def test_every_diag_variant_is_built_from_todays_kernel(tmp_path):
    kernel = ws_diag.KERNEL.read_text()
    paths = ws_diag.write_variants(tmp_path)
    assert [p.stem for p in paths] == [f"diag_{name}" for name in ws_diag.DIAGS]
    for path in paths:
        text = path.read_text()
        ast.parse(text)  # still Python
        assert text != kernel, path.name


def test_each_variant_leaves_out_what_its_name_says(tmp_path):
    texts = {p.stem.removeprefix("diag_"): p.read_text() for p in ws_diag.write_variants(tmp_path)}
    assert ws_diag._NO_COPY in texts["nocopy"] and ws_diag._COPY not in texts["nocopy"]
    scorer = texts["nocompute"].split("def _scorer")[1].split("def _helper")[0]
    loop = scorer.split("for j in range(n_blocks)")[1].split("ml_smem")[0]
    assert "warpgroup_mma(" not in loop and "exp2" not in loop  # no MMA issued, no softmax
    helper = texts["nocompute"].split("def _helper")[1].split("def sparse_attention_gluon_ws_kernel")[0]
    assert "n_blocks = n_blocks * 0" in helper  # the helper takes no block, so one arrival frees a slot
    assert "mbarrier.init(empty.index(st), count=1" in texts["nocompute"]
    assert ws_diag._NO_COPY in texts["neither"] and ws_diag._NO_COMPUTE_LOOP in texts["neither"]
    assert texts["noblocks"].count("n_blocks = n_blocks * 0") == 3  # producer, scorer and helper
    for name in ("noblocks_noq", "noblocks_noout", "noblocks_neither"):  # the fixed cost taken apart
        assert texts[name].count("n_blocks = n_blocks * 0") == 3, name
    assert ws_diag._NO_Q_LOAD in texts["noblocks_noq"] and ws_diag._Q_LOAD not in texts["noblocks_noq"]
    assert ws_diag._NO_Q_LOAD in texts["noblocks_neither"] and ws_diag._NO_Q_LOAD not in texts["noblocks_noout"]
    for name in ("noblocks_noout", "noblocks_neither"):  # both warpgroups' epilogues (output or partials) gone
        assert texts[name].count("if pid_t < 0:  # diag: no epilogue") == 2, name


def test_consumer_diags_take_apart_the_session_23_kernel(tmp_path, capsys):
    """``--consumer`` edits session 23's 8-warp consumer (read from git history): each variant is its ``nocopy``
    with one more piece gone."""
    import subprocess

    old = subprocess.run(["git", "show", "d3234e6:lowering/gluon/sparse_attention_ws.py"], cwd=ws_diag.ROOT,
                         capture_output=True, text=True)
    if old.returncode != 0:
        pytest.skip(f"the session-23 kernel is not in this checkout's history: {old.stderr.strip()}")
    kernel = tmp_path / "ws23.py"
    kernel.write_text(old.stdout)
    paths = ws_diag.write_variants(tmp_path / "out", ws_diag.CONSUMER_DIAGS, kernel)
    texts = {p.stem.removeprefix("diag_"): p.read_text() for p in paths}
    assert all(ws_diag._NO_COPY_23 in t for t in texts.values())
    assert "q_smem.slice(0, D // 2, dim=1)" in texts["halfscores"]
    assert "q_smem.slice(0, D // 4, dim=1)" in texts["quarterscores"]
    assert ws_diag._PV not in texts["nopv"] and ws_diag._P_STORE not in texts["nopstore"]
    assert ws_diag._B1 not in texts["nob1"] and ws_diag._B1 in texts["nocopy"]
    with pytest.raises(SystemExit):
        ws_diag.main(["--consumer", "--write-only"])
    assert "--consumer takes the session-23 kernel" in capsys.readouterr().err


def test_a_kernel_that_moved_on_stops_the_script(tmp_path, monkeypatch):
    edited = tmp_path / "kernel.py"
    edited.write_text(ws_diag.KERNEL.read_text().replace(ws_diag._COPY, "pass"))
    monkeypatch.setattr(ws_diag, "KERNEL", edited)
    with pytest.raises(SystemExit, match="expected 1 of"):
        ws_diag.write_variants(tmp_path / "out")


def test_without_a_gpu_the_run_stops_after_writing_the_variants(tmp_path, capsys):
    """The whole tool (variants, then ``ws_ab``'s imports of the kernels and cases) runs up to the timing on any
    machine, so a broken import shows here rather than in a device call."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the tool would time for real")
    assert ws_diag.main(["--out", str(tmp_path)]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"diag_{name}.py" for name in ws_diag.DIAGS)
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_ws_ab_fp8_versions_are_settings_of_the_fp8_readers_constants():
    """``ws_ab.py --fp8 NAME=int,...``: each version sets constants of ``sparse_attention_fp8_ws`` (the launcher passes
    them to the kernel); a name that is not one of them, or a value that is not an integer, is refused by name."""
    from benchmarks import ws_ab

    assert ws_ab.fp8_setting("Q_REG_COLS=128,HELPER_REGS=168") == {"Q_REG_COLS": 128, "HELPER_REGS": 168}
    with pytest.raises(ValueError, match="'NOT_A_CONSTANT=1'"):
        ws_ab.fp8_setting("STAGED_OUT=0,NOT_A_CONSTANT=1")
    with pytest.raises(ValueError, match="'HELPER_REGS=many'"):
        ws_ab.fp8_setting("HELPER_REGS=many")
    # the rings are the launcher's config, not module constants
    from lowering.gluon import sparse_attention_fp8 as reader
    assert ws_ab.fp8_setting("NUM_STAGES=4,E_BUFS=2") == {"NUM_STAGES": 4, "E_BUFS": 2}
    assert (ws_ab.fp8_value("NUM_STAGES"), ws_ab.fp8_value("E_BUFS")) == reader.VARIANTS["ws"][1:]


def test_ws_ab_combine_versions_are_launches_of_the_combine_kernel():
    """``ws_ab.py --combine HEADS,COLUMNS,WARPS``: each version is ``combine_kernel``'s tile and warps, which both Gluon
    launchers take from ``sparse_attention.COMBINE_TILE`` / ``COMBINE_WARPS``; a tile that does not divide the
    output or is not a power of two is refused."""
    from benchmarks import ws_ab
    from lowering.gluon import sparse_attention as ga

    assert ws_ab.combine_setting("32,256,8") == ((32, 256), 8)
    for bad in ("32,256", "24,128,4", "128,128,4", "16,1024,4", "16,128,32", "a,b,c"):
        with pytest.raises(ValueError, match=repr(bad)):
            ws_ab.combine_setting(bad)
    part_acc = torch.empty(3, 2, ga.BLOCK_H, ga.HEAD_DIM)
    part_m = part_l = torch.empty(3, 2, ga.BLOCK_H)
    out = torch.empty(3, 1, ga.BLOCK_H, ga.HEAD_DIM, dtype=torch.bfloat16)
    saved = ga.COMBINE_TILE, ga.COMBINE_WARPS
    try:
        ga.COMBINE_TILE, ga.COMBINE_WARPS = (32, 256), 8
        _, grid, _, meta = ga.combine_launch(part_m, part_l, part_acc, torch.empty(ga.BLOCK_H), out)
    finally:
        ga.COMBINE_TILE, ga.COMBINE_WARPS = saved
    assert grid == (3, 2, 2) and (meta["BLOCK_H"], meta["BLOCK_D"], meta["num_warps"], meta["NUM_SPLITS"]) == (32, 256, 8, 2)
