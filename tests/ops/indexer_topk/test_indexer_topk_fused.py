"""The fused top-k of the lightning indexer vs the reference top-k, exactly.

The scores kernel does the split top-k's stage 1 over its own chunk (``TOPK_FUSED`` = the chunk,
which is the segment), writing each chunk's top-k as stage-1 candidates; the existing stage 2
merges them (``lowering/triton/indexer.py``). Here the fused path is forced on with small chunks
(``TOPK_FUSED`` 16..64, ``BLOCK_N`` 16) so that rows of a few hundred entries span several chunks,
the last one cut short; on a machine without CUDA the kernels run under ``TRITON_INTERPRET=1``
with fp32 inputs. Integer-valued queries, weights and keys make every score exact whatever the
summation order and make many scores tie, so the picks must equal ``ref.indexer_topk``'s
exactly (ties to the lower index, -1 past ``min(topk, visible)``). Every output buffer is
poisoned first; the candidate buffers too (a slot the fused kernel leaves unwritten shows).
"""
import math

import pytest
import torch

from dsv4_ops.reference import fp8_cache as fp8
from dsv4_ops.reference import ops as ref
from fp8_cases import poisoned, write_index_keys
from indexer_topk_cases import I32, check_candidates, kernel_inputs, op_body_launches, v4_integer_inputs
from launchers import DEVICE, kernel_module

indexer = kernel_module("indexer")

HI, DI = 4, 32


def fused(chunk, **kw):
    return dict(TOPK_FUSED=chunk, BLOCK_N=16, **kw)


def inputs(B, S, N, visible, seed=0, **kw):
    torch.manual_seed(seed)
    return kernel_inputs(B, S, HI, DI, N, torch.float32, integer=True,
                         visible=torch.tensor(visible, dtype=I32, device=DEVICE), **kw)


