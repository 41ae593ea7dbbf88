"""On an sm_90 GPU, bf16 decode attention at V4's widths (64 heads x 512 dims, float caches)
runs the Gluon kernel (``dsv4::sparse_attention_sm90``, routed to by ``dsv4::sparse_attention``):
its output equals the float64 oracle within bf16's tolerance for every entry kind (window rows
with -1 sentinels, top-k picks, a dense prefix, empty segments, many splits at batch 1), it
is what runs in eager calls, in compiled graphs and in CUDA-graph replays, it steps aside while
torch exports (AOTInductor packages keep the Triton kernel), and with the route off the Triton kernel
runs instead. A model at V4's attention widths decodes with it within bf16 noise of the Triton path."""
import contextlib
import re

import pytest
import torch
from torch.library import opcheck

import dsv4_ops
from dsv4_ops import DSV4Config, Generator
from dsv4_ops.ops import attention_sm90 as sm90
from model_util import random_model
from routes import triton_attention

I32 = torch.int32
SM90 = torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not SM90, reason="the Gluon attention serves sm_90 GPUs only")]
H, D = 64, 512


def flash_inputs(B, W=128, K=512, Nc=2048, N=256, prefix=0, seed=0):
    """Random bf16 decode inputs at V4 widths: window rows (some -1), picks (some -1), and a dense
    prefix of up to ``prefix`` entries (row 0 none)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = dict(device="cuda")
    q = torch.randn(B, 1, H, D, generator=g, **dev).bfloat16()
    kv = torch.randn(B, N, D, generator=g, **dev).bfloat16()
    cmp = torch.randn(B, Nc, D, generator=g, **dev).bfloat16()
    kv_idx = torch.randint(-1, N, (B, 1, W), generator=g, dtype=I32, **dev)
    cmp_idx = torch.randint(-1, max(Nc, 1), (B, 1, K), generator=g, dtype=I32, **dev) if Nc else \
        torch.full((B, 1, K), -1, dtype=I32, **dev)
    cmp_len = torch.randint(0, prefix + 1, (B, 1), generator=g, dtype=I32, **dev)
    cmp_len[0] = 0
    sink = torch.randn(H, generator=g, **dev)
    return [q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, D ** -0.5]


def oracle(q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, scale):
    """Per query: list its entries, softmax against the sink in float64."""
    B = q.shape[0]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for b in range(B):
        ents = [kv[b, kv_idx[b, 0][kv_idx[b, 0] >= 0].long()], cmp[b, cmp_idx[b, 0][cmp_idx[b, 0] >= 0].long()],
                cmp[b, :int(cmp_len[b, 0])]]
        e = torch.cat(ents).double()
        if e.shape[0] == 0:
            continue
        logits = scale * q[b, 0].double() @ e.T
        top = torch.maximum(logits.max(-1).values, sink.double())
        w = torch.exp(logits - top[:, None])
        out[b, 0] = (w @ e) / (w.sum(-1) + torch.exp(sink.double() - top))[:, None]
    return out


CASES = {
    "csa": dict(B=4),  # window + top-512 picks (the CSA decode of the Flash slice)
    "hca": dict(B=3, K=0, prefix=2048),  # window + the whole pool as a dense prefix
    "mixed": dict(B=3, prefix=1500),  # all three entry kinds
}
EDGE_CASES = {
    "sliding": dict(B=2, K=0, Nc=0),  # window only (no pool at all)
    "one_token_many_splits": dict(B=1, prefix=2048),  # split-KV: one program per 64-row chunk
    "short_window": dict(B=2, W=5, K=3, Nc=7, N=9),  # blocks mostly masked, segments inside one block
}


def test_sparse_attention_sm90_opcheck():
    opcheck(torch.ops.dsv4.sparse_attention_sm90, flash_inputs(B=2, W=16, K=32, Nc=64, N=32, prefix=40))


def test_sparse_attention_sm90_fake_matches_real(fake_check):
    fake_check(torch.ops.dsv4.sparse_attention_sm90, *flash_inputs(B=2, prefix=100))


@pytest.mark.parametrize("case", list(CASES))
def test_sparse_attention_sm90_matches_reference(case, tol):
    _check_route(flash_inputs(**CASES[case]), tol)


@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_sparse_attention_sm90_edge_cases(case, tol):
    _check_route(flash_inputs(**EDGE_CASES[case]), tol)


@pytest.mark.parametrize("splits", [1, 2, 5])
@pytest.mark.parametrize("case", ["mixed", "short_window"])
def test_the_kernel_matches_the_oracle_at_forced_splits(case, splits, tol):
    """The kernel at forced split counts, on all entry kinds and on mostly-masked blocks (splits
    with no block at all at 5): within bf16's tolerance of the oracle, and within bf16 noise of
    the Triton kernel."""
    from dsv4_ops.lowering.gluon.sparse_attention import sparse_attention_gluon
    args = flash_inputs(**{**CASES, **EDGE_CASES}[case])
    out = sparse_attention_gluon(*args, num_splits=splits)
    torch.testing.assert_close(out.double(), oracle(*args), **tol(torch.bfloat16))
    with triton_attention():
        other = dsv4_ops.sparse_attention(*args)
    assert (out.float() - other.float()).abs().max() <= tol("gluon_vs_triton_bf16")["atol"]


# rows from HBM and L2-resident rows (the first block's rows then land about as fast as q does)
STALE_SMEM_CASES = {
    "pool_in_hbm": dict(B=132, prefix=1500),  # one program per SM at one split; 280 MB of pool rows
    "window_in_l2": dict(B=132, K=0, Nc=0),  # 17 MB of window rows, L2-resident after the oracle
    "two_queries": dict(B=2, K=0, Nc=0),  # the model test's sliding-window call
}


@pytest.mark.smem_poison
def test_poisoned_shared_memory_is_what_the_next_kernel_finds():
    """The premise of the test below: shared memory survives from one kernel to the next, so a
    kernel launched after the poison finds NaN where it has not written. Up to 20 tries, one of
    which must see it: under pytest-xdist other processes' kernels can run on the SMs between the
    poison and the peek (session 25 saw 0.0 twice in a row under -n 8 on one GPU)."""
    from smem_poison import shared_memory_seen_after_poison
    seen = []
    while len(seen) < 20 and (not seen or seen[-1] <= 0.99):
        seen.append(shared_memory_seen_after_poison())
    assert seen[-1] > 0.99, f"no try found the poison: {seen}"


@pytest.mark.smem_poison
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("case", list(STALE_SMEM_CASES))
def test_the_kernel_reads_no_shared_memory_it_has_not_written(case, splits, tol):
    """Shared memory keeps whatever the SM's previous kernel left. A kernel that reads shared
    memory it never wrote (a masked lane, a ring slot or a bias it skips) or before its writers
    stored it still passes back-to-back checks, finding its own previous values there; with
    every SM's shared memory filled with NaN before each launch it reads NaN. A missing barrier
    is caught only when the race is lost: a kernel that lacked one after staging q passed this
    test on the H200 all the same."""
    from dsv4_ops.lowering.gluon.sparse_attention import sparse_attention_gluon
    from smem_poison import poison_shared_memory
    args = flash_inputs(**STALE_SMEM_CASES[case])
    want = oracle(*args)
    for _ in range(16):
        poison_shared_memory()
        out = sparse_attention_gluon(*args, num_splits=splits)
        assert out.isfinite().all(), "the kernel read shared memory it had not written"
        torch.testing.assert_close(out.double(), want, **tol(torch.bfloat16))


def test_sparse_attention_sm90_edge_case_a_query_with_no_entries_gets_zeros():
    args = flash_inputs(B=2)
    args[2][1].fill_(-1)
    args[4][1].fill_(-1)
    out = torch.ops.dsv4.sparse_attention_sm90(*args)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and out[0].abs().sum() > 0


@pytest.mark.parametrize("arg, change, message", [
    ("q", lambda a: [a[0].half()] + a[1:], "q must be bf16"),
    ("q", lambda a: [a[0][:, :, :32].contiguous()] + a[1:6] + [a[6][:32], a[7]], "H (q.shape[2]) must be 64"),
    ("kv_idx", lambda a: a[:2] + [a[2].long()] + a[3:], "kv_idx must be int32"),
    ("sink", lambda a: a[:6] + [a[6][:10], a[7]], "sink must have 64 entries"),
])
def test_sparse_attention_sm90_rejects_bad_input(arg, change, message):
    """The raw Gluon op serves one case; anything else is refused naming the argument (the
    public op never routes such inputs here)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        torch.ops.dsv4.sparse_attention_sm90(*change(flash_inputs(B=2)))


