"""benchmarks/bench_flashmla.py on CPU, without FlashMLA: our FP8 pages re-paged for FlashMLA's API hold
exactly our entry bytes where FlashMLA's kernel reads them (decoded with the reference decoder from
FlashMLA's addressing: block ``g // 64``, data at ``block * stride + slot * 576``, scales at
``block * stride + 64 * 576 + slot * 8``), the page stride is padded to 576 B, ``-1`` stays skip, window
indices are ``b * 128 + slot``; and the whole script runs end to end against ``tests/fake_flashmla``, a
pure-PyTorch stand-in that reads FlashMLA's layout. The real comparison runs on the GPU box."""
import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import bench_flashmla as BF  # noqa: E402
from dsv4_ops.reference import fp8_cache as fp8  # noqa: E402
from dsv4_ops.reference import ops as reference  # noqa: E402

FAKE = ROOT / "tests" / "fake_flashmla"
SMALL = dict(topk=64, window=128, ctx=1024)  # Flash widths (64 x 512, 584 B entries), a 256-entry pool


def _flat(k: torch.Tensor) -> torch.Tensor:
    """The bytes under a FlashMLA cache view, padding included."""
    return k.view(torch.uint8).as_strided((k.shape[0] * k.stride(0),), (1,), k.storage_offset())


