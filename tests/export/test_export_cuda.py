"""GPU box: ``dsv4_ops.export`` on CUDA compiles our Triton kernels into the package, and the one
``torch.ops.dsv4`` op its programs still call is the CUDA top-k, ``dsv4::topk_rows_cuda`` (a C++ op of
dsv4_ops' native library, called through AOTInductor's proxy executor; none where the library is not
loaded); the package loaded by ``AOTIGenerator`` in a fresh process (CUDA-graphed decode) and by the
C++ runner (the library beside it, or given by ``--library``) generates the tokens of the eager and
of the CUDA-graphed ``Generator`` (fp32: exact).

torch 2.11 on the GPU box: loading a .pt2 segfaults in std::regex unless the process starts with
LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6, so loads run in subprocesses that set it."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import dsv4_ops
from dsv4_ops import DSV4Config, Generator, native
from dsv4_ops.ops import topk_cuda
from model_util import random_model
from package_case import CFG, LIMITS, NEW_TOKENS, PROMPTS

# the package case with FP8-cache widths (448 + 64 would be V4's; 128 nope dims = two scale blocks)
FP8_CFG = DSV4Config.tiny(head_dim=144, num_hidden_layers=3, hca_ratio=8)

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
LIBSTDCXX = "/usr/lib/x86_64-linux-gnu/libstdc++.so.6"
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
ENV.pop("DSV4_OPS_LIBRARY", None)  # the runner finds the library as each test says
if os.path.exists(LIBSTDCXX):
    ENV["LD_PRELOAD"] = LIBSTDCXX


@pytest.fixture(scope="module")
def cuda_case(tmp_path_factory):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = random_model(CFG, device="cuda", seed=21)
    graphed = Generator(model, compile=True, cuda_graphs=True, **LIMITS)
    graphed.generate(PROMPTS, max_new_tokens=3)  # warm-up: compile + record
    want = graphed.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    eager = Generator(model, compile=False, cuda_graphs=False, **LIMITS).generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    path = tmp_path_factory.mktemp("cuda_pkg") / "tiny_cuda.pt2"
    dsv4_ops.export(model, path, **LIMITS)
    return str(path), want, eager


def extern_targets(z: zipfile.ZipFile, program: str) -> list[str]:
    """The ops ``program`` calls through AOTInductor's proxy executor: the targets of the extern
    kernel nodes in the JSON beside its wrapper (``<wrapper>.json``; ``*_metadata.json`` is not one)."""
    targets = []
    for name in z.namelist():
        if f"/{program}/" in name and name.endswith(".json") and not name.endswith("_metadata.json"):
            data = json.loads(z.read(name))
            if isinstance(data, dict):
                targets += [node["node"]["target"] for node in data.get("nodes", [])]
    return targets


def test_cuda_package_holds_our_triton_kernels_and_calls_only_the_cuda_topk(cuda_case) -> None:
    path, _, _ = cuda_case
    z = zipfile.ZipFile(path)
    names = z.namelist()
    for program in ("prefill", "decode"):
        wrappers = [n for n in names if n.endswith(".wrapper.cpp") and f"/{program}/" in n]
        assert wrappers, names[:20]
        code = z.read(wrappers[0]).decode()
        for kernel in ("sparse_attention_kernel", "indexer_scores_kernel", "plan_kernel", "cache_write_kernel",
                       "compress_kernel", "sinkhorn_kernel"):
            assert kernel in code or any(kernel in n for n in names), f"{kernel} not compiled into {program}"
        # an op AOTInductor cannot compile is a call through the proxy executor: only the C++ top-k
        targets = {t.split(".")[0] for t in extern_targets(z, program)}
        if topk_cuda.available():
            assert targets == {"dsv4::topk_rows_cuda"}, f"{program} calls {sorted(targets)}"
            assert "proxy_executor_call_function" in code
        else:  # no native library in this process: the Triton top-k, no extern call
            assert not targets and "proxy_executor_call_function" not in code, sorted(targets)
    assert any(n.endswith(".cubin") for n in names)


def test_aoti_generator_on_cuda_equals_the_eager_and_the_graphed_generator(cuda_case) -> None:
    """A fresh process: importing dsv4_ops loads the native library, so the package's call of the
    CUDA top-k finds its op."""
    path, want, eager = cuda_case
    code = (f"import json, dsv4_ops; g = dsv4_ops.AOTIGenerator({path!r}); "
            f"out = g.generate({PROMPTS!r}, max_new_tokens={NEW_TOKENS}); "
            "print(json.dumps([out, g.stats['cuda_graph_replays']]))")
    res = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    tokens, replays = json.loads(res.stdout.strip().splitlines()[-1])
    assert tokens == want
    assert tokens == eager
    assert replays >= NEW_TOKENS - 2  # decode replayed as a CUDA graph after its first step


@pytest.mark.parametrize("library", ["beside", "flag"])
def test_cpp_runner_on_cuda_equals_the_graphed_generator(cuda_case, library) -> None:
    """The runner loads dsv4_ops' native library before the package: by itself, the checkout's
    beside it (``build/../dsv4_ops/_C*.so``, what ``pip install -e .`` built), or the one
    ``--library`` names."""
    path, want, _ = cuda_case
    if library == "flag" and not topk_cuda.available():
        pytest.skip(f"no native library to pass: {topk_cuda.unavailable_reason()}")
    build = subprocess.run(["make", "runner", f"RUNNER_PY={sys.executable}"], cwd=ROOT, env=ENV, capture_output=True,
                           text=True, timeout=900)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-3000:]
    cmd = [str(ROOT / "build" / "dsv4_run"), path, "--max-new-tokens", str(NEW_TOKENS)]
    for p in PROMPTS:
        cmd += ["--prompt", ",".join(map(str, p))]
    if library == "flag":
        cmd += ["--library", native.library_path()]
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [line for line in res.stdout.strip().splitlines() if re.fullmatch(r"[\d,]+", line)]
    assert [[int(t) for t in r.split(",")] for r in rows] == want
    assert "graph" in res.stderr.lower()  # it says it replays decode as a CUDA graph
    if topk_cuda.available():
        said = "(--library)" if library == "flag" else "(beside the runner)"
        assert re.search(rf"loaded \S+_C\S*\.so {re.escape(said)}", res.stderr), res.stderr[-2000:]


def test_fp8_cache_package_on_cuda_equals_the_graphed_fp8_generator(tmp_path) -> None:
    """``export(kv_cache_dtype="fp8")``: the package holds the FP8 pool layout, and ``AOTIGenerator``
    reading it generates the tokens of the CUDA-graphed ``Generator(kv_cache_dtype="fp8")`` (the
    same quantised cache, so exact)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = FP8_CFG
    model = random_model(cfg, device="cuda", seed=23)
    graphed = Generator(model, compile=True, cuda_graphs=True, kv_cache_dtype="fp8", **LIMITS)
    graphed.generate(PROMPTS, max_new_tokens=3)  # warm-up: compile + record
    want = graphed.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    path = str(tmp_path / "tiny_fp8.pt2")
    dsv4_ops.export(model, path, kv_cache_dtype="fp8", **LIMITS)
    code = (f"import json, dsv4_ops; g = dsv4_ops.AOTIGenerator({path!r}); "
            f"out = g.generate({PROMPTS!r}, max_new_tokens={NEW_TOKENS}); "
            "print(json.dumps([out, g.stats['cuda_graph_replays'], g.kv_cache_dtype]))")
    res = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    tokens, replays, kv_cache_dtype = json.loads(res.stdout.strip().splitlines()[-1])
    assert kv_cache_dtype == "fp8"
    assert tokens == want
    assert replays >= NEW_TOKENS - 2


