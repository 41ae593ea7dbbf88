"""The compiled decode step of the tiny model as Inductor sees it after its post-grad passes, on the CUDA branch of
every op (traced on the CPU: the op bodies' device check widened to CPU tensors, Triton's driver reporting sm_90, the
compile stopped once the post-grad graph exists, before any code is generated).

Specification:
* no ``dsv4`` op is left opaque: every op body decomposed into its Triton kernels (``triton_kernel_wrapper_*``);
* every kernel writes its outputs in place (``triton_kernel_wrapper_mutation``), and nothing clones or copies a KV pool
  (a graph input): the pool is read and written where it lives;
* the op list (kernels and aten ops, with counts) is pinned for CI's torch, so that a change to it shows in review.
"""
import collections
import json
import os
import sys

import pytest
import torch
from compiled_worker import ROOT, run_worker

PINNED_TORCH = "2.13."  # the version the op list is pinned for (CI's); others check the invariants only


def _worker():
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(ROOT))
    import triton
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._inductor import compile_fx
    from torch._inductor.fx_passes import post_grad
    from triton.backends.compiler import GPUTarget

    class Sm90Driver:  # only what the kernels' mutation analysis asks of the driver
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    triton.runtime.driver.set_active(Sm90Driver())
    import dsv4_ops
    from dsv4_ops import lowering

    lowering.BACKEND = "triton"
    lowering.use_triton = lambda device_type: device_type in ("cuda", "cpu")
    wrappers = (torch.ops.higher_order.triton_kernel_wrapper_mutation,
                torch.ops.higher_order.triton_kernel_wrapper_functional)
    seen = {}

    class Captured(Exception):
        pass

    passes = post_grad.post_grad_passes

    def capture(gm, is_inference):
        passes(gm, is_inference)
        ops, pool_copies = collections.Counter(), []
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target in wrappers:
                kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"]).fn.__name__
                ops[f"{node.target.__name__}({kernel})"] += 1
            else:
                ops[str(node.target)] += 1
                src = node.args[0] if node.args else None
                if "clone" in str(node.target) or "copy" in str(node.target):
                    if isinstance(src, torch.fx.Node) and src.op == "placeholder":
                        pool_copies.append(f"{node.target}({src.name})")
        seen.update(ops=dict(ops), pool_copies=pool_copies)
        raise Captured

    compile_fx.post_grad_passes = capture
    torch.manual_seed(0)
    model = dsv4_ops.DeepseekV4ForCausalLM(dsv4_ops.DSV4Config.tiny()).eval()
    model.setup_caches(max_batch_size=2, max_seq_len=64)
    ids = torch.randint(0, 256, (2, 1))
    lengths, n_new = torch.tensor([5, 9], dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    try:
        with torch.no_grad():
            torch.compile(model, fullgraph=True, dynamic=False)(ids, lengths, n_new, last_only=True)
    except Exception as e:  # noqa: BLE001  (dynamo wraps the backend's exception)
        if "Captured" not in repr(e) and not seen:
            raise
    print(json.dumps(seen))


@pytest.fixture(scope="module")
def graph():
    return run_worker(__file__)


def test_no_dsv4_op_is_left_opaque(graph):
    assert not [op for op in graph["ops"] if "dsv4" in op]
    kernels = {op for op in graph["ops"] if op.startswith("triton_kernel_wrapper")}
    for kernel in ("plan_kernel", "cache_write_kernel", "compress_kernel", "indexer_scores_kernel", "sparse_attention_kernel",
                   "sinkhorn_kernel", "moe_gate_up_kernel", "moe_down_kernel"):
        assert any(kernel in op for op in kernels), (kernel, sorted(kernels))


def test_kernels_write_in_place_and_nothing_copies_the_pool(graph):
    assert not [op for op in graph["ops"] if op.startswith("triton_kernel_wrapper_functional")]
    assert graph["pool_copies"] == []


@pytest.mark.skipif(not torch.__version__.startswith(PINNED_TORCH), reason=f"the op list is pinned for torch {PINNED_TORCH}x")
def test_the_op_list_is_pinned(graph):
    import expecttest

    class Pin(expecttest.TestCase):
        def runTest(self):
            pass

    text = "\n".join(f"{n:4d} {op}" for op, n in sorted(graph["ops"].items(), key=lambda kv: (not kv[0].startswith(
        "triton"), kv[0])))
    Pin().assertExpectedInline(text, """\
  14 triton_kernel_wrapper_mutation(cache_write_kernel)
   5 triton_kernel_wrapper_mutation(compress_kernel)
   2 triton_kernel_wrapper_mutation(indexer_scores_kernel)
   4 triton_kernel_wrapper_mutation(moe_down_kernel)
   4 triton_kernel_wrapper_mutation(moe_gate_up_kernel)
   1 triton_kernel_wrapper_mutation(plan_kernel)
   8 triton_kernel_wrapper_mutation(sinkhorn_kernel)
   4 triton_kernel_wrapper_mutation(sparse_attention_kernel)
   2 triton_kernel_wrapper_mutation(topk_row_kernel)
  74 <built-in function getitem>
 109 aten.add.Tensor
   4 aten.addmm.default
   8 aten.amax.default
   4 aten.bmm.default
  28 aten.cat.default
   8 aten.clamp_max.default
   9 aten.clamp_min.default
   5 aten.clone.default
  16 aten.div.Tensor
   1 aten.embedding.default
  33 aten.empty.memory_format
  16 aten.exp.default
   1 aten.expand.default
   8 aten.full.default
   4 aten.gather.default
   4 aten.gt.Scalar
  16 aten.index.Tensor
   4 aten.log1p.default
   1 aten.lt.Tensor
  30 aten.mean.dim
  39 aten.mm.default
 184 aten.mul.Tensor
   8 aten.neg.default
  71 aten.permute.default
  30 aten.pow.Tensor_Scalar
   5 aten.remainder.Scalar
 161 aten.reshape.default
  30 aten.rsqrt.default
  53 aten.select.int
  17 aten.sigmoid.default
  60 aten.slice.Tensor
  16 aten.split_with_sizes.default
   4 aten.sqrt.default
  23 aten.sub.Tensor
  42 aten.sum.dim_IntList
   2 aten.topk.default
   8 aten.unbind.int
 157 aten.unsqueeze.default
   8 aten.where.self
   5 prims.convert_element_type.default
   2 prims.iota.default""")


if __name__ == "__main__":
    _worker()
