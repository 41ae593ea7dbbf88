"""``dsv4_ops.export`` writes ONE .pt2 with the prefill, decode and speculative programs;
``AOTIGenerator`` loads it in a fresh process (no torch.compile, no model code) and generates
exactly the eager ``Generator``'s greedy tokens for a ragged batch, with and without MTP
speculation; the exported decode graph writes the KV pool in place (pinned op list, no pool
copies); bad packages and inputs past the exported limits give clear errors."""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import zipfile

import pytest
import torch
from expecttest import assert_expected_inline

import dsv4_ops
from dsv4_ops import AOTIGenerator, Generator
from dsv4_ops.aoti_export import PROGRAMS, SPEC_PROGRAMS, _CachedStep, exported_program, parse_cache_spec
from dsv4_ops.model.plan import ring_sizes

from package_case import CFG, LIMITS, NEW_TOKENS, PACKAGE_CHUNKS, PROMPTS, SPEC_STEPS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_package_holds_both_programs_and_its_limits(tiny_package) -> None:
    names = zipfile.ZipFile(tiny_package).namelist()
    for program in PROGRAMS + SPEC_PROGRAMS + ("prefill_16", "spec_prefill_16"):
        assert any(f"/data/aotinductor/{program}/" in n and n.endswith(".so") for n in names), program
    gen = AOTIGenerator(tiny_package)
    meta = gen.metadata
    assert (gen.max_batch_size, gen.max_seq_len, gen.prefill_chunk, gen.spec_steps) == (4, 96, 32, SPEC_STEPS)
    assert gen.prefill_chunks == list(PACKAGE_CHUNKS)  # prefill_16 and spec_prefill_16 beside them
    assert gen.speculative and not AOTIGenerator(tiny_package, speculative=False).speculative
    assert meta["dsv4.vocab_size"] == str(CFG.vocab_size) and meta["dsv4.device"] == "cpu"
    specs = parse_cache_spec(meta["dsv4.cache"])
    # sliding: window; CSA: window + 2 rings + pool + 2 indexer rings + indexer pool; HCA: window + 2 rings + pool
    assert len(specs) == 1 + 7 + 4 == len(gen.cache)
    # rings have room for the speculative lookahead; the MTP block has its own window ring
    assert specs[0] == (torch.float32, (4, CFG.sliding_window + SPEC_STEPS, CFG.head_dim))
    assert parse_cache_spec(meta["dsv4.mtp_cache"]) == [(torch.float32, (4, CFG.sliding_window + SPEC_STEPS + 1,
                                                                          CFG.head_dim))]