def _read_flashmla(k: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Entry ``g`` of a FlashMLA MODEL1 cache by its kernel's addressing: (584 bytes, decoded fp32 [512])."""
    page, stride = k.shape[1], k.stride(0)
    block, t = divmod(g, page)
    flat = _flat(k)
    data = flat[block * stride + t * 576: block * stride + (t + 1) * 576]
    scales = flat[block * stride + page * 576 + t * 8: block * stride + page * 576 + (t + 1) * 8]
    return torch.cat([data, scales]), fp8.dequantize_kv(data, scales, fp8.KVLayout(512, 64))


@pytest.fixture(autouse=True)
def no_flash_mla_module():
    """Each test imports flash_mla afresh (the script runs in a fresh process) and leaves none behind."""
    sys.modules.pop("flash_mla", None)
    yield
    sys.modules.pop("flash_mla", None)
    while str(FAKE) in sys.path:
        sys.path.remove(str(FAKE))


@pytest.fixture(scope="module")
def small():
    case = BF.build_case(2, **SMALL)
    args = BF.build_inputs(case, "cpu")
    return case, args, BF.to_flashmla(args)


def test_inputs_are_the_v4_flash_csa_case_in_our_fp8_pages(small):
    case, (q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale), _ = small
    assert q.shape == (2, 1, 64, 512) and q.dtype == torch.bfloat16
    assert kv.shape == (2, 1, 128, 584) and cmp.shape == (2, 4, 64, 584) and kv.dtype == cmp.dtype == torch.uint8
    assert kv_idx.shape == (2, 1, 128) and cmp_idx.shape == (2, 1, 64) and not cmp_len.any()
    assert sink.shape == (64,) and scale == 512**-0.5
    full = BF.build_case(128)  # the default: window 128 + top-k 512 of a 32K context's 8192 entries
    assert full.params == dict(H=64, D=512, W=128, K=512, Nc=8192, dense=0, entry_bytes=584, page=64)
    with pytest.raises(ValueError, match="top-k"):
        BF.build_case(1, topk=512, ctx=1024)


def test_page_stride_is_padded_to_576_bytes(small):
    _, _, fm = small
    assert BF.padded_page_bytes(64, 584) == 37440 == 65 * 576
    for k in (fm.k_cache, fm.extra_k_cache):
        assert k.dtype == torch.float8_e4m3fn and k.shape[1:] == (64, 1, 584)
        assert k.stride() == (37440, 584, 584, 1) and k.stride(0) % 576 == 0
    assert fm.k_cache.shape[0] == 2 * 2 and fm.extra_k_cache.shape[0] == 2 * 4  # 128 / 64, 256 / 64 blocks a row
    pad = _flat(fm.extra_k_cache).view(-1, 37440)[:, 64 * 584:]
    assert not pad.any()


def test_window_indices_are_b_times_128_plus_slot_and_pool_b_times_entries(small):
    _, args, fm = small
    kv_idx, cmp_idx = args[2], args[4]
    b = torch.arange(2, dtype=torch.int32).view(2, 1, 1)
    assert fm.indices.dtype == torch.int32 and fm.indices.is_contiguous()
    assert torch.equal(fm.indices, kv_idx + b * 128)
    assert torch.equal(fm.extra_indices, cmp_idx + b * 256)


def test_flashmla_reads_exactly_our_entry_bytes(small):
    _, (q, kv, kv_idx, cmp, cmp_idx, *_), fm = small
    for ours, idx, k, g_idx in ((kv, kv_idx, fm.k_cache, fm.indices), (cmp, cmp_idx, fm.extra_k_cache,
                                                                        fm.extra_indices)):
        rows = fp8.to_entries(ours, 576)  # [B, N, 584]: our entry i of row b, data | scales
        values = fp8.read_kv(ours, 512)  # the reference decoder on our pages
        for b in range(2):
            for j in (0, 1, 37, idx.shape[-1] - 1):
                i, g = int(idx[b, 0, j]), int(g_idx[b, 0, j])
                raw, decoded = _read_flashmla(k, g)
                assert torch.equal(raw, rows[b, i]), (b, j)
                assert torch.equal(decoded, values[b, i]), (b, j)


def test_every_entry_of_both_caches_survives_the_repaging(small):
    _, (_, kv, _, cmp, *_), fm = small
    for ours, k in ((kv, fm.k_cache), (cmp, fm.extra_k_cache)):
        # FlashMLA's blocks ARE pages of our layout at page 64: read back with the reference decoder
        back = k.view(torch.uint8).reshape(2, -1, 64, 584)
        assert torch.equal(fp8.read_kv(back, 512), fp8.read_kv(ours, 512))


def test_minus_one_stays_skip_and_lists_pad_to_64_with_minus_one():
    idx = torch.tensor([[[3, -1, 0, 7, -1]], [[-1, -1, 5, 2, 1]]], dtype=torch.int32)
    out = BF.to_flashmla_indices(idx, entries=8)  # 8 entries a row: one block of 64 a row
    assert out.shape == (2, 1, 64)
    assert out[0, 0, :5].tolist() == [3, -1, 0, 7, -1] and out[1, 0, :5].tolist() == [-1, -1, 69, 66, 65]
    assert (out[:, :, 5:] == -1).all()
    full = BF.to_flashmla_indices(torch.ones((2, 1, 64), dtype=torch.int32), 128)
    assert full.shape == (2, 1, 64) and full[1, 0, 0] == 129  # 64 picks: no padding


def test_tail_entries_and_small_widths_round_to_whole_blocks():
    # a row of 8 window entries (tiny widths: 72 dims, 88 B entries) -> one zero-padded block of 64
    lay = fp8.KVLayout(72, 8, 8)
    data, scales = fp8.quantize_kv(torch.randn(3 * 8, 72), 8)
    ours = fp8.from_entries(torch.cat([data, scales], -1).view(3, 8, -1), 8, lay.data_bytes)
    k = BF.to_flashmla_cache(ours, 72)
    assert k.shape == (3, 64, 1, 88) and k.stride(0) == BF.padded_page_bytes(64, 88) == 5760 == 10 * 576
    back = fp8.read_kv(k.view(torch.uint8).reshape(3, 1, 64, 88), 72)
    assert torch.equal(back[:, :8], fp8.read_kv(ours, 72)) and not back[:, 8:].any()


def test_holes_set_a_share_of_both_index_lists_to_minus_one(small):
    _, args, _ = small
    holes = BF.with_holes(args, 0.25, seed=1)
    for i in (2, 4):
        dropped = holes[i] == -1
        assert 0.1 < dropped.float().mean() < 0.4
        assert torch.equal(holes[i][~dropped], args[i][~dropped])
    assert holes[0] is args[0] and holes[3] is args[3]


def test_the_stand_in_on_flashmla_inputs_matches_our_reference(small):
    """FlashMLA's semantics over FlashMLA's layout (the stand-in) = our op's reference over our pages:
    the conversion carries the same attention, also with holes."""
    sys.path.insert(0, str(FAKE))
    import flash_mla
    _, args, fm = small
    for a, x in ((args, fm), (BF.with_holes(args, 0.3), BF.to_flashmla(BF.with_holes(args, 0.3)))):
        got = BF.flashmla_call(flash_mla.flash_mla_with_kvcache, x, flash_mla.get_mla_metadata()[0])
        want = reference.sparse_attention(*a)
        res = BF.agreement(got, want)
        assert res["ok"] and res["rel_err"] < 4e-3, res
    wrong = BF.agreement(got, reference.sparse_attention(*args))  # holes vs none: must NOT agree
    assert not wrong["ok"]


def test_agreement_reports_and_fails_clearly():
    a = torch.randn(2, 1, 4, 8)
    assert BF.agreement(a, a) == dict(max_abs_diff=0.0, rel_err=0.0, max_abs=float(a.abs().max()), finite=True,
                                      ok=True)
    bad = a.clone()
    bad[0, 0, 0, 0] = float("nan")
    assert BF.agreement(bad, a)["why"] == "non-finite output"
    assert "relative error" in BF.agreement(a * 1.1, a)["why"]
    assert "shapes differ" in BF.agreement(a[:1], a)["why"]


def test_no_flashmla_build_exits_2_with_the_build_command(tmp_path):
    lines = []
    assert BF.main(["--flashmla", str(tmp_path), "--device", "cpu"], log=lines.append) == 2
    assert f"bash {tmp_path}/build.sh" in lines[-1] and "cannot be imported" in lines[-1]
    assert str(tmp_path) not in sys.path
    assert BF.main(["--flashmla", str(tmp_path / "nope"), "--device", "cpu"], log=lines.append) == 2
    assert "no such folder" in lines[-1]


def test_needs_cuda_unless_cpu_is_asked_for():
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    lines = []
    assert BF.main(["--flashmla", str(FAKE)], log=lines.append) == 2
    assert "no CUDA device" in lines[-1]


def test_end_to_end_on_cpu_with_the_stand_in(tmp_path):
    out = tmp_path / "r.json"
    lines = []
    argv = ["--flashmla", str(FAKE), "--device", "cpu", "--batches", "1", "2", "--topk", "64", "--ctx", "1024",
            "--target-ms", "1", "--copies", "3", "--out", str(out)]
    assert BF.main(argv, log=lines.append) == 0, "\n".join(lines)
    data = json.loads(out.read_text())
    assert data["meta"]["flashmla"].startswith(str(FAKE)) and data["meta"]["window"] == 128
    rows = data["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["status"] == "ok" and not r["errors"]
        assert r["check"]["ok"] and r["check_holes"]["ok"] and r["check"]["rel_err"] < 1e-2
        assert r["vs_reference"]["ours"]["ok"] and r["vs_reference"]["flashmla"]["ok"]
        assert r["ours_method"] == r["flashmla_method"] == "cpu" and r["ours_route"] == "reference"
        assert r["ratio"] == pytest.approx(r["ours_us"] / r["flashmla_us"])
        assert r["floor_us"] > 0 and r["flashmla_page_bytes"] == 37440 and r["copies"] == 3
    head = "| batch | ours µs | FlashMLA µs | ours/FlashMLA | floor µs"
    assert any(line.strip().startswith(head) for line in lines)
    import flash_mla

    assert {c["topk"] for c in flash_mla.calls} == {128} and {c["extra_topk"] for c in flash_mla.calls} == {64}
    assert {c["block_stride"] for c in flash_mla.calls} == {37440}
    assert len({c["b"] for c in flash_mla.calls}) == 2 and len(flash_mla.calls) >= 2 * (3 + 1 + 3)  # + timed


def test_a_batch_that_cannot_be_built_is_an_error_row(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise ValueError("no such case")

    monkeypatch.setattr(BF, "build_case", broken)
    lines = []
    argv = ["--flashmla", str(FAKE), "--device", "cpu", "--batches", "1", "--out", str(tmp_path / "r.json")]
    assert BF.main(argv, log=lines.append) == 1
    assert lines[-1] == "FAILED B=1: ValueError: no such case"


def test_a_disagreement_exits_1_and_says_so(tmp_path, monkeypatch):
    real = BF.flashmla_call
    monkeypatch.setattr(BF, "flashmla_call", lambda fn, x, s: real(fn, x, s) * 1.05)
    lines = []
    argv = ["--flashmla", str(FAKE), "--device", "cpu", "--batches", "1", "--topk", "64", "--ctx", "1024",
            "--target-ms", "1", "--out", str(tmp_path / "r.json")]
    assert BF.main(argv, log=lines.append) == 1
    assert lines[-1].startswith("FAILED B=1: check: ours and FlashMLA disagree: relative error")
    row = json.loads((tmp_path / "r.json").read_text())["rows"][0]
    assert row["status"] == "error" and row["ours_us"] and row["flashmla_us"]  # timed all the same


def test_a_flashmla_error_is_reported_and_ours_still_timed(tmp_path, monkeypatch):
    def broken(fn, x, s):
        raise RuntimeError("The whole block must be contiguous")

    monkeypatch.setattr(BF, "flashmla_call", broken)
    lines = []
    argv = ["--flashmla", str(FAKE), "--device", "cpu", "--batches", "1", "--topk", "64", "--ctx", "1024",
            "--target-ms", "1", "--out", str(tmp_path / "r.json")]
    assert BF.main(argv, log=lines.append) == 1
    assert "FlashMLA: RuntimeError: The whole block must be contiguous" in lines[-1]
    row = json.loads((tmp_path / "r.json").read_text())["rows"][0]
    assert row["ours_us"] and row["flashmla_us"] is None and "check" not in row


@pytest.mark.gpu
def test_on_the_gpu_with_a_built_flashmla(tmp_path):
    """FLASHMLA_DIR = a built copy of /work/shared/peers/flashmla (bash DIR/build.sh)."""
    folder = os.environ.get("FLASHMLA_DIR")
    if not folder:
        pytest.skip("set FLASHMLA_DIR to a built FlashMLA folder")
    out = tmp_path / "r.json"
    assert BF.main(["--flashmla", folder, "--batches", "1", "64", "--target-ms", "20", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert all(r["check"]["ok"] and r["check_holes"]["ok"] for r in rows)


def test_the_script_runs_as_the_gpu_box_calls_it(tmp_path):
    """``python3 benchmarks/bench_flashmla.py ...`` from the repo root, no PYTHONPATH: imports resolve and
    the CPU smoke run passes (exit 0)."""
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    script = str(ROOT / "benchmarks" / "bench_flashmla.py")
    res = subprocess.run([sys.executable, script, "--flashmla", "tests/fake_flashmla", "--device", "cpu", "--batches",
                          "1", "--topk", "64", "--ctx", "1024", "--target-ms", "1", "--out", str(tmp_path / "r.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert json.loads((tmp_path / "r.json").read_text())["rows"][0]["check"]["ok"]
