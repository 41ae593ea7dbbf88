"""The CUDA branch of every op body, traced the way AOTDispatch traces a triton_op (under
FunctionalTensorMode), without a GPU: one ``triton_kernel_wrapper_functional`` node per kernel
launch, no ``dsv4`` op left in the graph, and Triton's TTIR mutation analysis (run for sm_90)
finds exactly the tensors each kernel writes -- never the "assuming every input is mutated"
fallback, which costs copies or, in some versions, drops the kernel. And torch's own kernel
discovery (which keys AOTAutograd's cache on the kernels' source) finds every kernel of every
op body, with no registration by hand.

The trace runs in a subprocess without ``TRITON_INTERPRET`` (conftest sets it for this process;
interpreted kernels cannot be wrapped), on ``meta`` tensors with the op bodies' device check
widened to ``meta`` and Triton's active driver replaced by one that reports an sm_90 target.
Inductor's code generation itself is checked on the GPU box (tests/runtime/test_inductor_codegen.py).
"""
import json
import os
import sys

import pytest
from compiled_worker import ROOT, run_worker


# (kernel, tensors_to_clone) of every launch of the step below, in order
EXPECTED = [
    ("plan_kernel", ["csa_emit_ptr", "csa_len_ptr", "csa_write_ptr", "hca_emit_ptr", "hca_len_ptr", "hca_write_ptr",
                     "pos_ptr", "win_idx_ptr", "win_write_ptr"]),
    ("cache_write_kernel", ["cache_ptr"]),
    ("compress_kernel", ["pool_ptr"]),
    ("cache_write_kernel", ["cache_ptr"]),
    ("cache_write_kernel", ["cache_ptr"]),
    ("indexer_scores_kernel", ["out_ptr"]),
    ("topk_row_kernel", ["out_ptr"]),  # rows of up to 16K scores; longer rows: topk_kernel
    ("sparse_attention_kernel", ["out_ptr"]),  # CSA: window + picks, one pass
    ("sparse_attention_kernel", ["part_acc_ptr", "part_l_ptr", "part_m_ptr"]),  # HCA: split-KV partials
    ("combine_kernel", ["out_ptr"]),
    ("moe_gate_up_kernel", ["h_ptr"]),  # routed experts of the step's tokens
    ("moe_down_kernel", ["out_ptr"]),
    ("gemv_kernel", ["y_ptr"]),  # a grouped projection of one token, rows wide enough for the kernel
]