@pytest.mark.parametrize("speculative", [False, True], ids=["decode", "mtp_spec"])
def test_fresh_process_generates_the_eager_tokens(tiny_package, eager_tokens, speculative) -> None:
    code = (f"import json, dsv4_ops; g = dsv4_ops.AOTIGenerator({tiny_package!r}, speculative={speculative}); "
            f"print(json.dumps(g.generate({PROMPTS!r}, max_new_tokens={NEW_TOKENS})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    tokens = json.loads(out.stdout.strip().splitlines()[-1])
    assert tokens == eager_tokens
    assert len({t for row in tokens for t in row}) > 5  # not a degenerate stream


def test_sampling_and_stop_ids_match_the_eager_generator(tiny_model, tiny_package, eager_tokens) -> None:
    """Sampling runs on the exported decode program's logits with the same counter-based RNG:
    the eager Generator's seeded tokens, per-request lengths and stop ids."""
    stop = eager_tokens[1][2]
    kw = dict(max_new_tokens=[NEW_TOKENS] + [4] * (len(PROMPTS) - 1), temperature=0.8, top_p=0.9, seed=3)
    want = Generator(tiny_model, compile=False, **LIMITS).generate(PROMPTS, **kw)
    gen = AOTIGenerator(tiny_package, speculative=False)
    assert gen.generate(PROMPTS, **kw) == want
    assert want != eager_tokens
    stopped = gen.generate(PROMPTS, max_new_tokens=NEW_TOKENS, eos_token_id=stop)
    assert stopped[1] == eager_tokens[1][: eager_tokens[1].index(stop) + 1]


def test_prefill_and_decode_logits_equal_eager(tiny_model, tiny_package, tol) -> None:
    gen = AOTIGenerator(tiny_package, speculative=False)
    eager = dsv4_ops.Generator(tiny_model, compile=False, **LIMITS)
    ran, run = [], gen._run
    gen._run = lambda name, *inputs: (ran.append(name), run(name, *inputs))[1]
    a, b = gen.prefill(PROMPTS), eager.prefill(PROMPTS)
    assert ran == ["prefill", "prefill_16"]  # 37 tokens: a step of 32, then the smallest chunk for the 5 left
    torch.testing.assert_close(a, b, **tol("exported_vs_eager"))
    for _ in range(20):
        ids = b.argmax(-1)
        a, b = gen.decode(ids), eager.decode(ids)
        torch.testing.assert_close(a, b, **tol("exported_vs_eager"))
    s = gen.stats
    assert s["decode_steps"] == 20 and s["tokens_generated"] == 3 + 20 * 3 and s["decode_tokens_per_s"] > 0
    assert s["recompiles"] == s["graph_breaks"] == 0


def decode_program(model):
    rings = ring_sizes(CFG)
    states = [layer.self_attn.new_state(LIMITS["max_batch_size"], LIMITS["max_seq_len"], rings)
              for layer in model.model.layers]
    layout = [list(s.tensors()) for s in states]
    cache = [t for s in states for t in s.tensors().values()]
    B = LIMITS["max_batch_size"]
    return exported_program(_CachedStep(model, layout, rings), (torch.zeros(B, dtype=torch.long),
                            torch.ones(B, dtype=torch.int32), torch.zeros(B, dtype=torch.int32), cache))


@pytest.mark.skipif(not torch.__version__.startswith("2.13"), reason="op list pinned on CI's torch 2.13")
def test_exported_decode_graph_writes_the_pool_in_place(tiny_model) -> None:
    ep = decode_program(tiny_model)
    ops = collections.Counter(str(n.target) for n in ep.graph.nodes if n.op == "call_function")
    dsv4 = " ".join(f"{k.split('.')[1]}x{v}" for k, v in sorted(ops.items()) if k.startswith("dsv4."))
    assert_expected_inline(dsv4, """cache_writex9 compressx3 gemvx32 indexer_topkx1 moe_gemvx3 planx1 sinkhornx6 sparse_attentionx3""")
    # functionalised (what AOTInductor compiles): every pool write is an auto_functionalized op on
    # a WHOLE input (re-inplaced by Inductor), nothing copies or scatters into a pool view
    fep = ep.run_decompositions({})
    mutated = sorted(set(fep.graph_signature.user_inputs_to_mutate.values()))
    assert mutated == sorted(["lengths"] + [f"cache_{i}" for i in range(12)])
    placeholders = {n.name for n in fep.graph.nodes if n.op == "placeholder" and n.name.startswith("cache")}
    fops = collections.Counter(str(n.target) for n in fep.graph.nodes if n.op == "call_function")
    assert fops["auto_functionalized_v2"] == 12  # 9 cache_write + 3 compress
    assert not [k for k in fops if "slice_scatter" in k or "select_scatter" in k or "index_put" in k]
    for n in fep.graph.nodes:
        if n.op == "call_function" and str(n.target) in ("aten.clone.default", "aten.copy.default"):
            assert n.args[0].name not in placeholders, f"{n.name} copies the pool tensor {n.args[0].name}"


def test_cpp_runner_prints_the_eager_tokens(tiny_package, eager_tokens) -> None:
    build = subprocess.run(["make", "-C", ROOT, "runner", f"RUNNER_PY={sys.executable}"], capture_output=True,
                           text=True, timeout=900)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-3000:]
    cmd = [os.path.join(ROOT, "build", "dsv4_run"), tiny_package, "--max-new-tokens", str(NEW_TOKENS), "--quiet"]
    for p in PROMPTS:
        cmd += ["--prompt", ",".join(map(str, p))]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [[int(t) for t in line.split(",")] for line in out.stdout.split()] == eager_tokens


# --------------------------------------------------------------------------------------
# bad packages and inputs
# --------------------------------------------------------------------------------------
def test_missing_and_corrupt_packages_give_clear_errors(tmp_path, tiny_package) -> None:
    with pytest.raises(FileNotFoundError, match="no package at .*nope.pt2"):
        AOTIGenerator(tmp_path / "nope.pt2")
    junk = tmp_path / "junk.pt2"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match="not a .pt2 package"):
        AOTIGenerator(junk)
    truncated = tmp_path / "truncated.pt2"
    truncated.write_bytes(open(tiny_package, "rb").read()[:100_000])
    with pytest.raises(ValueError, match="not a .pt2 package|cannot load"):
        AOTIGenerator(truncated)
    other = tmp_path / "other.pt2"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("archive/data/hello.txt", "not a model")
    with pytest.raises(ValueError, match="cannot load .* as an AOTInductor package"):
        AOTIGenerator(other)
    with pytest.raises(ValueError, match="exported for cpu; it cannot run on cuda"):
        AOTIGenerator(tiny_package, device="cuda")


