"""The model is a first-class nn.Module: ``torch.compile(model, fullgraph=True)`` compiles both
entry points (the cache-free forward and the cached step) with zero graph breaks, equals eager,
and never recompiles over 64+ decode steps and new prompt lengths; the KV pool is non-persistent
module buffers (``setup_caches``): ``state_dict`` keeps its keys, ``model.to()`` moves the pool."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from dsv4_ops import DSV4Config
from model_util import random_model

CFG = DSV4Config.tiny(num_hidden_layers=3, hca_ratio=8)  # sliding + CSA + HCA; HCA blocks close often
B, MAX_SEQ, CHUNK = 2, 128, 16


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=11)


def run_cached(fn, model, prompts: list[list[int]], decode_ids: list[list[int]]) -> list[torch.Tensor]:
    """Prefill ``prompts`` in chunks of CHUNK through ``fn`` (the model or its compiled form),
    then one decode step per column of ``decode_ids``; the logits of every call."""
    lengths = torch.zeros(B, dtype=torch.int32)
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
    n_chunks = -(-max(lens.tolist()) // CHUNK)
    ids = torch.zeros(B, n_chunks * CHUNK, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p)
    outs = []
    with torch.no_grad():
        for j in range(n_chunks):
            n_new = (lens - j * CHUNK).clamp(0, CHUNK).to(torch.int32)
            chunk = ids[:, j * CHUNK : (j + 1) * CHUNK].clone()
            outs.append(fn(chunk, lengths, n_new, last_only=True))
            lengths += n_new
        one = torch.ones(B, dtype=torch.int32)
        for col in decode_ids:
            outs.append(fn(torch.tensor(col).view(B, 1), lengths, one, last_only=True))
            lengths += one
    return outs


def test_setup_caches_adds_no_state_dict_keys_and_to_moves_the_pool() -> None:
    m = random_model(CFG, seed=12)
    keys = list(m.state_dict())
    cc = m.setup_caches(B, MAX_SEQ, lookahead=2, mtp=True)
    assert list(m.state_dict()) == keys  # the pool is non-persistent
    assert m.cache_nbytes() > 0 and cc.rings.window == CFG.sliding_window + 2
    pool = m.model.layers[1].self_attn.pool  # a CSA layer's compressed pool
    assert pool.shape == (B, MAX_SEQ // CFG.csa_ratio, CFG.head_dim)
    assert m.setup_caches(B, MAX_SEQ, lookahead=2, mtp=True) == cc
    assert m.model.layers[1].self_attn.pool is pool  # same limits: the pool is kept
    m.to("meta")
    for name, buf in m.named_buffers():
        assert buf.device.type == "meta", name
    st = m.cache_states()[1]
    assert all(t.device.type == "meta" for t in st.tensors().values())
    assert m.mtp_cache_state().window.device.type == "meta"
    m.clear_caches()
    assert m.cache_config is None and not any(a.self_attn.has_cache for a in m.model.layers)


def test_cached_step_needs_setup_caches_and_checks_its_limits(model) -> None:
    m = random_model(CFG, seed=13)
    ids, zero = torch.zeros(B, 4, dtype=torch.long), torch.zeros(B, dtype=torch.int32)
    with pytest.raises(ValueError, match="setup_caches"):
        m(ids, zero)
    m.setup_caches(B, 32)
    with pytest.raises(ValueError, match="max_batch_size 2"):
        m(torch.zeros(3, 4, dtype=torch.long), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="max_seq_len 32"):
        m(ids, torch.full((B,), 30, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"n_new must be in \[0, 4\]"):
        m(ids, zero, torch.full((B,), 5, dtype=torch.int32))
    with pytest.raises(ValueError, match="lengths must be an int32 tensor of shape"):
        m(ids, torch.zeros(B, dtype=torch.int64))


@pytest.mark.parametrize("bad, match", [
    (torch.tensor([[1, 256]]), r"input_ids\[0, 1\] = 256 is outside \[0, vocab_size=256\)"),
    (torch.tensor([[-1]]), r"input_ids\[0, 0\] = -1"),
    (torch.zeros(1, 0, dtype=torch.long), "at least one row and one token"),
    (torch.zeros(3, dtype=torch.long), r"must be \[B, S\]"),
    (torch.zeros(1, 3), "integer token ids"),
])
def test_forward_rejects_bad_input_ids(model, bad, match) -> None:
    with pytest.raises(ValueError, match=match):
        model(bad)


def test_compiled_module_equals_eager_both_entry_points_no_breaks_no_recompiles(model, tol) -> None:
    torch._dynamo.reset()
    counters.clear()
    model.setup_caches(B, MAX_SEQ)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(3)

    # 1. cache-free forward: 21 tokens pass the window (16) and close 5 CSA and 2 HCA blocks, with a
    # partial block of each (a static shape: every other length is a graph of the same code)
    ids = torch.randint(0, CFG.vocab_size, (B, 21), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids), model(ids), **tol("compiled_vs_eager_fp32"))

    # 2. cached step: warm-up compiles the prefill chunk and the decode step once each
    warm_prompts = [[1, 2, 3], list(range(20))]
    run_cached(compiled, model, warm_prompts, [[5, 6]])
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 3  # cache-free forward + prefill chunk + decode

    # new prompt lengths (more chunks), 70 decode steps (window 16 and HCA rate 8 crossed many times)
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in (37, 5)]
    decode = torch.randint(0, CFG.vocab_size, (70, B), generator=g).tolist()
    with torch.compiler.set_stance("fail_on_recompile"):
        got = run_cached(compiled, model, prompts, decode)
    assert counters["stats"]["unique_graphs"] == graphs
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    want = run_cached(model, model, prompts, decode)  # eager, same pool (position-addressed: no reset)
    assert len(got) == len(want) == 3 + 70
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, **tol("compiled_vs_eager_fp32"), msg=lambda m: f"call {i}: {m}")
