"""One rank of ``test_tensor_parallel.py``'s 2-process gloo run (``torchrun --nproc-per-node 2``).

Every case runs on every rank in the same order (cases with collectives must stay in step) and
records ``None`` (passed) or the failure's text; the rank writes ``rank<R>.json`` into the output
directory, which the pytest side reads. One launch runs every case: spawning and compiling are
the expensive parts. Usage: ``torchrun --nproc-per-node 2 tests/parallel/tp_worker.py OUT_DIR CKPT_DIR``.
"""
from __future__ import annotations

import copy
import json
import os
import sys
import traceback

import torch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: model_util, conftest's tolerances
sys.path.insert(0, os.path.dirname(TESTS))  # the repo root
sys.path.insert(0, TESTS)

import torch.distributed as dist  # noqa: E402

from dsv4_ops import DSV4Config, Generator, load_pretrained  # noqa: E402
from dsv4_ops.config import SLIDING  # noqa: E402
from dsv4_ops.model.plan import ring_sizes  # noqa: E402
from dsv4_ops.parallel import ExpertShard, ShardLoadError, init_distributed, shard_model  # noqa: E402
from conftest import tolerance  # noqa: E402  (the one tolerance table; this process is no pytest run)
from model_util import random_model  # noqa: E402

TOL = tolerance("sharded_vs_single_process")
PROMPTS = [[3, 1, 4], [1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2]]
DECODE_STEPS = 40  # past the window (16), an HCA block (16) and many CSA blocks (4)
GEN = dict(max_batch_size=2, max_seq_len=96, prefill_chunk=8)


