"""The benchmarks (benchmarks/, DESIGN.md §6) on CPU, in seconds: the per-kernel roofline
arithmetic against hand-computed numbers, the kernel grid's report writers and memory rules, the
one timer (benchmarks/timing.py), the model benchmark's bytes floor worked out by hand for the
tiny config, a smoke run of bench_model.py through the public Generator whose JSON has the
fields benchmarks/README.md promises, and bench_spec.py's step-by-difference arithmetic. On CPU the ops
run the reference, so the timings only prove the harness; the numbers come from the GPU box."""
import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # `benchmarks` is a package at the repo root, not installed

from benchmarks import bench_model as BM  # noqa: E402
from benchmarks import bench_spec as BS  # noqa: E402
from benchmarks import timing as T  # noqa: E402
from benchmarks.kernel_bench import cases as C  # noqa: E402
from benchmarks.kernel_bench import report  # noqa: E402
from benchmarks.kernel_bench import roofline as rl  # noqa: E402
from benchmarks.kernel_bench import run as R  # noqa: E402
from dsv4_ops import DeepseekV4ForCausalLM, DSV4Config  # noqa: E402
from dsv4_ops.reference import fp8_cache as fp8  # noqa: E402
from dsv4_ops.reference import ops as reference  # noqa: E402


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


def test_fp8_cache_counts_whole_entries_and_keeps_the_flops():
    # V4 widths: a KV entry is 448 e4m3 + 64 bf16 rope + 8 scale bytes, an indexer key 128 + a 4-byte scale
    assert fp8.KVLayout(512, 64).entry_bytes == 584 and fp8.IndexerLayout(128).entry_bytes == 132
    # Flash CSA 32K, B=64: the 640 entries read are 584 B each instead of 1024 B; q, out, indices unchanged
    bf16 = rl.sparse_attention_cost(64, 64, 512, 128, 512, 0)
    f8 = rl.sparse_attention_cost(64, 64, 512, 128, 512, 0, entry_bytes=584)
    assert f8.bytes == 64 * (2 * 64 * 512 * 2 + 640 * 584 + 640 * 4 + 4) + 256
    assert bf16.bytes - f8.bytes == 64 * 640 * (1024 - 584) and f8.flops == bf16.flops
    # indexer: 10 keys of 132 B (DI = 8 here only for the arithmetic)
    cost = rl.indexer_topk_cost(2, 4, 8, 10, 3, key_entry_bytes=132)
    assert cost == (2 * (64 + 16 + 1320 + 4 + 12), 2 * 2 * 4 * 8 * 10)


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


