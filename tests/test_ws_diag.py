"""``benchmarks/ws_diag.py`` builds its timing variants from today's warp-specialised kernel by exact text
replacement; these tests fail when the kernel is edited so that a variant would no longer be what its name says."""
import ast

import pytest

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
    consumer = texts["nocompute"].split("def _consumer")[1].split("def sparse_attention_gluon_ws_kernel")[0]
    assert "warpgroup_mma(" not in consumer and "exp2" not in consumer  # no MMA issued, no softmax
    assert ws_diag._NO_COPY in texts["neither"] and ws_diag._NO_COMPUTE_LOOP in texts["neither"]
    assert texts["noblocks"].count("n_blocks = n_blocks * 0") == 2  # producer and consumers


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