def close(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------------------------ cases
def case_layout(full, tp) -> None:
    """Each rank holds its slice: half the heads, groups and experts; everything else whole."""
    rank = dist.get_rank()
    attn, ref = tp.model.layers[1].self_attn, full.model.layers[1].self_attn
    assert attn.num_heads == 2 and attn.o_groups == 1, (attn.num_heads, attn.o_groups)
    close("q_b_proj", attn.q_b_proj.weight, ref.q_b_proj.weight.chunk(2, 0)[rank])
    close("o_b_proj", attn.o_b_proj.weight, ref.o_b_proj.weight.chunk(2, 1)[rank])
    ex = tp.mtp[0].mlp.experts
    assert isinstance(ex, ExpertShard) and (ex.first, ex.n_local) == (4 * rank, 4), (ex.first, ex.n_local)
    close("mtp experts", ex.down_proj, full.mtp[0].mlp.experts.down_proj[4 * rank:4 * rank + 4])
    close("replicated kv_proj", attn.kv_proj.weight, ref.kv_proj.weight)


def case_cache_free_forward(full, tp) -> None:
    ids = torch.randint(0, 256, (2, 23), generator=torch.Generator().manual_seed(1))
    close("cache-free logits", tp(ids), full(ids))


def case_prefill_and_decode(full, tp) -> None:
    """Prefill logits, then DECODE_STEPS steps fed the single-process model's greedy tokens."""
    ref, gen = Generator(full, compile=False, **GEN), Generator(tp, compile=False, **GEN)
    want, got = ref.prefill(PROMPTS), gen.prefill(PROMPTS)
    close("prefill logits", got, want)
    for step in range(DECODE_STEPS):
        nxt = want.argmax(-1)
        want, got = ref.decode(nxt), gen.decode(nxt)
        close(f"decode step {step} logits", got, want)


def mtp_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The MTP block's logits over a whole sequence from position 0 (no cache): the main model's
    final streams at ``t`` paired with token ``t+1``."""
    B, S = ids.shape
    lengths, n_new = torch.zeros(B, dtype=torch.int32), torch.full((B,), S, dtype=torch.int32)
    rings = ring_sizes(model.config)
    meta = model.plan(lengths, n_new, S, rings=rings)
    states = [layer.self_attn.new_state(B, S, rings) for layer in model.model.layers]
    with torch.no_grad():
        streams = model.hidden_streams(ids, lengths, n_new, meta, states)
        blk = model.mtp[0]
        nxt = model.model.embed_tokens(ids.roll(-1, dims=1))
        out = blk(streams, nxt, meta, blk.self_attn.new_state(B, S, rings), ids)
        return model.lm_head(blk.hidden(out)).float()


def case_mtp_logits(full, tp) -> None:
    ids = torch.randint(0, 256, (2, 21), generator=torch.Generator().manual_seed(2))
    close("MTP block logits", mtp_logits(tp, ids), mtp_logits(full, ids))


def case_speculative(full, tp) -> None:
    """Speculative generation: the same tokens AND the same drafts (a broken MTP shard would
    still give the right tokens, speculative decoding is exact, but other drafts)."""
    ref, gen = (Generator(m, compile=False, spec_steps=2, **GEN) for m in (full, tp))
    want, got = ref.generate(PROMPTS, max_new_tokens=DECODE_STEPS), gen.generate(PROMPTS, max_new_tokens=DECODE_STEPS)
    assert got == want, f"speculative tokens differ: {got} vs {want}"
    assert torch.equal(gen.spec.drafts, ref.spec.drafts), "final drafts differ"
    assert gen.stats["accepted_tokens"] == ref.stats["accepted_tokens"], (gen.stats, ref.stats)
    plain = Generator(tp, compile=False, **GEN).generate(PROMPTS, max_new_tokens=DECODE_STEPS)
    assert got == plain, "speculative tokens differ from plain decoding on the sharded model"


def case_bad_tp_size() -> None:
    cfg = DSV4Config.tiny(n_routed_experts=5)
    try:
        shard_model(random_model(cfg))
    except ValueError as e:
        assert "n_routed_experts" in str(e) and "tp_size = 2" in str(e), str(e)
        return
    raise AssertionError("5 experts over 2 ranks did not raise")


def case_load(ckpt_dir: str) -> None:
    """Sharded streaming load of a checkpoint (FP8 / FP4, per-expert or fused expert tensors)
    gives the logits of the single-process load."""
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(3))
    for names in ("deepseek", "hf"):
        path = os.path.join(ckpt_dir, names)
        single = load_pretrained(path)
        shard = load_pretrained(path, process_group=dist.group.WORLD)
        assert shard.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4
        close(f"{names} checkpoint logits", shard(ids), single(ids))
        close(f"{names} checkpoint MTP logits", mtp_logits(shard, ids), mtp_logits(single, ids))


def case_load_failure(ckpt_dir: str) -> None:
    """Rank 1's slice lacks one expert tensor: every rank raises, naming rank 1 and the tensor."""
    try:
        load_pretrained(os.path.join(ckpt_dir, "missing_expert"), process_group=dist.group.WORLD)
    except ShardLoadError as e:
        msg = str(e)
        assert "rank(s) 1 of 2" in msg and "experts 4..7" in msg and "w1" in msg, msg
        return
    raise AssertionError("a checkpoint missing one of rank 1's experts loaded on this rank")


def case_compiled(tiny_1layer) -> None:
    """Generator(compile=True) on the shard: logits of the eager single-process model at prefill
    and every decode step, no graph breaks, no recompiles after warm-up."""
    full = tiny_1layer
    tp = shard_model(copy.deepcopy(full))
    ref, gen = Generator(full, compile=False, **GEN), Generator(tp, compile=True, cuda_graphs=False, **GEN)
    gen.generate(PROMPTS, max_new_tokens=2)  # warm-up: compiles the prefill and decode steps
    graphs = dict(gen._graphs)
    with torch.compiler.set_stance("fail_on_recompile"):
        want, got = ref.prefill(PROMPTS), gen.prefill(PROMPTS)
        close("compiled prefill logits", got, want)
        for step in range(DECODE_STEPS):
            nxt = want.argmax(-1)
            want, got = ref.decode(nxt), gen.decode(nxt)
            close(f"compiled decode step {step} logits", got, want)
    s = gen.stats
    assert s["graph_breaks"] == 0 and s["recompiles"] == 0 and gen._graphs == graphs, (s, gen._graphs, graphs)
    assert set(graphs) == {("prefill", 2), ("decode", 2)}, graphs


# ------------------------------------------------------------------------------------ driver
def main(out_dir: str, ckpt_dir: str) -> None:
    init_distributed(device="cpu", timeout_s=60)  # a rank out of step fails within a minute
    rank = dist.get_rank()
    full = random_model(DSV4Config.tiny(), seed=0)  # the same weights on every rank
    tp = shard_model(copy.deepcopy(full))
    one_layer = DSV4Config.tiny(num_hidden_layers=1, layer_types=[SLIDING], mlp_layer_types=["moe"],
                                num_nextn_predict_layers=0)  # what a CPU compiles in about a minute
    cases = {
        "layout": lambda: case_layout(full, tp),
        "cache_free_forward": lambda: case_cache_free_forward(full, tp),
        "prefill_and_decode": lambda: case_prefill_and_decode(full, tp),
        "mtp_logits": lambda: case_mtp_logits(full, tp),
        "speculative": lambda: case_speculative(full, tp),
        "bad_tp_size": case_bad_tp_size,
        "load": lambda: case_load(ckpt_dir),
        "load_failure": lambda: case_load_failure(ckpt_dir),
        "compiled": lambda: case_compiled(random_model(one_layer, seed=1)),
    }
    only = os.environ.get("TP_CASES")  # debugging: a comma-separated subset
    results = {}
    for name, run in cases.items():
        if only and name not in only.split(","):
            continue
        try:
            run()
            results[name] = None
        except Exception:  # noqa: BLE001  (recorded for the pytest side)
            results[name] = traceback.format_exc(limit=4)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