def _worker():
    import logging

    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(ROOT))
    import torch
    import triton
    from triton.backends.compiler import GPUTarget

    class Sm90Driver:  # only what the TTIR analysis asks of the driver
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    triton.runtime.driver.set_active(Sm90Driver())

    import dsv4_ops
    from dsv4_ops import lowering
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    lowering.BACKEND = "triton"
    lowering.use_triton = lambda device_type: device_type in ("cuda", "meta")
    warnings = []

    class Keep(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    for name in ("torch", "torch._dynamo", "torch._higher_order_ops"):
        logging.getLogger(name).addHandler(Keep(level=logging.WARNING))

    B, S, H, D, HI, DI = 2, 4, 4, 64, 4, 32

    def step(lengths, n_new, q, kv_new, ckv, cgate, iq, iw, sink, norm_w, cos, sin, win, ring_kv, ring_gate, pool,
             ikeys, x, experts, router_w, w13, w2, xg, wg):
        p = dsv4_ops.plan(lengths, n_new, S, 1, 4, 8, False, 4, 8, 8, 8)
        dsv4_ops.cache_write(win, kv_new, p.win_write[0])
        dsv4_ops.compress(ring_kv, ring_gate, ckv, cgate, lengths, p.csa_emit[0], norm_w, cos, sin, pool, 4, True,
                          1e-6)
        dsv4_ops.cache_write(ring_kv, ckv, p.csa_write[0])
        dsv4_ops.cache_write(ring_gate, cgate, p.csa_write[0])
        picked = dsv4_ops.indexer_topk(iq, iw, ikeys, p.csa_len[0], 3)
        csa = dsv4_ops.sparse_attention(q, win, p.win_idx[0], pool, picked, torch.zeros_like(p.csa_len[0]), sink,
                                        D**-0.5)
        # HCA-style: dense prefix of 200 entries, no picks -> split-KV + combine
        hca = dsv4_ops.sparse_attention(q, win, p.win_idx[0], pool, picked[..., :0], p.hca_len[0], sink, D**-0.5)
        moe = dsv4_ops.ops.moe_gemv(x, experts, router_w, w13, w2, 10.0)
        proj = dsv4_ops.ops.gemv(xg, wg)
        return csa, hca, picked, moe, proj

    with FakeTensorMode():
        t = lambda *shape, dtype=torch.float32: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
        args = [t(B, dtype=torch.int32), t(B, dtype=torch.int32), t(B, S, H, D), t(B, S, D), t(B, S, 2 * D),
                t(B, S, 2 * D), t(B, S, HI, DI), t(B, S, HI), t(H), t(D), t(80, 8), t(80, 8), t(B, 8, D),
                t(B, 8, 2 * D), t(B, 8, 2 * D), t(B, 200, D), t(B, 16, DI), t(B, D), t(B, 6, dtype=torch.int64),
                t(B, 6), t(8, 64, D), t(8, D, 32), t(1, 2, 2048), t(2, 256, 2048)]
        gm = make_fx(dispatch_functionalize(step), tracing_mode="real")(*args)
    launches, leftover = [], []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch.ops.higher_order.triton_kernel_wrapper_functional:
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            launches.append((kernel.fn.__name__, sorted(node.kwargs["tensors_to_clone"])))
        elif "dsv4" in str(node.target):
            leftover.append(str(node.target))
    # a prefill chunk whose [B, S, N] scores exceed the scratch budget: two groups of 2 query
    # tokens, each a scores launch into one [B, 2, N] scratch, then the group's top-k
    from dsv4_ops.lowering.triton import indexer as ix

    ix.SCORES_BUDGET_BYTES = 4 * B * 16 * 2
    with FakeTensorMode():
        gi = make_fx(dispatch_functionalize(lambda *a: dsv4_ops.indexer_topk(*a, 3)), tracing_mode="real")(
            t(B, S, HI, DI), t(B, S, HI), t(B, 16, DI), t(B, S, dtype=torch.int32))
    grouped = [kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__ for n in gi.graph.nodes
               if n.op == "call_function" and n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
    leftover += [str(n.target) for n in gi.graph.nodes if n.op == "call_function" and "dsv4" in str(n.target)]

    def decode_topk_launches(B, N, topk):
        """(kernel, tensors_to_clone) of each launch of a decode step's indexer_topk over N pool entries."""
        with FakeTensorMode():
            g = make_fx(dispatch_functionalize(lambda *a: dsv4_ops.indexer_topk(*a, topk)), tracing_mode="real")(
                t(B, 1, HI, DI), t(B, 1, HI), t(B, N, DI), t(B, 1, dtype=torch.int32))
        return [(kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__, sorted(n.kwargs["tensors_to_clone"]))
                for n in g.graph.nodes
                if n.op == "call_function" and n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]

    # batch-1 decode at 32K context (8258 pool entries, top-512): the split top-k's two stages
    split = decode_topk_launches(1, 8258, 512)
    # batch-128 decode at 32K context (8192 pool entries, top-512): the fused top-k (stage 1 in the
    # scores kernel, then stage 2)
    fused = decode_topk_launches(128, 8192, 512)
    import torch._library.triton as library_triton
    from torch._library.custom_ops import OPDEFS

    def names(kernels):
        return sorted(k.fn.__name__ for k in kernels)

    def literal(body):  # what the oldest scanners find: wrap_triton(<global name>) in the body itself
        import ast
        import inspect
        import textwrap

        calls = [n for n in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(body))))
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "wrap_triton"
                 and n.args and isinstance(n.args[0], ast.Name)]
        return names(body.__globals__[c.args[0].id] for c in calls)

    registered = getattr(library_triton, "get_triton_kernels_for_op", None)  # 2.13; maybe absent in older
    discovered = {op: {"body": names(library_triton.get_inner_triton_kernels(OPDEFS[op]._abstract_fn)),
                       "literal": literal(OPDEFS[op]._abstract_fn),
                       "registered": None if registered is None else names(registered(op))}
                  for op in sorted(OPDEFS) if op.startswith("dsv4::")}
    print(json.dumps({"launches": launches, "leftover": leftover, "warnings": warnings, "discovered": discovered,
                      "grouped": grouped, "split": split, "fused": fused}))