def plain_prefilled(g: AOTIGenerator) -> AOTIGenerator:
    plain = AOTIGenerator(g.path, speculative=False)
    plain.prefill([[1], [2]])
    return plain


@pytest.mark.parametrize("call, match", [
    (lambda g: g.prefill([[1]] * 5), r"5 prompts > max_batch_size 4"),
    (lambda g: g.prefill([[1] * 97]), r"prompts\[0\] has 97 tokens > max_seq_len 96"),
    (lambda g: g.generate([[1] * 90], max_new_tokens=8), r"> max_seq_len 96"),
    (lambda g: g.prefill([[1, 256]]), r"token id 256 .*vocab_size=256"),
    (lambda g: AOTIGenerator(g.path, speculative=False).decode(torch.tensor([1])), "call prefill first"),
    (lambda g: (g.prefill([[1], [2]]), g.decode(torch.tensor([1, 2])))[1], "use generate"),
    (lambda g: plain_prefilled(g).decode(torch.tensor([1, 999])), r"next_ids\[1\] = 999 is outside"),
    (lambda g: plain_prefilled(g).decode(torch.tensor([1])), r"next_ids must have shape \[2\]"),
    (lambda g: g.generate([[1]], max_new_tokens=0), "max_new_tokens must be an int >= 1"),
    (lambda g: g.generate([[1]], max_new_tokens=4, temperature=0.7), r"temperature > 0 with speculative decoding "
                                                                       "is not supported by AOTIGenerator"),
])  # fmt: skip
def test_inputs_past_the_exported_limits_are_rejected(tiny_package, eager_tokens, call, match) -> None:
    gen = AOTIGenerator(tiny_package)
    with pytest.raises(ValueError, match=match):
        call(gen)
    assert gen.generate(PROMPTS[:1], max_new_tokens=5) == [eager_tokens[0][:5]]  # still usable


class _Exported(Exception):
    pass


@pytest.mark.parametrize("batch, max_seq_len, chunks", [(1, 8192, [64, 256, 1024, 2048, 4096]),
                                                        (4, 4096, [64, 256, 1024, 2048]), (8, 4096, [64, 256, 1024]),
                                                        (64, 4096, [64]), (2, 100, [64, 100])])
def test_the_default_prefill_programs_are_the_chunk_buckets_a_step_of_the_batch_may_take(
        tmp_path, monkeypatch, batch, max_seq_len, chunks) -> None:
    """Without ``prefill_chunk``, a package has a prefill program for each of ``Generator``'s chunk
    buckets that a full batch may take under its default token budget (8192 a step), capped at
    ``max_seq_len``; the largest is ``prefill``, the others ``prefill_<C>``."""
    shapes = {}

    class Program:  # what aot_compile is given (never compiled here)
        example_inputs = ((), {})

        def module(self):
            return None

    def exported(module, args):
        if args[0].dim() == 1:  # the decode program: every prefill program came before it
            raise _Exported
        shapes[len(shapes)] = tuple(args[0].shape)
        return Program()

    monkeypatch.setattr(dsv4_ops.aoti_export, "exported_program", exported)
    monkeypatch.setattr(torch._inductor, "aot_compile", lambda *args, **kwargs: "unused")
    model = dsv4_ops.DeepseekV4ForCausalLM(dsv4_ops.DSV4Config.tiny()).eval()
    with pytest.raises(_Exported):
        dsv4_ops.export(model, tmp_path / "m.pt2", max_batch_size=batch, max_seq_len=max_seq_len, verbose=False)
    assert list(shapes.values()) == [(batch, c) for c in chunks]


def test_export_rejects_bad_arguments(tiny_model, tmp_path) -> None:
    with pytest.raises(ValueError, match="path must end in .pt2"):
        dsv4_ops.export(tiny_model, tmp_path / "m.zip")
    with pytest.raises(ValueError, match="max_batch_size must be an int >= 1, got 0"):
        dsv4_ops.export(tiny_model, tmp_path / "m.pt2", max_batch_size=0)
    with pytest.raises(ValueError, match="spec_steps must be an int >= 0, got -1"):
        dsv4_ops.export(tiny_model, tmp_path / "m.pt2", spec_steps=-1)
    for chunk in (2.5, "16", [16, 0], []):
        with pytest.raises(ValueError, match="export: prefill_chunk must be"):
            dsv4_ops.export(tiny_model, tmp_path / "m.pt2", prefill_chunk=chunk)
    assert not os.path.exists(tmp_path / "m.pt2")
