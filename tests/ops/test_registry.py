"""Every torch.ops.dsv4 op has the per-op test template, and its schema is pinned.

A new op must come with its folder ``tests/ops/<op>/`` whose test files together define the five
template tests (``test_<op>_opcheck``, ``_fake_matches_real``, ``_matches_reference``,
``_edge_cases``, ``_rejects_bad_input``), and its schema line here (regenerate with
EXPECTTEST_ACCEPT=1 after a deliberate change; pinned on torch 2.13). An op that is a route of a
public op (a kernel the public op dispatches to on some devices) lives in that op's folder:
``ROUTES`` names them.
"""
import ast
from pathlib import Path

import expecttest
import torch

import dsv4_ops  # noqa: F401  (registers the ops)
from dsv4_ops.ops import topk_cuda

OPS_TESTS = Path(__file__).parent  # tests/ops
TEMPLATE = ("opcheck", "fake_matches_real", "matches_reference", "edge_cases", "rejects_bad_input")
PUBLIC = {"plan", "cache_write", "compress", "indexer_topk", "sparse_attention"}
# C++ ops of the native library (dsv4_ops/native.py): registered only where it loaded. Their schemas
# are pinned here when they are, and in their C++ source always
# (tests/ops/indexer_topk/test_topk_rows_cuda_build.py).
NATIVE = {"topk_rows_cuda"} if topk_cuda.available() else set()
# route op -> the public op whose folder holds its tests: the sm_90 Gluon attention, the CUDA top-k
ROUTES = {"sparse_attention_sm90": "sparse_attention", "topk_rows_cuda": "indexer_topk"}


def template_folder(name: str) -> Path:
    return OPS_TESTS / ROUTES.get(name, name)


def defined_tests(folder: Path) -> set[str]:
    """The module-level functions of the folder's test files."""
    return {node.name for path in folder.glob("test_*.py") for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.FunctionDef)}


def dsv4_op_names() -> list[str]:
    return sorted({n.split("::", 1)[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                   if n.startswith("dsv4::")})


def test_public_ops_are_registered():
    assert PUBLIC <= set(dsv4_op_names())
    for name in PUBLIC:
        assert callable(getattr(dsv4_ops, name)) and getattr(dsv4_ops.ops, name) is getattr(dsv4_ops, name)


def test_every_op_has_the_test_template():
    for name in sorted(set(dsv4_op_names()) | set(ROUTES)):  # the routes' even where not registered here
        folder = template_folder(name)
        assert folder.is_dir(), f"torch.ops.dsv4.{name} has no tests/ops/{folder.name}/"
        defined = defined_tests(folder)
        missing = [f"test_{name}_{t}" for t in TEMPLATE if f"test_{name}_{t}" not in defined]
        assert not missing, f"tests/ops/{folder.name}/ lacks {missing}"


def test_every_op_folder_is_an_op():
    folders = {p.name for p in OPS_TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    ops = {ROUTES.get(n, n) for n in dsv4_op_names()}
    assert folders == ops, f"folders without an op: {sorted(folders - ops)}; ops without a folder: {sorted(ops - folders)}"


class TestSchemas(expecttest.TestCase):
    def test_every_schema_is_pinned(self):
        pinned = {"plan", "cache_write", "compress", "indexer_topk", "sparse_attention", "sinkhorn", "moe_gemv", "gemv",
                  "sparse_attention_sm90"} | NATIVE
        self.assertEqual(set(dsv4_op_names()), pinned, "pin the schema of every new op below")

    def test_schemas(self):
        ops = torch.ops.dsv4
        self.assertExpectedInline(str(ops.plan.default._schema), """dsv4::plan(Tensor lengths, Tensor n_new, SymInt num_tokens, SymInt steps, SymInt window, SymInt win_ring, bool win_concat, SymInt csa_ratio, SymInt csa_ring, SymInt hca_ratio, SymInt hca_ring) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)""")
        self.assertExpectedInline(str(ops.cache_write.default._schema), """dsv4::cache_write(Tensor(a0!) cache, Tensor values, Tensor slots, Tensor? block_table=None) -> ()""")
        self.assertExpectedInline(str(ops.compress.default._schema), """dsv4::compress(Tensor ring_kv, Tensor ring_gate, Tensor new_kv, Tensor new_gate, Tensor start, Tensor emit, Tensor norm_weight, Tensor cos, Tensor sin, Tensor(a9!) pool, SymInt ratio, bool overlap, float eps, Tensor? block_table=None) -> ()""")
        self.assertExpectedInline(str(ops.indexer_topk.default._schema), """dsv4::indexer_topk(Tensor q, Tensor weights, Tensor keys, Tensor visible, SymInt topk, Tensor? block_table=None) -> Tensor""")
        self.assertExpectedInline(str(ops.gemv.default._schema), """dsv4::gemv(Tensor x, Tensor weight) -> Tensor""")
        self.assertExpectedInline(str(ops.moe_gemv.default._schema), """dsv4::moe_gemv(Tensor x, Tensor indices, Tensor weights, Tensor w13, Tensor w2, float limit) -> Tensor""")
        self.assertExpectedInline(str(ops.sinkhorn.default._schema), """dsv4::sinkhorn(Tensor comb, SymInt iters, float eps) -> Tensor""")
        self.assertExpectedInline(str(ops.sparse_attention.default._schema), """dsv4::sparse_attention(Tensor q, Tensor kv, Tensor kv_idx, Tensor cmp, Tensor cmp_idx, Tensor cmp_len, Tensor sink, float scale, Tensor? block_table=None) -> Tensor""")
        self.assertExpectedInline(str(ops.sparse_attention_sm90.default._schema), """dsv4::sparse_attention_sm90(Tensor q, Tensor kv, Tensor kv_idx, Tensor cmp, Tensor cmp_idx, Tensor cmp_len, Tensor sink, float scale, SymInt picks=-1) -> Tensor""")
        if NATIVE:
            self.assertExpectedInline(str(ops.topk_rows_cuda.default._schema), """dsv4::topk_rows_cuda(Tensor scores, Tensor visible, int topk) -> Tensor""")
