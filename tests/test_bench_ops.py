"""The per-kernel benchmark's arithmetic and plumbing, on CPU: byte / flop counts against
hand-computed numbers, the report writers on a fake result list, memory-skip rules, and a
tiny end-to-end run (on CPU the op path is the reference too, so only the harness is tested;
the timings themselves need the GPU box)."""
import argparse
import json
import sys

import pytest
import torch

from dsv4_ops.bench import cases as C
from dsv4_ops.bench import report
from dsv4_ops.bench import roofline as rl
from dsv4_ops.bench import run as R
from dsv4_ops.bench.timing import rotation_copies
from dsv4_ops.reference import ops as reference


# ---- byte / flop counts ---------------------------------------------------------------------
def test_sparse_attention_counts_q_entries_indices_sink_and_output():
    # per row: q 4*8*2=64 + out 64 + (3+5) entries * 8 * 2 = 128 + (3+5) indices * 4 = 32 + cmp_len 4
    cost = rl.sparse_attention_cost(batch=2, heads=4, head_dim=8, window=3, picked=5, dense=0)
    assert cost == rl.Cost(bytes=2 * (64 + 64 + 128 + 32 + 4) + 4 * 4, flops=2 * 4 * 4 * 8 * 8)
    assert cost == (600, 2048)


def test_sparse_attention_hca_reads_the_dense_prefix_without_indices():
    # q 16 + out 16 + (2 + 3) entries * 4 * 2 = 40 + window indices 2 * 4 + cmp_len 4, sink 2 * 4
    cost = rl.sparse_attention_cost(batch=1, heads=2, head_dim=4, window=2, picked=0, dense=3)
    assert cost == (16 + 16 + 40 + 8 + 4 + 8, 4 * 2 * 4 * 5)


def test_sparse_attention_floor_at_v4_shapes():
    # Flash CSA 32K, B=64: 640 entries -> 50.5 MB -> 11.74 us, memory bound (the kernel's
    # docstring: 54 us = 22% of the floor)
    flash = rl.sparse_attention_cost(64, 64, 512, 128, 512, 0)
    assert flash.bytes == 64 * (2 * 64 * 512 * 2 + 640 * 1024 + 640 * 4 + 4) + 256
    assert rl.floor_us(flash) == pytest.approx(11.743, abs=1e-3) and rl.bound(flash) == "memory"
    # Pro CSA 32K, B=64: 1152 entries x 128 heads -> 19.3 GFLOP -> 24.47 us, compute bound
    pro = rl.sparse_attention_cost(64, 128, 512, 128, 1024, 0)
    assert pro.flops == 64 * 4 * 128 * 512 * 1152
    assert rl.floor_us(pro) == pytest.approx(24.465, abs=1e-3) and rl.bound(pro) == "compute"


def test_indexer_counts_every_visible_key_once():
    # per row: q 4*8*2=64 + weights 4*4=16 + keys 10*8*2=160 + visible 4 + out 3*4=12
    assert rl.indexer_topk_cost(batch=2, heads=4, dim=8, keys=10, topk=3) == (2 * 256, 2 * 2 * 4 * 8 * 10)


def test_compress_counts_slots_rope_row_and_pool_write():
    # CSA layout, 2m = 8 slots of d = 8 fp32 channels for kv and gate: 512; cos + sin row 16;
    # emit 4; pool row 16 -> 548 per row; + start 2*4 + norm weight 8*2
    assert rl.compress_cost(batch=2, dim=8, ratio=4, overlap=True, rope_half=2) == (2 * 548 + 8 + 16, 0)
    # HCA layout: m = 4 slots -> 256 + 16 + 4 + 16, + start 4 + norm 16
    assert rl.compress_cost(batch=1, dim=8, ratio=4, overlap=False, rope_half=2) == (292 + 4 + 16, 0)


def test_plan_counts_its_nine_outputs():
    # decode: 6 per-query int32 + 128 window indices + 1 + 1 emit slots, and 2 inputs, per row
    assert rl.plan_cost(batch=3, window=128, csa_ratio=4, hca_ratio=128) == (3 * 8 + 3 * 136 * 4, 0)
    # 2 steps of 5 tokens, W=4: 6*5 + 5*4 + ceil(5/4) + ceil(5/128) = 53 int32 per step
    assert rl.plan_cost(batch=1, window=4, csa_ratio=4, hca_ratio=128, num_tokens=5, steps=2) == (8 + 2 * 53 * 4, 0)


def test_cache_write_reads_and_writes_each_row_once():
    assert rl.cache_write_cost(batch=2, channels=512, elem_bytes=2) == (2 * (2 * 1024 + 4), 0)


