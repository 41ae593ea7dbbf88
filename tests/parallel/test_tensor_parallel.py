"""Tensor / expert parallelism (``dsv4_ops.parallel``, issue #16) on 2 CPU processes with gloo.

Spec:
* A rank holds half the query heads (``q_b_proj`` rows, ``sinks``), half the output groups
  (``o_a_proj`` rows, ``o_b_proj`` columns) and half the routed experts; everything else whole.
* The sharded model's logits equal the single-process model's (fp32, 1e-5) for the cache-free
  forward, prefill and 40 decode steps, and for the MTP block; speculative generation gives the
  same tokens and the same drafts.
* ``Generator(compile=True)`` on a shard: the same logits, no graph breaks, no recompiles.
* A sharded streaming load of FP8 / FP4 checkpoints (per-expert or fused names) gives the
  single-process load's logits; a checkpoint missing one of rank 1's tensors raises a
  ``ShardLoadError`` naming rank 1 on EVERY rank (no rank is left waiting).
* Heads / groups / experts that do not divide by the group size raise a ``ValueError`` naming
  the config field.

All distributed cases run in ONE ``torchrun --nproc-per-node 2`` launch (``tp_worker.py``), with
a process-group timeout inside and a subprocess timeout outside, so nothing can hang.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from dsv4_ops import DSV4Config  # noqa: E402
from dsv4_ops.parallel import TensorParallel  # noqa: E402
from model_util import random_model  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCH_TIMEOUT_S = 480  # a cold Inductor cache on a loaded 2-core machine; typically ~100 s


# ------------------------------------------------------------------------------ in process
@pytest.mark.parametrize("size, overrides, field", [
    (3, {}, "num_attention_heads"),  # 4 heads
    (4, {}, "o_groups"),  # 2 groups
    (2, {"n_routed_experts": 5}, "n_routed_experts"),
])
def test_counts_that_do_not_divide_name_the_config_field(size, overrides, field) -> None:
    with pytest.raises(ValueError, match=rf"config\.{field} = \d+ does not divide by tp_size = {size}"):
        TensorParallel(0, size).check(DSV4Config.tiny(**overrides))


def test_a_state_dict_shards_into_disjoint_slices_that_rebuild_it() -> None:
    full = random_model(DSV4Config.tiny()).state_dict()
    parts = [TensorParallel(r, 2).shard_state_dict(full) for r in range(2)]
    for name, t in full.items():
        dim = TensorParallel(0, 2).dim_of(name)
        if dim is None:
            assert all(p[name] is t for p in parts), name  # replicated: shared, not copied
            continue
        assert parts[0][name].shape[dim] == t.shape[dim] // 2, name
        assert torch.equal(torch.cat([p[name] for p in parts], dim), t), name
    sharded = {n for n in full if TensorParallel(0, 2).dim_of(n) is not None}
    layers = 4 + 1  # main layers + the MTP block
    assert len(sharded) == 6 * layers, sorted(sharded)


# ------------------------------------------------------------------------------ 2 processes
def _checkpoints(root) -> str:
    """FP8 / FP4 checkpoints of a random tiny model: in DeepSeek names (per-expert tensors), in HF
    names (fused experts), and one whose rank-1 slice lacks expert 5's w1 in layer 2."""
    from test_checkpoint_formats import official_checkpoint, write_checkpoint

    cfg = DSV4Config.tiny()
    src = random_model(cfg, seed=4)
    for names in ("deepseek", "hf"):
        tensors, _ = official_checkpoint(src, names, "ue8m0")
        write_checkpoint(os.path.join(root, names), cfg, tensors, n_shards=2)
        if names == "deepseek":
            missing = {k: v for k, v in tensors.items() if not k.startswith("layers.2.ffn.experts.5.w1.")}
            assert len(missing) == len(tensors) - 2  # the weight and its scale
            write_checkpoint(os.path.join(root, "missing_expert"), cfg, missing, n_shards=2)
    return root


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Run ``tp_worker.py`` on 2 gloo ranks once; -> [rank 0 results, rank 1 results]."""
    root = tmp_path_factory.mktemp("tp")
    ckpt = _checkpoints(str(root / "ckpt"))
    out = root / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(HERE, "tp_worker.py"), str(out), ckpt]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the 2-rank run did not finish in {LAUNCH_TIMEOUT_S} s:\n{(e.stderr or '')[-3000:]}")
    files = [out / f"rank{r}.json" for r in range(2)]
    if proc.returncode != 0 or not all(f.exists() for f in files):
        pytest.fail(f"torchrun exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return [json.loads(f.read_text()) for f in files]


def _passed(ranks, case: str) -> None:
    for rank, results in enumerate(ranks):
        assert case in results, f"rank {rank} did not run {case}"
        assert results[case] is None, f"rank {rank}, {case}:\n{results[case]}"


def test_each_rank_holds_its_slice_of_heads_groups_and_experts(ranks) -> None:
    _passed(ranks, "layout")


def test_sharded_cache_free_logits_equal_the_single_process_model(ranks) -> None:
    _passed(ranks, "cache_free_forward")


def test_sharded_prefill_and_40_decode_steps_equal_the_single_process_model(ranks) -> None:
    _passed(ranks, "prefill_and_decode")


def test_sharded_mtp_block_logits_equal_the_single_process_model(ranks) -> None:
    _passed(ranks, "mtp_logits")


def test_speculative_generation_on_the_shard_gives_the_same_tokens_and_drafts(ranks) -> None:
    _passed(ranks, "speculative")


def test_shard_model_rejects_experts_that_do_not_divide_on_every_rank(ranks) -> None:
    _passed(ranks, "bad_tp_size")


def test_sharded_checkpoint_load_equals_the_single_process_load(ranks) -> None:
    _passed(ranks, "load")


def test_a_rank_missing_a_tensor_of_its_shard_fails_every_rank_with_its_name(ranks) -> None:
    _passed(ranks, "load_failure")


def test_compiled_shard_matches_eager_without_recompiles(ranks) -> None:
    _passed(ranks, "compiled")