def _check_route(args, tol):
    before = sm90.stats["launches"]
    out = dsv4_ops.sparse_attention(*args)
    assert sm90.stats["launches"] == before + 1, "the Gluon kernel did not run"
    assert out.shape == args[0].shape and out.dtype == torch.bfloat16 and out.is_contiguous()
    torch.testing.assert_close(out.double(), oracle(*args), **tol(torch.bfloat16))
    with triton_attention():
        triton_out = dsv4_ops.sparse_attention(*args)
    assert sm90.stats["launches"] == before + 1, "the Triton route ran the Gluon kernel"
    # two fp32 softmaxes over the same bf16 rows: they differ by the rounding of P to bf16
    assert (out.float() - triton_out.float()).abs().max() <= tol("gluon_vs_triton_bf16")["atol"]


@pytest.mark.parametrize("why, change", [
    ("prefill (S > 1)", lambda a: [a[0].expand(-1, 2, -1, -1).contiguous(), a[1], a[2].expand(-1, 2, -1).contiguous(),
                                   a[3], a[4].expand(-1, 2, -1).contiguous(), a[5].expand(-1, 2).contiguous()] + a[6:]),
    ("fp16", lambda a: [a[0].half(), a[1].half(), a[2], a[3].half()] + a[4:]),
    ("32 heads", lambda a: [a[0][:, :, :32].contiguous()] + a[1:6] + [a[6][:32], a[7]]),
])
def test_other_shapes_and_dtypes_keep_the_triton_kernel(why, change, tol):
    args = change(flash_inputs(B=2))
    before = sm90.stats["launches"]
    out = dsv4_ops.sparse_attention(*args)
    assert sm90.stats["launches"] == before, f"{why} ran the Gluon kernel"
    assert out.shape == args[0].shape and out.isfinite().all()