@pytest.fixture(scope="module")
def traced():
    return run_worker(__file__)


def test_every_op_traces_to_its_triton_kernels(traced):
    assert traced["leftover"] == [], "an op stayed opaque instead of decomposing into its kernels"
    assert [tuple(x) for x in traced["launches"]] == EXPECTED


def test_indexer_scores_a_long_chunk_in_token_groups_when_traced(traced):
    # the op body's grouped path (views of q, weights, visible and out) traces to plain launches
    assert traced["grouped"] == ["indexer_scores_kernel", "topk_row_kernel"] * 2


def test_split_topk_traces_to_its_two_stages(traced):
    # stage 1 writes the candidate buffers (indices through out_ptr, scores through cand_ptr),
    # stage 2 only reads them (cand_ptr: the indices) and writes the picks
    assert [tuple(x) for x in traced["split"]] == [("indexer_scores_kernel", ["out_ptr"]),
                                                   ("topk_row_kernel", ["cand_ptr", "out_ptr"]),
                                                   ("topk_row_kernel", ["out_ptr"])]


def test_fused_topk_traces_to_the_scores_kernel_and_stage_2(traced):
    # the fused scores kernel writes its scratch scores and both candidate buffers (its select and
    # compaction helpers take no pointers, so the analysis sees exactly those); stage 2 only reads them
    assert [tuple(x) for x in traced["fused"]] == [("indexer_scores_kernel", ["cand_idx_ptr", "cand_score_ptr",
                                                                              "out_ptr"]),
                                                   ("topk_row_kernel", ["out_ptr"])]


# every kernel each op body may launch (which ones run depends on static sizes)
OP_KERNELS = {
    "dsv4::cache_write": ["cache_write_kernel", "fp8_cache_write_kernel"],  # bf16 / fp8 caches
    "dsv4::compress": ["compress_kernel"],
    "dsv4::indexer_topk": ["indexer_scores_kernel", "topk_kernel", "topk_row_kernel"],
    "dsv4::gemv": ["gemv_kernel"],
    "dsv4::moe_gemv": ["moe_down_kernel", "moe_gate_up_kernel"],
    "dsv4::plan": ["plan_kernel"],
    "dsv4::sinkhorn": ["sinkhorn_kernel"],
    "dsv4::sparse_attention": ["combine_kernel", "sparse_attention_kernel"],
    # an opaque custom_op (its Gluon kernel cannot be wrap_triton'd): Inductor calls it, never inlines
    "dsv4::sparse_attention_sm90": [],
    # (the CUDA top-k, dsv4::topk_rows_cuda, is a C++ op of the native library: no Python body)
}


def test_kernel_discovery_finds_every_kernel_of_every_op(traced):
    """``get_inner_triton_kernels`` on each op body (what ``triton_op`` itself runs) and the
    table it fills (``get_triton_kernels_for_op``) list the op's kernels: the bodies name them
    in ``wrap_triton(<kernel>)``, so no private table is written by hand."""
    found = traced["discovered"]
    assert {op: d["body"] for op, d in found.items()} == OP_KERNELS
    assert {op: d["literal"] for op, d in found.items()} == OP_KERNELS
    assert {op: d["registered"] for op, d in found.items() if d["registered"] is not None} in (OP_KERNELS, {})


def test_mutation_analysis_never_falls_back(traced):
    bad = [w for w in traced["warnings"] if "mutated" in w or "xception" in w]
    assert not bad, bad


if __name__ == "__main__":
    _worker()