def test_floor_is_the_larger_term():
    assert rl.floor_us(rl.Cost(4_300_000, 0)) == pytest.approx(1.0)
    assert rl.floor_us(rl.Cost(0, 790_000_000)) == pytest.approx(1.0)
    assert rl.floor_us(rl.Cost(4_300_000, 1_580_000_000)) == pytest.approx(2.0)
    assert rl.bound(rl.Cost(4_300_000, 1_580_000_000)) == "compute"


# ---- the counts match the tensors the cases build -------------------------------------------
def _args(case):
    return case.make(torch.device("cpu"))


def test_case_bytes_are_those_of_the_built_arguments():
    d, B = C.TINY["pro"], 3
    q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, _ = _args(C.sparse_attention_case(d, "csa", B, 256, "pro"))
    rows = B * (d.window + d.topk) * d.head_dim * kv.element_size()
    expect = 2 * q.nbytes + rows + kv_idx.nbytes + cmp_idx.nbytes + cmp_len.nbytes + sink.nbytes
    assert C.sparse_attention_case(d, "csa", B, 256, "pro").cost.bytes == expect

    case = C.indexer_topk_case(d, B, 256, "pro")
    q, w, keys, visible, k = _args(case)
    assert case.cost.bytes == q.nbytes + w.nbytes + keys.nbytes + visible.nbytes + B * k * 4

    case = C.plan_case(d, B, 256, "pro")
    args = _args(case)
    assert case.cost.bytes == args[0].nbytes + args[1].nbytes + sum(t.nbytes for t in reference.plan(*args))

    case = C.cache_write_case(d, B, 256, "pro")
    cache, values, slots = _args(case)
    assert case.cost.bytes == 2 * values.nbytes + slots.nbytes