def test_compiled_and_cuda_graphed_calls_run_the_gluon_kernel():
    """Inductor cannot inline a Gluon kernel: the compiled graph calls the op (an extern call),
    and a CUDA graph of the compiled function replays it. Same kernel, same inputs: same bits."""
    check_compiled_and_graphed(lambda seed: flash_inputs(B=8, prefix=512, seed=seed))


def check_compiled_and_graphed(make_args):
    """``make_args(seed)``'s call through a compiled graph and a CUDA-graph replay of it (on
    fresh inputs copied in) equals the eager call bit for bit, and the graph runs the Gluon op."""
    torch._dynamo.reset()
    args = make_args(1)
    want = torch.ops.dsv4.sparse_attention(*args)
    fn = torch.compile(torch.ops.dsv4.sparse_attention, fullgraph=True)
    before = sm90.stats["launches"]
    assert torch.equal(fn(*args), want)
    assert sm90.stats["launches"] > before, "the compiled graph did not call the Gluon kernel"

    static = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    fn(*static)  # warm-up on the capture stream's inputs
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static)
    fresh = make_args(2)
    for s, f in zip(static, fresh):
        if isinstance(s, torch.Tensor):
            s.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.ops.dsv4.sparse_attention(*fresh))
    torch._dynamo.reset()


def test_the_route_steps_aside_while_torch_exports_and_graphs_then_keep_the_triton_kernel():
    """What ``dsv4_ops.export`` relies on: while torch exports (``torch.export`` and AOTInductor's compile, where
    ``torch.compiler.is_exporting()`` is true) the route does not apply, so a package never calls the Gluon op (its
    C++ runtime could not); with the route off, a compiled graph computes the Triton kernel's bits."""
    args = flash_inputs(B=4, prefix=256, seed=3)
    assert sm90.applies(*args[:6])
    from torch._export.utils import _compiling_state_context  # what both enter

    with _compiling_state_context():
        assert torch.compiler.is_exporting() and not sm90.applies(*args[:6])
    torch._dynamo.reset()
    with triton_attention():
        want = torch.ops.dsv4.sparse_attention(*args)
        fn = torch.compile(torch.ops.dsv4.sparse_attention, fullgraph=True)
        before = sm90.stats["launches"]
        got = fn(*args)
    assert sm90.stats["launches"] == before
    assert torch.equal(got, want)
    torch._dynamo.reset()


V4_ATTENTION = DSV4Config.tiny(head_dim=512, rope_head_dim=64, num_attention_heads=64, o_groups=8,
                               sliding_window=128, index_n_heads=64, index_head_dim=128, index_topk=512,
                               num_hidden_layers=3, hca_ratio=128, max_position_embeddings=8192)


def test_model_at_v4_attention_widths_decodes_with_the_gluon_kernel(tol):
    """bf16, 3 layers (sliding, CSA, HCA), prefill of 2100 tokens then 8 decode steps: each Gluon
    call within bf16 rounding of the Triton kernel on the same inputs, and the Gluon route's logits
    within the model's rounding noise of the Triton route's, eagerly and compiled + CUDA-graphed
    (no recompiles; the replays are where the decode time goes)."""
    check_model_decode("auto", tol)


# the model test's Generator (besides its cache dtype) and decode
GENERATOR_OPTIONS = dict(max_batch_size=2, max_seq_len=2200, prefill_chunk=64)
DECODE_STEPS = 8
# Rounding alone moves the test model's logits far: attention outputs one bf16 ulp from another
# kernel's moved them by 2.1e-2 to 1.8e-1 (H200, 6 seeds; 2.1e-2 to 1.9e-1 on the CPU's kernels, 3
# seeds), while head 0 of 64 zeroed moved them 6.9e-1 and outputs one step stale 1.6 (CPU;
# BENCHMARKS.md session 20). So the logits bound is about twice the noise seen
# and half the one-head error; the kernel itself is checked call by call (check_model_decode)
LOGITS_BOUND = 0.35