def test_fp8_cases_read_real_quantised_caches_in_the_models_pages():
    d, B, ctx = C.TINY["flash"], 2, 256
    rope = 2 * d.rope_half
    for variant in ("csa", "hca"):
        case = C.sparse_attention_case(d, variant, B, ctx, "flash", "fp8")
        q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, _ = _args(case)
        # the window ring is one page of W entries, a pool has PAGE_SIZE entries a page (as AttentionModule.new_state)
        assert kv.shape == fp8.KVLayout(d.head_dim, rope, d.window).shape(B, d.window) == (B, 1, d.window, 88)
        assert cmp.shape == fp8.KVLayout(d.head_dim, rope).shape(B, case.params["Nc"])
        for cache in (kv, cmp):  # valid codes and scales: decoding then re-quantising gives the same values
            x = fp8.read_kv(cache, d.head_dim)
            assert bool(x.isfinite().all()) and bool((x != 0).any(-1).all())
            assert torch.equal(fp8.simulate_kv(x, rope), x)
        n = case.params["K"] if variant == "csa" else case.params["dense"]
        # bytes: every entry read is a whole FP8 entry; q / out / indices as in the bf16 case
        expect = (2 * q.nbytes + B * (d.window + n) * case.params["entry_bytes"] + kv_idx.nbytes + cmp_idx.nbytes
                  + cmp_len.nbytes + sink.nbytes)
        assert case.cost.bytes == expect
        assert case.cost.flops == C.sparse_attention_case(d, variant, B, ctx, "flash").cost.flops
        picked = cmp_idx.numel() and int(cmp_idx.max())
        assert picked < case.params["Nc"] and int(cmp_len.max()) <= case.params["Nc"]
    case = C.indexer_topk_case(d, B, ctx, "flash", "fp8")
    q, w, keys, visible, k = _args(case)
    assert keys.shape == fp8.IndexerLayout(d.index_dim).shape(B, ctx // d.csa_ratio)
    x = fp8.read_keys(keys)
    assert bool(x.isfinite().all()) and bool((x != 0).any(-1).all())
    assert torch.equal(fp8.dequantize_keys(*fp8.quantize_keys(x)), x)
    keys_read = B * (ctx // d.csa_ratio) * (d.index_dim + 4)
    assert case.cost.bytes == q.nbytes + w.nbytes + keys_read + visible.nbytes + B * k * 4
    assert C.alloc_bytes(case) == sum(a.nbytes for a in (q, w, keys, visible))  # sized on meta like the others


def test_the_kernel_benchmarks_fp8_cases_run_through_the_kernels(tol):
    """benchmarks/kernel_bench/cases.py builds the FP8 rows of bench_ops (gpu_check.sh ops-fp8): its pages
    (window ring = one page of W entries, pools of PAGE_SIZE) must be what the Triton kernels read (under the
    interpreter on CPU); tiny widths."""
    from launchers import DEVICE, kernel_module

    sa, ix = kernel_module("sparse_attention"), kernel_module("indexer")
    torch.manual_seed(5)
    d = C.TINY["flash"]
    for variant in ("csa", "hca"):
        args = C.sparse_attention_case(d, variant, 2, 256, "flash", "fp8").make(DEVICE)
        want = reference.sparse_attention(*args)
        for splits in (1, 2):
            got = sa.sparse_attention(*args, out=torch.full_like(want, float("nan")), num_splits=splits)
            torch.testing.assert_close(got, want, **tol(torch.bfloat16))  # bf16 outputs
    args = C.indexer_topk_case(d, 2, 256, "flash", "fp8").make(DEVICE)
    want = reference.indexer_topk(*args)
    assert torch.equal(ix.indexer_topk(*args, out=torch.full_like(want, 77)), want)


def test_sinkhorn_reads_and_writes_each_matrix_once():
    assert rl.sinkhorn_cost(batch=64, hc_mult=4) == (64 * 2 * 16 * 4, 0)


def test_quick_grid_and_shared_ops_run_once():
    cases = C.grid([C.FLASH, C.PRO], C.KERNELS, R.QUICK_GRID["batches"], R.QUICK_GRID["contexts"])
    by_kernel = {k: [c for c in cases if c.kernel == k] for k in C.KERNELS}
    assert [len(by_kernel[k]) for k in C.KERNELS] == [8, 4, 6, 2, 2, 2]
    assert {c.shape for c in by_kernel["plan"]} == {"flash/pro"}
    assert not any(c.skip for c in cases) and {c.cache for c in cases} == {"bf16"}
    # --kv-cache-dtype bf16 fp8: an FP8 twin next to each case of the cache readers, the rest once
    both = C.grid([C.FLASH, C.PRO], C.KERNELS, R.QUICK_GRID["batches"], R.QUICK_GRID["contexts"], ("bf16", "fp8"))
    assert [len([c for c in both if c.kernel == k]) for k in C.KERNELS] == [16, 8, 6, 2, 2, 2]
    assert {c.kernel for c in both if c.cache == "fp8"} == set(C.FP8_KERNELS)
    assert [c.cache for c in both[:2]] == ["bf16", "fp8"] and both[0].seed != both[1].seed
    assert [c.seed for c in both if c.cache == "bf16"] == [c.seed for c in cases]  # bf16 inputs as before
    with pytest.raises(ValueError, match="unknown cache dtype"):
        C.grid([C.FLASH], ("indexer_topk",), [1], [8192], ("fp16",))


def test_meta_sizing_needs_no_memory():
    case = C.sparse_attention_case(C.PRO, "csa", 128, 131072, "pro")
    assert C.alloc_bytes(case) >= 128 * 32768 * 512 * 2  # the 4.3 GB pool, sized on the meta device
    case = C.sparse_attention_case(C.PRO, "csa", 128, 131072, "pro", "fp8")
    assert C.alloc_bytes(case) >= 128 * 32768 * 584  # its 2.4 GB FP8 twin, not quantised on meta


# ---- memory planning, rotation, checks ------------------------------------------------------
def test_rotation_copies():
    l2 = 50 * 2**20
    assert T.rotation_copies(touched=10 * l2, alloc=10 * l2, l2=l2, budget=10**12) == 1
    assert T.rotation_copies(touched=l2 // 4, alloc=l2, l2=l2, budget=10**12) == 8
    assert T.rotation_copies(touched=1, alloc=1, l2=l2, budget=10**12, max_copies=128) == 128
    assert T.rotation_copies(touched=1000, alloc=10**6, l2=l2, budget=5 * 10**6) == 5


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
    assert ("| kernel | shape | cache | batch | ctx | time µs | reference µs | speedup | floor µs | fraction |"
            in text)
    r = rows[0]  # Flash CSA, B=1, 32K: floor 0.184 us; time = 2 * floor + 3
    assert r["label"] == "sparse_attention csa" and r["batch"] == 1
    assert (f"| sparse_attention csa | flash | bf16 | 1 | 32K | {r['time_us']:.2f} | 500.0 | {r['speedup']:.3g}× | "
            f"{r['floor_us']:.3g} | {r['fraction'] * 100:.3g}% |") in text
    assert "| skipped | – | – |" in text
    assert "exceed the budget" in text and "reference not timed" in text and "DISAGREE" in text
    assert "not L2-cold (too little data to rotate past 2x L2 with the input copies allowed): plan (B=1, 64)" in text
    assert text.count("\n| ") == len(rows) + 1  # header + one line per row
    old = [{k: v for k, v in r.items() if k != "cache"} for r in rows]  # a JSON from before FP8 rows existed
    assert report.markdown({}, old).split("\n| ")[1:] == report.markdown({}, rows).split("\n| ")[1:]


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
                         "--kv-cache-dtype", "bf16", "fp8", "--out", str(tmp_path)])
    lines = []
    assert R.run(args, strict=True, log=lines.append) == 0
    rows = json.loads((tmp_path / "bench_ops.json").read_text())["rows"]
    # 12 bf16 cases + FP8 twins of the 4 attention and 2 indexer cases; each FP8 row checked too
    assert len(rows) == 18 and len(lines) == 18 + 2  # header, one line per case, summary
    assert all(r["status"] == "ok" and r["check"]["ok"] and r["time_us"] > 0 and r["ref_us"] > 0 for r in rows)
    fp8_rows = sorted(r["label"] for r in rows if r["cache"] == "fp8")
    assert fp8_rows == ["indexer_topk"] * 2 + ["sparse_attention csa"] * 2 + ["sparse_attention hca"] * 2
    assert (tmp_path / "bench_ops.md").read_text().count("\n| ") == 19
    # --from-json: the same table again, from the JSON alone
    assert R.render(tmp_path / "bench_ops.json", tmp_path / "again", plot=False, log=lines.append) == 0
    assert (tmp_path / "again" / "bench_ops.md").read_text() == (tmp_path / "bench_ops.md").read_text()
    assert {r["method"] for r in rows} == {"cpu"} and min(r["samples"] for r in rows) >= 3


# ---- the one timer ----------------------------------------------------------------------------
def test_time_call_runs_warmup_then_iters_and_takes_the_median():
    calls, sleeps = [], [0.0, 0.0, 0.020, 0.001, 0.050, 0.001, 0.001]  # 2 warm-up, then 5 timed

    def fn():
        time.sleep(sleeps[len(calls)])
        calls.append(1)

    t = T.time_call(fn, "cpu", warmup=2, iters=5)
    assert len(calls) == 7 and t.method == "cpu" and t.samples == 5
    assert 1.0 <= t.ms < 10.0  # the median of (20, 1, 50, 1, 1) ms is 1 ms, not the 14.6 ms mean
    assert t.wall_ms >= 14.6 and t.us == t.ms * 1e3
    with pytest.raises(ValueError, match="iters must be >= 1"):
        T.time_call(fn, "cpu", iters=0)


def test_kernel_time_on_cpu_cycles_over_the_input_copies():
    seen = []
    t = T.kernel_time([lambda i=i: seen.append(i) for i in range(3)], torch.device("cpu"), target_ms=1)
    assert t.method == "cpu" and t.ms > 0 and t.samples >= 3 and set(seen) == {0, 1, 2}


@pytest.mark.gpu
def test_timing_on_cuda():
    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    t = T.kernel_time([lambda: a @ a], dev, target_ms=20)
    floor_ms = 2 * 4096**3 / rl.BF16_FLOPS_PER_S * 1e3
    assert t.method == "cuda_graph" and t.samples == 10 and floor_ms * 0.9 < t.ms < 50 * floor_ms
    def refuses_capture():  # like an op that syncs the host
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("operation not permitted when stream is capturing")
        return a @ a

    with pytest.warns(UserWarning, match="CUDA-graph timing failed"):
        s = T.kernel_time([refuses_capture], dev, target_ms=20)
    assert s.method == "do_bench" and s.ms > floor_ms * 0.9
    c = T.time_call(lambda: a @ a, dev, warmup=2, iters=10)
    assert c.method == "cuda_events" and c.samples == 10 and c.ms > floor_ms * 0.9 and c.wall_ms > 0


# ---- model benchmark: bytes floor, by hand for the tiny config -------------------------------
def test_routed_experts_expected_distinct_count():
    assert BM.routed_experts(8, 2, 1) == 2  # one token reads exactly its top-k
    assert BM.routed_experts(8, 2, 2) == pytest.approx(8 * (1 - 0.75**2))  # = 3.5
    assert BM.routed_experts(256, 6, 64) == pytest.approx(256 * (1 - (250 / 256) ** 64))  # ~201 of 256
    assert BM.routed_experts(8, 2, 512) == pytest.approx(8)
    assert BM.is_routed_expert("model.layers.0.mlp.experts.down_proj")
    assert not BM.is_routed_expert("model.layers.0.mlp.shared_experts.down_proj.weight")


def test_fp8_cache_floor_counts_the_fp8_layout_bytes_by_hand():
    from benchmarks.random_weights import flash_slice_config

    cfg = flash_slice_config()  # 2 sliding, CSA, HCA; W 128, D 512 (448 nope + 64 rope), m 4 / 128, top-k 512
    # FP8 entry: 448 e4m3 + 64 bf16 rope + 8 scale bytes = 584; indexer key: 128 e4m3 + fp32 scale = 132
    fp8_row = 584 * (4 * 128 + 512 + 4096 // 128) + 132 * (4096 // 4)
    assert BM.kv_bytes_per_row(cfg, 4096, 2, "fp8") == fp8_row == 751872
    bf16_row = 2 * (512 * (4 * 128 + 512 + 32) + 128 * 1024)
    assert BM.kv_bytes_per_row(cfg, 4096, 2) == BM.kv_bytes_per_row(cfg, 4096, 4, "bf16") == bf16_row
    assert 1.7 < bf16_row / fp8_row < 1.8


def test_decode_floor_of_the_tiny_config_by_hand():
    cfg = DSV4Config.tiny()  # layers: sliding, CSA, HCA, CSA; W 16, D 64, m 4 / 16, top-k 8, DI 32
    model = DeepseekV4ForCausalLM(cfg)  # fp32: 4 bytes per element
    parts = BM.floor_parts(model, cfg, batch=2, ctx=40)
    # KV per row at 40 tokens: every layer its window 16 x 64; CSA (2 layers) top-8 of its 10
    # entries x 64 and all 10 indexer keys x 32; HCA its 40 // 16 = 2 entries x 64
    kv_row = 4 * (4 * 16 * 64 + 2 * (8 * 64 + 10 * 32) + 2 * 64)
    assert kv_row == 23552 and parts["kv"] == 2 * kv_row
    # routed experts: per layer and expert gate_up 64 x 64 + down 64 x 32; 2 tokens of top-2 of 8
    # are expected to read 8 * (1 - (6/8)^2) = 3.5 distinct experts in each of the 4 layers
    assert parts["experts_read"] == 3.5 and parts["experts"] == pytest.approx(4 * 3.5 * 4 * (64 * 64 + 64 * 32))
    assert parts["embed"] == 2 * 64 * 4  # the two gathered embedding rows
    layers = model.model.layers
    every = sum(p.nbytes for p in model.parameters())
    skipped = (model.model.embed_tokens.weight.nbytes + sum(p.nbytes for p in model.mtp.parameters())
               + sum(p.nbytes for layer in layers for p in layer.mlp.experts.parameters()))
    assert parts["weights"] == every - skipped
    total = parts["weights"] + parts["experts"] + parts["embed"] + parts["kv"]
    assert parts["total"] == round(total) == BM.decode_floor_bytes(model, cfg, 2, 40)
    assert parts["floor_ms"] == pytest.approx(parts["total"] / 4.3e12 * 1e3)
    # a speculative step reads more: the verify pass's 2 x 3 tokens and k MTP passes
    assert BS.spec_floor_bytes(model, cfg, 2, 40, 2) > BS.spec_floor_bytes(model, cfg, 2, 40, 1) > parts["total"]


# ---- model benchmark: smoke run through the public Generator ---------------------------------
def _promised_fields(section: str) -> list[str]:
    """The backticked field names listed for ``section`` in benchmarks/README.md's JSON description."""
    text = (ROOT / "benchmarks" / "README.md").read_text()
    line = next(ln for ln in text.splitlines() if ln.lstrip("- ").startswith(f"`{section}`"))
    return re.findall(r"`(\w+)`", line.split(":", 1)[1])


def test_bench_model_smoke_writes_the_json_fields_benchmarks_readme_promises(tmp_path):
    out = tmp_path / "bench_model.json"
    lines = []
    res = BM.main(["--smoke", "--device", "cpu", "--batches", "2", "--contexts", "20", "--iters", "3", "--warmup", "1",
                   "--prefill-samples", "2", "--prefill-len", "8", "--out", str(out)], log=lines.append)
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(res))
    for section in ("meta", "decode", "prefill"):
        fields = _promised_fields(section)
        assert len(fields) >= 5
        for row in [data["meta"]] if section == "meta" else data[section]:
            assert set(fields) <= set(row), f"{section}: {sorted(set(fields) - set(row))} missing"
    (row,) = data["decode"]
    assert (row["mode"], row["batch"], row["context"], row["samples"], row["method"]) == ("eager", 2, 20, 3, "cpu")
    assert row["ms"] > 0 and row["wall_ms"] > 0 and row["floor_fraction"] == pytest.approx(row["floor_ms"] / row["ms"])
    model = DeepseekV4ForCausalLM(DSV4Config.tiny())
    assert row["floor_bytes"] == BM.decode_floor_bytes(model, model.config, 2, 20)
    (pre,) = data["prefill"]
    assert pre["prompt"] == 2 and pre["samples"] == 2 and pre["tokens_per_s"] == pytest.approx(2 * 2 / pre["ms"] * 1e3)
    assert data["meta"]["engine"] == "generator" and data["hf"] == []
    assert lines[-1] == f"wrote {out}" and any(ln.startswith("| eager | 2 | 20 |") for ln in lines)


def test_bench_model_aoti_path_exports_loads_and_times_the_same_calls(tmp_path, monkeypatch):
    """``--aoti`` against a stand-in for ``dsv4_ops.export`` / ``AOTIGenerator``: an eager Generator on a copy of the
    model, behind a wrapper, so that, as with a real package, the bench's model has no caches and the engine is no
    ``Generator`` (the bench may not probe the model's routing through it)."""
    import copy

    import dsv4_ops

    exported = {}

    def export(model, path, max_batch_size, max_seq_len, prefill_chunk):
        Path(path).write_bytes(b"pt2")
        exported[path] = (model, dict(max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                      prefill_chunk=prefill_chunk))

    class AOTIGenerator:
        def __init__(self, path):
            model, kw = exported[path]
            self._gen = dsv4_ops.Generator(copy.deepcopy(model), compile=False, **kw)

        def __getattr__(self, name):
            return getattr(self._gen, name)

    monkeypatch.setattr(dsv4_ops, "export", export, raising=False)
    monkeypatch.setattr(dsv4_ops, "AOTIGenerator", AOTIGenerator, raising=False)
    res = BM.main(["--smoke", "--aoti", "--device", "cpu", "--batches", "1", "--contexts", "20", "--iters", "2",
                   "--prefill-samples", "1", "--prefill-len", "4", "--out", str(tmp_path / "a.json")],
                  log=lambda m: None)
    (path,) = exported
    assert exported[path][1] == dict(max_batch_size=1, max_seq_len=20 + BM.DECODE_SLACK, prefill_chunk=16)
    assert not Path(path).parent.exists()  # the temp package dir is gone
    assert res["meta"]["engine"] == "aoti" and [r["mode"] for r in res["decode"]] == ["aoti"]
    assert res["decode"][0]["ms"] > 0 and res["prefill"][0]["export_s"] >= 0 and res["hf"] == []
    assert "experts_routed" not in res["decode"][0]  # the routing of an exported program is not probed


def test_bench_model_aoti_needs_the_export_api(monkeypatch):
    import dsv4_ops

    for name in ("export", "AOTIGenerator"):
        monkeypatch.delattr(dsv4_ops, name, raising=False)
    with pytest.raises(SystemExit, match="dsv4_ops.export and dsv4_ops.AOTIGenerator not in this checkout"):
        BM.aoti_api()
    args = BM.parse_args(["--aoti", "--out", "x.json"])
    assert args.modes == ["aoti"] and args.hf_points == [] and args.compare_at == []


# ---- speculative benchmark: a step's time by difference ----------------------------------------
class _FakeGen:
    """``generate(prompts, n)`` costs 50 ms of prefill + 3 ms per step, and runs ``ceil((n-1)/2)``
    steps of 2 tokens per row (one draft accepted of two)."""

    def __init__(self):
        self.stats = dict(decode_steps=0, decode_tokens=0, accepted_tokens=0, drafted_tokens=0)
        self.last_ms = 0.0

    def generate(self, prompts, max_new_tokens):
        steps = -(-(max_new_tokens - 1) // 2)
        for key, per_step in (("decode_steps", 1), ("decode_tokens", 2 * len(prompts)),
                              ("accepted_tokens", len(prompts)), ("drafted_tokens", 2 * len(prompts))):
            self.stats[key] += steps * per_step
        self.last_ms = 50.0 + 3.0 * steps


def test_spec_step_cost_by_difference(monkeypatch):
    gen = _FakeGen()

    def fake_time_call(fn, device, warmup=1, iters=1, sync_each=False):
        for _ in range(warmup + iters):
            fn()
        return T.Timing(gen.last_ms, "cpu", iters)

    monkeypatch.setattr(BS, "time_call", fake_time_call)
    cost = BS.step_cost(gen, [[1, 2], [3, 4], [5, 6]], n_short=3, n_long=21, device="cpu", samples=4)
    assert (cost["steps_short"], cost["steps_long"]) == (1, 10)
    assert cost["step_ms"] == pytest.approx(3.0)  # the 50 ms of prefill cancel
    assert cost["tokens_per_step"] == pytest.approx(2.0) and cost["acceptance_rate"] == pytest.approx(0.5)


def test_spec_acceptance_counts_every_prompt_set_per_row():
    gen = _FakeGen()
    gen.generate([[9]], max_new_tokens=99)  # earlier calls do not count
    res = BS.acceptance(gen, [[[1], [2]], [[3], [4]], [[5], [6]]], max_new_tokens=21)
    assert gen.stats["decode_steps"] == 49 + 3 * 10
    assert res["tokens_per_step"] == pytest.approx(2.0) and res["acceptance_rate"] == pytest.approx(0.5)
    assert (res["prompts"], res["new_tokens"]) == (6, 21)


def test_gpu_check_documents_and_names_every_mode():
    """``tools/gpu_check.sh``: each mode of its ``case`` is described in the header a newcomer reads, and the message
    for an unknown mode lists them all."""
    text = (ROOT / "tools/gpu_check.sh").read_text()
    header, body = text[:text.index("set -uo pipefail")], text[text.index('for what in "$@"'):]
    labels = set()
    for m in re.finditer(r"^\s{4}([a-z][a-z0-9|-]*)\)", body, re.M):
        labels.update(m.group(1).split("|"))
    documented = set(re.findall(r"^#   ([a-z][a-z0-9-]*) +\S", header, re.M))
    assert labels and labels <= documented, sorted(labels - documented)
    listed = re.search(r"unknown mode \$what \(([^)]*)\)", body).group(1).split("|")
    assert sorted(listed) == sorted(labels), (sorted(set(labels) - set(listed)), sorted(set(listed) - labels))
    assert len(labels) <= 12


def test_gpu_check_runs_the_shared_memory_poisoning_and_whole_gpu_tests_in_one_process():
    """Under xdist another process's kernels clear the poison between the fill and the launch, and a test that builds
    the Flash slice on the GPU (64 GiB) leaves 7 workers too little of an H100's 80 GB, so ``tests`` runs the tests
    marked ``smem_poison`` or ``whole_gpu`` without workers, and the rest with them. Every test that poisons, and every
    GPU test that builds the Flash slice, carries its mark."""
    import ast

    for f in ROOT.glob("tests/**/test_*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if node.__class__ is not ast.FunctionDef or not node.name.startswith("test_"):
                continue
            calls = {c.func.id for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
            marks = [ast.unparse(d) for d in node.decorator_list]
            if calls & {"poison_shared_memory", "shared_memory_seen_after_poison"}:
                assert "pytest.mark.smem_poison" in marks, f"{f.name}::{node.name} poisons shared memory, unmarked"
            if "flash_slice_config" in calls and "pytest.mark.gpu" in marks:
                assert "pytest.mark.whole_gpu" in marks, f"{f.name}::{node.name} builds the Flash slice, unmarked"
    text = (ROOT / "tools/gpu_check.sh").read_text()
    mode = text[text.index("    tests)"):]
    mode = mode[:mode.index(";;")].replace("\\\n", " ")  # one line a command
    serial = [line for line in mode.splitlines() if '"gpu and (smem_poison or whole_gpu)"' in line]
    assert serial and all("-n" not in line for line in serial)
    assert any('"gpu and not smem_poison and not whole_gpu"' in line and "-n" in line for line in mode.splitlines())


def test_bench_engine_smoke_measures_every_section_and_hits_the_shared_prefix(tmp_path):
    from benchmarks import bench_engine

    out = tmp_path / "engine.json"
    assert bench_engine.main(["--smoke", "--device", "cpu", "--admit-order", "arrival", "longest_output",
                              "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    # a step time by difference of two generate lengths: on shared CPU cores noise can flip its sign (it did once,
    # -124 ms), so the smoke run checks that both sides were timed, not their values
    assert all(math.isfinite(data["decode_b1"][k]) for k in ("engine_ms", "generator_ms"))
    # each question length hits the whole 64-token system prompt (two 32-position pages), never its own tail
    assert [(r["question_tokens"], r["cached_tokens"]) for r in data["prefix"]["runs"]] == [(8, 64), (32, 64)]
    assert data["prefix"]["question_tokens"] == 32 and data["prefix"]["cached_tokens"] == 64
    t = data["throughput"]
    assert t["requests"] == 8 and t["timed"]["finished"] == 8 and t["stats"]["recompiles"] == 0
    assert t["timed_compile_s"] == dict(engine=0.0, generator=0.0)
    runs = {r["admit_order"]: r for r in t["engine_runs"]}  # one engine, its admission changed between runs
    assert set(runs) == {"arrival", "longest_output"} and all(r["timed"]["finished"] == 8 for r in runs.values())
    assert runs["longest_output"]["timed"]["decode_steps"] <= runs["arrival"]["timed"]["decode_steps"]
    assert data["capacity"]["pages"] > 0
    mixed = data["capacity"]["mixed"]
    assert mixed["longest_tokens"] > mixed["per_row_longest_tokens"] > mixed["short_tokens"]


def test_bench_engine_keeps_the_static_baseline_and_each_finished_engine_run_when_cut_short(tmp_path, monkeypatch):
    """A GPU session's time can end inside the engine's compile: the static run (first) and every finished engine
    run are in the JSON by then."""
    from benchmarks import bench_engine

    out = tmp_path / "engine.json"
    real = bench_engine._engine_throughput
    calls = []

    def cut_on_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the run is cut here
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_engine, "_engine_throughput", cut_on_second)
    with pytest.raises(KeyboardInterrupt):
        bench_engine.main(["--smoke", "--device", "cpu", "--parts", "throughput", "--admit-order", "arrival",
                           "longest_output", "--out", str(out)])
    t = json.loads(out.read_text())["throughput"]
    assert t["generator_s"] > 0 and [r["admit_order"] for r in t["engine_runs"]] == ["arrival"]
    assert t["ratio"] == t["generator_s"] / t["engine_runs"][0]["engine_s"]


# ---- HF in place: bench_hf.py ----------------------------------------------------------------------------------------
def test_bench_hf_smoke_times_every_path_and_the_first_calls_of_new_shapes(tmp_path):
    from benchmarks import bench_hf

    res = bench_hf.main(["--smoke", "--parts", "steps", "stalls", "--out", str(tmp_path / "hf.json")])
    assert {(r["engine"], r["batch"]) for r in res["rows"]} == {
        (e, b) for e in ("HF eager (unpatched)", "enabled, eager", "dsv4_ops Generator") for b in (1, 2)}
    assert [(r["case"], r["prompt"], r["new_tokens"]) for r in res["stalls"]] == [
        ("warm shape", 40, 8), ("new prompt length", 64, 8), ("more new tokens", 40, 64)]
    for r in res["stalls"]:  # eager on the CPU: nothing compiles, nothing records
        assert r["dynamo_graphs"] == r["triton_compiles"] == r["cuda_graph_recordings"] == 0
        assert r["ratio"] == r["first_s"] / r["steady_s"] > 0


def test_bench_hf_model_hash_layers_spread_tokens_over_the_experts():
    # HF's init zeroes tid2eid: every token of a hash layer would run expert 0 only, and a timed step
    # would read one expert there
    import torch
    from benchmarks import bench_hf
    from dsv4_ops import DSV4Config

    cfg = DSV4Config.tiny()
    hf = bench_hf.hf_model(cfg, torch.float32, torch.device("cpu"))
    tables = [b for name, b in hf.named_buffers() if name.endswith("tid2eid")]
    assert tables and len(tables) == cfg.mlp_layer_types.count("hash_moe")
    for t in tables:
        assert t.min() >= 0 and t.max() < cfg.n_routed_experts
        assert t.unique().numel() == cfg.n_routed_experts  # vocab x top-k draws reach every expert


# ---- time to first token: bench_ttft.py ------------------------------------------------------------------------------
def test_bench_ttft_smoke_times_every_path_against_its_floor(tmp_path):
    from benchmarks import bench_ttft

    res = bench_ttft.main(["--smoke", "--device", "cpu", "--samples", "1", "--prefill-chunks", "default", "32",
                           "--out", str(tmp_path / "ttft.json")])
    rows = json.loads((tmp_path / "ttft.json").read_text())["rows"]
    assert rows == json.loads(json.dumps(res["rows"]))
    got = {(r["path"], r["batch"], r["prompt"], r["prefill_chunk"]) for r in rows}
    ours = {(p, b, n, c) for p in ("generator", "engine") for b, n in ((1, 24), (2, 40)) for c in (None, 32)}
    assert got == ours | {("hf_enabled", 1, 24, None), ("hf_eager", 1, 24, None)}
    for r in rows:
        assert "error" not in r and r["ms"] > 0 and r["first_call_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * r["prompt"] / r["ms"] * 1e3)
        f = r["floor"]
        assert f["floor_ms"] == max(f["compute_ms"], f["bytes_ms"]) > 0
        assert f["flops"] == pytest.approx(sum(f["flops_parts"].values()))


def test_the_prefill_floor_counts_attention_and_the_indexer_over_the_causal_prompt():
    """``attention_flops`` against a loop over the queries of a small config: each query's window, CSA picks of the
    visible compressed entries (at most top-k) or every visible HCA entry, and the CSA indexer over every visible
    key."""
    from benchmarks.bench_ttft import attention_flops
    from dsv4_ops import DSV4Config
    from dsv4_ops.config import CSA, HCA

    cfg = DSV4Config.tiny()
    P = 3 * cfg.sliding_window + 7
    attn = indexer = 0
    for t in range(1, P + 1):
        for kind in cfg.layer_types:
            n = min(t, cfg.sliding_window)
            if kind == CSA:
                n += min(t // cfg.csa_ratio, cfg.index_topk)
                indexer += (t // cfg.csa_ratio) * 2 * cfg.index_n_heads * cfg.index_head_dim
            elif kind == HCA:
                n += t // cfg.hca_ratio
            attn += n * 4 * cfg.num_attention_heads * cfg.head_dim
    assert CSA in cfg.layer_types and HCA in cfg.layer_types
    assert attention_flops(cfg, P) == (pytest.approx(attn), pytest.approx(indexer))