def test_case_inputs_are_valid_distinct_and_see_the_full_context():
    d, B, ctx = C.TINY["flash"], 2, 256
    q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, _ = _args(C.sparse_attention_case(d, "csa", B, ctx, "flash"))
    assert cmp.shape[1] == ctx // d.csa_ratio and cmp_idx.shape[-1] == d.topk
    for idx, n in ((kv_idx, kv.shape[1]), (cmp_idx, cmp.shape[1])):
        assert int(idx.min()) >= 0 and int(idx.max()) < n
        assert all(len(set(r.tolist())) == r.numel() for r in idx.reshape(B, -1))
    assert bool((q != 0).all())
    *_, cmp_len, _, _ = _args(C.sparse_attention_case(d, "hca", B, ctx, "flash"))
    assert cmp_len.tolist() == [[ctx // d.hca_ratio]] * B


def test_sinkhorn_reads_and_writes_each_matrix_once():
    assert rl.sinkhorn_cost(batch=64, hc_mult=4) == (64 * 2 * 16 * 4, 0)


def test_quick_grid_and_shared_ops_run_once():
    cases = C.grid([C.FLASH, C.PRO], C.KERNELS, R.QUICK_GRID["batches"], R.QUICK_GRID["contexts"])
    by_kernel = {k: [c for c in cases if c.kernel == k] for k in C.KERNELS}
    assert [len(by_kernel[k]) for k in C.KERNELS] == [8, 4, 6, 2, 2, 2]
    assert {c.shape for c in by_kernel["plan"]} == {"flash/pro"}
    assert not any(c.skip for c in cases)


def test_meta_sizing_needs_no_memory():
    case = C.sparse_attention_case(C.PRO, "csa", 128, 131072, "pro")
    assert C.alloc_bytes(case) >= 128 * 32768 * 512 * 2  # the 4.3 GB pool, sized on the meta device


# ---- memory planning, rotation, checks ------------------------------------------------------
def test_rotation_copies():
    l2 = 50 * 2**20
    assert rotation_copies(touched=10 * l2, alloc=10 * l2, l2=l2, budget=10**12) == 1
    assert rotation_copies(touched=l2 // 4, alloc=l2, l2=l2, budget=10**12) == 8
    assert rotation_copies(touched=1, alloc=1, l2=l2, budget=10**12, max_copies=128) == 128
    assert rotation_copies(touched=1000, alloc=10**6, l2=l2, budget=5 * 10**6) == 5


def test_case_over_budget_is_skipped_with_reason():
    case = C.indexer_topk_case(C.TINY["flash"], 2, 256, "flash")
    row = R.measure(case, torch.device("cpu"), budget=100, target_ms=1, with_ref=True, strict=True)
    assert row["status"] == "skipped" and "exceed the budget" in row["reason"]
    budget = C.alloc_bytes(case) + case.work_bytes  # the op fits, the reference does not
    row = R.measure(case, torch.device("cpu"), budget=budget, target_ms=1, with_ref=True, strict=True)
    assert row["status"] == "ok" and row["ref_us"] is None and "reference needs" in row["ref_reason"]


def test_index_agreement_compares_sets_per_row():
    want = torch.tensor([[[3, 1, 2]], [[0, 4, -1]]])
    assert R.index_agreement(torch.tensor([[[1, 2, 3]], [[4, 0, -1]]]), want) == 1.0
    assert R.index_agreement(torch.tensor([[[1, 2, 5]], [[4, 0, -1]]]), want) == pytest.approx(4 / 5)


def test_context_argument():
    assert [R.context(s) for s in ("8K", "32k", "4096")] == [8192, 32768, 4096]


# ---- report writers -------------------------------------------------------------------------
def _fake_rows():
    base = C.grid([C.FLASH, C.PRO], ("sparse_attention", "plan"), [1, 64], [32768])
    rows = []
    for i, case in enumerate(base):
        r = R.describe(case)
        r.update(time_us=2 * r["floor_us"] + 3.0, ref_us=500.0 + i, method="cuda_graph",
                 l2_cold=r["kernel"] != "plan", check=dict(ok=True, max_abs_err=0.004))
        r.update(speedup=r["ref_us"] / r["time_us"], fraction=r["floor_us"] / r["time_us"])
        rows.append(r)
    rows[1].update(status="skipped", reason="inputs 70.0 GB exceed the budget 60.0 GB")
    rows[2].update(ref_us=None, speedup=None, ref_reason="reference needs ~99.0 GB > budget 60.0 GB")
    rows[3]["check"] = dict(ok=False, max_abs_err=1.5)
    return rows


def test_markdown_table(tmp_path):
    rows = _fake_rows()
    path = tmp_path / "t.md"
    report.write_markdown(path, dict(device="H200", torch="2.11", triton="3.6", date="today"), rows)
    text = path.read_text()
    assert "| kernel | shape | batch | ctx | time µs | reference µs | speedup | floor µs | fraction |" in text
    r = rows[0]  # Flash CSA, B=1, 32K: floor 0.184 us; time = 2 * floor + 3
    assert r["label"] == "sparse_attention csa" and r["batch"] == 1
    assert (f"| sparse_attention csa | flash | 1 | 32K | {r['time_us']:.2f} | 500.0 | {r['speedup']:.3g}× | "
            f"{r['floor_us']:.3g} | {r['fraction'] * 100:.3g}% |") in text
    assert "| skipped | – | – |" in text
    assert "exceed the budget" in text and "reference not timed" in text and "DISAGREE" in text
    assert "not L2-cold (too little data to rotate past 2x L2 with the input copies allowed): plan (B=1, 64)" in text
    assert text.count("\n| ") == len(rows) + 1  # header + one line per row


def test_json_round_trip(tmp_path):
    rows = _fake_rows()
    path = tmp_path / "sub" / "r.json"
    report.write_json(path, {"device": "H200"}, rows)
    data = json.loads(path.read_text())
    assert data["meta"] == {"device": "H200"} and data["rows"] == rows


def test_plot_without_matplotlib_is_skipped(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    assert report.plot(tmp_path / "p.png", _fake_rows()) is False
    assert "matplotlib not installed" in capsys.readouterr().out
    assert not (tmp_path / "p.png").exists()


# ---- end to end, tiny widths on CPU ---------------------------------------------------------
def test_tiny_cpu_run_writes_every_row(tmp_path):
    p = argparse.ArgumentParser()
    R.add_arguments(p)
    args = p.parse_args(["--tiny", "--device", "cpu", "--batches", "2", "--target-ms", "1", "--no-plot",
                         "--out", str(tmp_path)])
    lines = []
    assert R.run(args, strict=True, log=lines.append) == 0
    rows = json.loads((tmp_path / "bench_ops.json").read_text())["rows"]
    assert len(rows) == 12 and len(lines) == 12 + 2  # header, one line per case, summary
    assert all(r["status"] == "ok" and r["check"]["ok"] and r["time_us"] > 0 and r["ref_us"] > 0 for r in rows)
    assert (tmp_path / "bench_ops.md").read_text().count("\n| ") == 13
    # --from-json: the same table again, from the JSON alone
    assert R.render(tmp_path / "bench_ops.json", tmp_path / "again", plot=False, log=lines.append) == 0
    assert (tmp_path / "again" / "bench_ops.md").read_text() == (tmp_path / "bench_ops.md").read_text()