def run_fused(poison, q, w, keys, visible, topk, chunk, **kw):
    """The forced fused path, launched step by step: checks the launch set (one scores launch
    with stage 1 fused in, then stage 2 alone), what the fused kernel left in the candidate
    buffers (each chunk's top-k in index order, then -1 / -inf; the reference rule on the
    reference scores), and returns stage 2's picks."""
    B, S = visible.shape
    N = indexer.entries(keys)
    out = poison(torch.empty(B, S, topk, dtype=I32, device=DEVICE))
    launches = indexer.indexer_launches(q, w, keys, visible, topk, out, config=fused(chunk, **kw))
    assert len(launches.groups) == 1
    scoring, rows, loop = launches.groups[0]
    P = -(-N // chunk)
    assert scoring.meta["TOPK_FUSED"] == 1 and scoring.meta["CHUNK"] == chunk and scoring.grid == (B * S, P)
    assert loop is None and len(rows) == 1 and rows[0].meta["STAGE"] == 2 and rows[0].meta["SEG"] == chunk
    cand_idx, cand_scores = scoring.args[5], scoring.args[6]
    assert cand_idx.shape == cand_scores.shape == (B, S, P * topk)
    cand_idx.fill_(1)  # a valid-looking index and NaN: an unwritten slot shows
    cand_scores.fill_(float("nan"))
    indexer.launch(indexer.indexer_scores_kernel, scoring)
    scores = ref.indexer_scores(q, w, fp8.read_keys(keys) if keys.dtype == torch.uint8 else keys, visible)
    check_candidates(scores, visible, topk, chunk, cand_idx, cand_scores)
    indexer.launch(indexer.topk_row_kernel, rows[0])
    return out


def check(poison, q, w, keys, visible, topk, chunk, **kw):
    got = run_fused(poison, q, w, keys, visible, topk, chunk, **kw)
    want = ref.indexer_topk(q, w, keys, visible, topk)
    assert torch.equal(got, want), f"\ngot  {got.tolist()}\nwant {want.tolist()}"
    # and the raw launcher (the op's loop over the groups) gives the same
    again = indexer.indexer_topk(q, w, keys, visible, topk, out=poison(torch.empty_like(want)),
                                 config=fused(chunk, **kw))
    assert torch.equal(again, want)
    return got


# --------------------------------------------------------------------------------------
# the rule (a pure function of sizes, no kernels)
# --------------------------------------------------------------------------------------
def test_fused_is_chosen_where_the_h200_sweep_measured_it_faster():
    cfg = indexer.indexer_config
    # V4-Flash indexer (64 heads x 128, top-512). 32K context (8192 keys): batch 128 fuses in 1024-entry
    # chunks (101.5 against 113.6 us unfused), batch 64 does not (58.6 fused against 57.0)
    c = cfg(B=128, S=1, HI=64, DI=128, N=8192, topk=512, sms=132)
    assert (c["TOPK_FUSED"], c["fused_warps"]) == (1024, 0) and indexer.fused_warps(1024) == 4
    c = cfg(B=64, S=1, HI=64, DI=128, N=8192, topk=512, sms=132)
    assert c["TOPK_FUSED"] == 0 and c["TOPK_SPLIT"] == 4096
    # 128K context (32768 keys): 2048-entry chunks at batch 64 and 128 (186.2 / 331.1 against 196.8 / 406.0)
    assert cfg(B=64, S=1, HI=64, DI=128, N=32768, topk=512, sms=132)["TOPK_FUSED"] == 2048
    assert cfg(B=128, S=1, HI=64, DI=128, N=32768, topk=512, sms=132)["TOPK_FUSED"] == 2048
    # FP8 keys: never (B=64 x 128K 205.6 fused against 187.4 us unfused on the H200)
    assert cfg(B=128, S=1, HI=64, DI=128, N=32768, topk=512, sms=132, keys_fp8=True)["TOPK_FUSED"] == 0
    # 8 warps gave other indices on the H200: every chunk takes 4
    assert indexer.fused_warps(2048) == 4
    # a prefill chunk's rows count like decode rows (B * S)
    assert cfg(B=16, S=8, HI=64, DI=128, N=8192, topk=512, sms=132)["TOPK_FUSED"] == 1024
    # Pro's top-1024: a chunk keeps at most half of what it scores (1024 cannot; 2048 at long rows can)
    assert cfg(B=128, S=1, HI=64, DI=128, N=8192, topk=1024, sms=132)["TOPK_FUSED"] == 0
    assert cfg(B=128, S=1, HI=64, DI=128, N=32768, topk=1024, sms=132)["TOPK_FUSED"] == 2048
    # fewer than 64 rows (decode at batch 1-32): the separate split
    for B in (1, 16, 32):
        c = cfg(B=B, S=1, HI=64, DI=128, N=32768, topk=512, sms=132)
        assert c["TOPK_FUSED"] == 0 and c["TOPK_SPLIT"] > 0, B
    # short rows (at most 4096 scores: 16K context) never fuse, whatever the batch
    for B in (64, 128, 1024):
        assert cfg(B=B, S=1, HI=64, DI=128, N=4096, topk=512, sms=132)["TOPK_FUSED"] == 0
    # candidates past the row kernel's row (TOPK_ROW): not fused; ROCm: never
    assert cfg(B=64, S=1, HI=64, DI=128, N=1 << 18, topk=512, sms=132)["TOPK_FUSED"] == 0
    assert cfg(B=128, S=1, HI=64, DI=128, N=8192, topk=512, sms=304, backend="hip")["TOPK_FUSED"] == 0


def test_fused_launches_at_batch128_32k_and_the_override_back_to_the_split():
    B, N, topk = 128, 8192, 512
    m = dict(device="meta")
    q, w = torch.empty(B, 1, 64, 128, dtype=torch.bfloat16, **m), torch.empty(B, 1, 64, **m)
    keys, visible = torch.empty(B, N, 128, dtype=torch.bfloat16, **m), torch.empty(B, 1, dtype=I32, **m)
    (scoring, rows, loop), = indexer.indexer_launches(q, w, keys, visible, topk).groups
    assert scoring.grid == (128, 8) and scoring.meta["TOPK_FUSED"] == 1 and scoring.meta["CHUNK"] == 1024
    assert scoring.meta["num_warps"] == 4 and scoring.meta["KPAD"] == 512
    assert loop is None and len(rows) == 1
    assert rows[0].grid == (128,) and rows[0].meta["STAGE"] == 2 and rows[0].meta["ROW"] == 4096
    assert rows[0].args[0] is scoring.args[6] and rows[0].args[3] is scoring.args[5]  # stage 2 reads stage 1's
    # batch 64: the unfused scores launch, then the separate split's two stages
    (scoring, rows, loop), = indexer.indexer_launches(q[:64], w[:64], keys[:64], visible[:64], topk).groups
    assert scoring.meta["TOPK_FUSED"] == 0 and [r.meta["STAGE"] for r in rows] == [1, 2]
    # and a forced chunk where the default does not fuse (batch 1): 4 warps whatever the chunk
    (scoring, rows, _), = indexer.indexer_launches(q[:1], w[:1], keys[:1], visible[:1], topk,
                                                   config=dict(TOPK_FUSED=4096)).groups
    assert scoring.grid == (1, 2) and scoring.meta["num_warps"] == 4 and rows[0].meta["ROW"] == 1024
    with pytest.raises(AssertionError, match="power of two"):
        indexer.indexer_launches(q, w, keys, visible, topk, config=dict(TOPK_FUSED=3000))


# --------------------------------------------------------------------------------------
# exactness, forced fused path under the interpreter
# --------------------------------------------------------------------------------------
N_ROW = 300  # chunks of 64: 5, the last 44 entries


def test_fused_visible_lengths_in_one_launch(poison):
    """Rows of one launch (``S > 1``) with their own ``visible``: none, one, fewer than topk, a
    chunk boundary, one past it, two chunks, mid last chunk, all, and out of range (read as
    clamped); the invisible tails are never picked and whole chunks past ``visible`` write fillers
    only."""
    visible = [[0, 1, 5, 64, 65, 128], [299, 300, -3, 2**31 - 1, 190, 33]]
    check(poison, *inputs(2, 6, N_ROW, visible), 16, 64)


def test_fused_topk_wider_than_half_a_chunk(poison):
    """``topk > CHUNK / 2`` (the rule never picks it, an override may): 24 of 32 and 48 of 32 (a
    full chunk keeps all its visible entries, then fillers); a pool narrower than topk."""
    visible = [[N_ROW, 31, 32, 33, 100]]
    q, w, keys, vis = inputs(1, 5, N_ROW, visible, seed=1)
    check(poison, q, w, keys, vis, 24, 32)
    check(poison, q, w, keys, vis, 48, 32)
    check(poison, *inputs(1, 2, 40, [[2**31 - 1, 23]], seed=2), 64, 16)


def test_fused_rows_shorter_than_a_chunk(poison):
    """One chunk longer than the row (``N < CHUNK``): stage 2 merges a single chunk's picks."""
    check(poison, *inputs(2, 2, 40, [[40, 7], [0, 39]], seed=3), 16, 64)


def test_fused_heavy_ties_across_chunks(poison):
    """Keys of two values and queries of ones: a handful of distinct scores over the row, each
    tie group crossing chunk boundaries; the k-th score's ties go to the lowest indices of the
    row. Then every score equal: the lowest indices."""
    torch.manual_seed(4)
    B, S, N = 1, 3, N_ROW
    q = torch.ones(B, S, HI, DI, device=DEVICE)
    w = torch.ones(B, S, HI, device=DEVICE)
    keys = torch.randint(0, 2, (B, N, DI), device=DEVICE).float()
    keys[..., 3:] = keys[..., :1]  # 4 bits of freedom per key: scores in {0, 29, 30, 32, ...}, many ties
    visible = torch.tensor([[300, 211, 33]], dtype=I32, device=DEVICE)
    for chunk in (16, 64):
        check(poison, q, w, keys, visible, 32, chunk)
    keys = torch.ones(B, N, DI, device=DEVICE)
    got = check(poison, q, w, keys, visible, 32, 64)
    assert got[0, 0].tolist() == list(range(32))


def test_fused_zero_scores_and_relu(poison):
    """Negative weights and queries that make most dots negative: many scores exactly 0 (relu),
    some negative (the weights), ties at 0 across chunks."""
    q, w, keys, visible = inputs(1, 2, N_ROW, [[300, 150]], seed=5)
    w = -w.abs()
    check(poison, q, w, keys, visible, 32, 64)


def test_fused_digit_widths(poison):
    check(poison, *inputs(1, 2, N_ROW, [[300, 150]], seed=6), 32, 64, TOPK_BITS=3)


def test_fused_in_token_groups(poison):
    """A prefill chunk whose scores exceed the scratch budget: groups of query tokens, each its
    own fused launch into views of the scratch and of ``out``."""
    B, S, N, topk = 2, 5, 200, 16
    q, w, keys, visible = inputs(B, S, N, [[200, 3, 64, 65, 0], [17, 190, 128, 199, 2**31 - 1]], seed=7)
    out = poison(torch.empty(B, S, topk, dtype=I32, device=DEVICE))
    budget = 4 * B * N * 2  # two tokens a group: 2, 2, 1
    launches = indexer.indexer_launches(q, w, keys, visible, topk, out, config=fused(64), budget=budget)
    assert [g[0].grid for g in launches.groups] == [(4, 4), (4, 4), (2, 4)]
    assert all(g[0].meta["TOPK_FUSED"] == 1 and len(g[1]) == 1 for g in launches.groups)
    got = indexer.indexer_topk(q, w, keys, visible, topk, out=out, config=fused(64), budget=budget)
    assert torch.equal(got, ref.indexer_topk(q, w, keys, visible, topk))


@pytest.mark.parametrize("offset, reader", [(0, 2), (1, 1)], ids=["word_reader", "byte_reader"])
def test_fused_fp8_keys(offset, reader, poison):
    """FP8 keys (4 a page; 4-byte aligned: read as words; at an odd byte: a byte per lane): the
    fused kernel's scores are the unfused kernel's, so its picks are the unfused path's and the
    reference's."""
    torch.manual_seed(8)
    B, S, N = 2, 3, 150
    shape = fp8.IndexerLayout(DI, 4).shape(B, N)
    raw = poisoned((math.prod(shape) + offset,), DEVICE, byte=0xFF)
    keys = write_index_keys(raw[offset:].view(shape), torch.randint(-2, 3, (B, N, DI), device=DEVICE).float())
    q = torch.randint(-2, 3, (B, S, HI, DI), device=DEVICE).float()
    w = torch.randint(-2, 3, (B, S, HI), device=DEVICE).float()
    visible = torch.tensor([[150, 64, 0], [65, 149, 9]], dtype=I32, device=DEVICE)
    assert indexer.scores_launch(q, w, keys, visible)[1].meta["KEYS_FP8"] == reader
    got = check(poison, q, w, keys, visible, 16, 64)
    unfused = indexer.indexer_topk(q, w, keys, visible, 16, config=dict(TOPK_FUSED=0))
    assert torch.equal(got, unfused)


def test_fused_through_the_op_body(monkeypatch):
    """The ``dsv4::indexer_topk`` body's Triton branch launches the fused scores kernel and
    stage 2 through ``wrap_triton`` when the config fuses (forced here with small chunks)."""
    launched = op_body_launches(monkeypatch, **fused(64))
    q, w, keys, visible = inputs(1, 2, 200, [[200, 90]], seed=9)
    got = torch.ops.dsv4.indexer_topk(q, w, keys, visible, 24)
    assert launched == ["indexer_scores_kernel", "topk_row_kernel"]
    assert torch.equal(got, ref.indexer_topk(q, w, keys, visible, 24))


# --------------------------------------------------------------------------------------
# the default fused path, compiled, at the size that chooses it
# --------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_fused_default_at_batch128_32k_on_gpu(poison):
    """B=128 x 8192 keys (32K context), V4-Flash indexer widths, bf16, integer-valued inputs (exact
    scores, many ties): the default config fuses, and equals the reference and the unfused path."""
    dev = torch.device("cuda")
    if indexer.backend() == "hip":
        pytest.skip("ROCm's config never fuses")
    B, S, N, topk = 128, 1, 8192, 512
    q, w, keys = v4_integer_inputs(B, N, dev)
    visible = torch.randint(0, N + 1, (B, S), dtype=I32, device=dev)
    visible[:4, 0] = torch.tensor([N, 2048, 2049, 0], dtype=I32)
    (scoring, _, _), = indexer.indexer_launches(q, w, keys, visible, topk).groups
    assert scoring.meta["TOPK_FUSED"] == 1
    want = ref.indexer_topk(q, w, keys, visible, topk)
    assert torch.equal(indexer.indexer_topk(q, w, keys, visible, topk, out=poison(torch.empty_like(want))), want)
    assert torch.equal(indexer.indexer_topk(q, w, keys, visible, topk, config=dict(TOPK_FUSED=0)), want)