def test_bf16_package_compiles_the_grouped_gemm_experts_and_equals_eager(tmp_path, tol) -> None:
    """bf16 on sm_90: a prefill chunk's (token, expert) assignments (4 rows x 16 tokens x top-2 = 128,
    more than the GEMV kernels take) go to ``torch._grouped_mm``, which AOTInductor calls through a
    C shim only from torch 2.12 on. The package compiles on any supported torch, and its prefill
    logits are the eager Generator's (which runs the grouped GEMMs) to bf16 rounding."""
    from dsv4_ops.lowering.aten import experts
    from dsv4_ops.lowering.triton.moe_gemv import MAX_ASSIGNMENTS
    E, D, inner = CFG.n_routed_experts, CFG.hidden_size, CFG.moe_intermediate_size
    x = torch.zeros(1, D, dtype=torch.bfloat16, device="cuda")
    w13 = x.new_zeros(E, 2 * inner, D)
    if not experts.grouped_mm_supported(x, w13, x.new_zeros(E, D, inner)):
        pytest.skip("torch._grouped_mm has no fast kernel on this GPU: the eager path is the blocked one too")
    assert LIMITS["max_batch_size"] * LIMITS["prefill_chunk"] * CFG.num_experts_per_tok > MAX_ASSIGNMENTS
    model = random_model(CFG, dtype=torch.bfloat16, device="cuda", seed=25)
    want = Generator(model, compile=False, **LIMITS).prefill(PROMPTS).cpu()
    path, logits = str(tmp_path / "tiny_bf16.pt2"), str(tmp_path / "logits.pt")
    dsv4_ops.export(model, path, **LIMITS)
    code = (f"import torch, dsv4_ops; g = dsv4_ops.AOTIGenerator({path!r}, speculative=False); "
            f"torch.save(g.prefill({PROMPTS!r}).cpu(), {logits!r})")
    res = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = torch.load(logits)
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert (got - want).abs().max() <= tol("exported_vs_eager_bf16")["rel"] * want.abs().max()