def model_test_decode(gen, steps=DECODE_STEPS):
    """Prefill of 2100- and 700-token prompts, then ``steps`` decode steps: the logits, float."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, V4_ATTENTION.vocab_size, (n,), generator=g).tolist() for n in (2100, 700)]
    feed = torch.randint(0, V4_ATTENTION.vocab_size, (steps, 2), generator=g).to(gen.device)
    gen.prefill(prompts)
    return torch.stack([gen.decode(feed[t]) for t in range(steps)], 1).float()


@contextlib.contextmanager
def gluon_calls_recorded():
    """Every Gluon attention launch (bf16 and FP8 launchers) meanwhile, as (inputs, output) clones."""
    from dsv4_ops.lowering.gluon import sparse_attention as bf16_launchers  # the modules the op calls
    from dsv4_ops.lowering.gluon import sparse_attention_fp8 as fp8_launchers
    calls = []
    real = bf16_launchers.sparse_attention_gluon, fp8_launchers.sparse_attention_gluon_fp8

    def recording(launch):
        def launch_and_record(*args, **kw):
            out = launch(*args, **kw)
            calls.append(([a.clone() if torch.is_tensor(a) else a for a in args[:8]], out.clone()))
            return out
        return launch_and_record

    bf16_launchers.sparse_attention_gluon, fp8_launchers.sparse_attention_gluon_fp8 = map(recording, real)
    try:
        yield calls
    finally:
        bf16_launchers.sparse_attention_gluon, fp8_launchers.sparse_attention_gluon_fp8 = real


def check_model_decode(kv_cache_dtype, tol):
    """The V4-width model's decode with ``kv_cache_dtype``: every Gluon call inside it against the
    Triton kernel on that call's inputs; Gluon route vs Triton route, eager and compiled +
    CUDA-graphed."""
    m = random_model(V4_ATTENTION, dtype=torch.bfloat16, device="cuda")
    kw = dict(GENERATOR_OPTIONS, kv_cache_dtype=kv_cache_dtype)

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    with gluon_calls_recorded() as calls:
        gluon = model_test_decode(Generator(m, compile=False, **kw))
    print(f"{kv_cache_dtype} cache: Gluon launches over {DECODE_STEPS} decode steps of 3 layers: {len(calls)}")
    assert len(calls) >= 2 * DECODE_STEPS  # the CSA and HCA layers, every step
    with triton_attention():
        triton = model_test_decode(Generator(m, compile=False, **kw))
        # the kernel on the model's own inputs (its caches, strides, -1 holes and split counts):
        # within bf16 rounding of the Triton kernel, call by call, where no upstream noise can hide
        # or inflate a difference (the logits below amplify rounding; BENCHMARKS.md, session 20)
        worst = max(rel(out.float(), torch.ops.dsv4.sparse_attention(*args).float()) for args, out in calls)
    print(f"{kv_cache_dtype} cache: Gluon vs Triton kernel on each call's inputs, max rel err {worst:.2e}")
    assert worst <= tol("gluon_vs_triton_bf16")["rel"]
    err = rel(gluon, triton)
    print(f"V4 attention widths, {kv_cache_dtype} cache: Gluon vs Triton decode logits, max rel err {err:.2e}")
    # measured: ws 4.2e-3, v3 1.9e-2 (H200); the bound is the noise's, not the kernel's (LOGITS_BOUND)
    assert gluon.isfinite().all() and err <= LOGITS_BOUND

    gen = Generator(m, compile=True, cuda_graphs=True, **kw)
    before = sm90.stats["launches"]
    model_test_decode(gen)  # compile + record: the compiled decode graph calls the Gluon op
    assert sm90.stats["launches"] > before
    with torch.compiler.set_stance("fail_on_recompile"):
        graphed = model_test_decode(gen)
    assert gen.stats["recompiles"] == 0 and gen.stats["cuda_graph_replays"] > 0
    err = rel(graphed, gluon)
    print(f"{kv_cache_dtype} cache, compiled + CUDA-graphed vs eager (both Gluon): max rel err {err:.2e}")
    # Inductor fuses the bf16 elementwise chains around attention in fp32 (one rounding where eager
    # rounds at each op): 2.97e-2 on the H200 with v3 (session 12), 2.11e-2 with ws (session 20);
    # rounding moves these logits as far as the eager comparison's note says
    assert err <= LOGITS_BOUND

