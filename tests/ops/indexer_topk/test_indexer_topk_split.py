"""The split (two-stage) top-k of the lightning indexer vs the reference top-k, exactly.

Stage 1 takes each ``SEG``-entry segment's top-k (one program per segment), stage 2 merges the
candidates of a row (``lowering/triton/indexer.py``). Here the split is forced on with small
segments (``TOPK_SPLIT`` 16..128) so that rows of a few hundred scores span several segments,
the last one cut short; on a machine without CUDA the kernels run under ``TRITON_INTERPRET=1``.
Every output buffer is poisoned first. The ``gpu`` tests run the default (unforced) split at
the batch-1 decode sizes that choose it.
"""
import pytest
import torch

from dsv4_ops.reference import ops as ref
from indexer_topk_cases import (I32, NINF, check_candidates, kernel_inputs, op_body_launches, reference_topk,
                                v4_integer_inputs)
from launchers import DEVICE, kernel_module

indexer = kernel_module("indexer")


def split_config(B, S, N, topk, seg, **kw):
    return dict(indexer.indexer_config(B, S, 4, 32, N, topk), TOPK_SPLIT=seg, **kw)


def run_split(poison, scores, visible, topk, seg, **kw):
    """The forced split over ``scores``; checks it did split (two row launches, stages 1 and 2)
    and what stage 1 left in the candidate buffers (poisoned with a valid-looking index and
    NaN first, so a slot stage 1 leaves unwritten shows)."""
    B, S, N = scores.shape
    cfg = split_config(B, S, N, topk, seg, **kw)
    out = poison(torch.empty(B, S, topk, dtype=I32, device=DEVICE))
    rows, loop = indexer.topk_launches(scores, visible, topk, out, cfg)
    assert loop is None and [r.meta["STAGE"] for r in rows] == [1, 2]
    assert rows[0].grid == (B * S, -(-N // seg)) and rows[0].meta["ROW"] == seg
    cand_idx, cand_scores = rows[0].args[2], rows[0].args[3]
    cand_idx.fill_(1)
    cand_scores.fill_(float("nan"))
    for r in rows:
        indexer.launch(indexer.topk_row_kernel, r)
    check_candidates(scores, visible, topk, seg, cand_idx, cand_scores)
    return out


def check(poison, scores, visible, topk, seg, **kw):
    scores, visible = scores.to(DEVICE), torch.as_tensor(visible, dtype=I32).to(DEVICE)
    got = run_split(poison, scores, visible, topk, seg, **kw)
    want = reference_topk(scores, visible, topk)
    assert torch.equal(got, want), f"\ngot  {got.tolist()}\nwant {want.tolist()}"
    return got


# --------------------------------------------------------------------------------------
# the rule (a pure function of sizes, no kernels)
# --------------------------------------------------------------------------------------
def test_split_is_chosen_where_the_h200_sweeps_found_it_faster():
    cfg = indexer.indexer_config
    # the measured points (8192-8258 scores, top-512; sweep_kernels.py): 2048-entry segments at 1, 8,
    # 16 rows; 4096 at 64 rows (2048 would take 256 programs, two waves); none at 128 rows
    assert cfg(B=1, S=1, HI=64, DI=128, N=8258, topk=512, sms=132)["TOPK_SPLIT"] == 2048
    assert cfg(B=8, S=1, HI=64, DI=128, N=8258, topk=512, sms=132)["TOPK_SPLIT"] == 2048
    assert cfg(B=16, S=1, HI=64, DI=128, N=8192, topk=512, sms=132)["TOPK_SPLIT"] == 2048
    assert cfg(B=64, S=1, HI=64, DI=128, N=8192, topk=512, sms=132)["TOPK_SPLIT"] == 4096
    assert cfg(B=128, S=1, HI=64, DI=128, N=8192, topk=512, sms=132)["TOPK_SPLIT"] == 0
    # the shorter of the longer stage: 32K scores x top-512 in 4096-entry segments (8 x 512 candidates),
    # not 2048 (a 8192-candidate merge); Pro's top-1024 at 32K context: 4096 (2048-entry segments would
    # merge 5 x 1024 candidates)
    assert cfg(B=1, S=1, HI=64, DI=128, N=32768, topk=512, sms=132)["TOPK_SPLIT"] == 4096
    assert cfg(B=1, S=1, HI=64, DI=128, N=8258, topk=1024, sms=132)["TOPK_SPLIT"] == 4096
    # 64 rows of 32K scores: 2 segments each (128 programs, one wave), not 8 (512)
    assert cfg(B=8, S=8, HI=64, DI=128, N=32768, topk=512, sms=132)["TOPK_SPLIT"] == 16384
    # rows that fill the GPU, or one SM: one program per row
    assert cfg(B=132, S=1, HI=64, DI=128, N=8258, topk=512, sms=132)["TOPK_SPLIT"] == 0
    assert cfg(B=2, S=66, HI=64, DI=128, N=8258, topk=512, sms=132)["TOPK_SPLIT"] == 0
    assert cfg(B=1, S=1, HI=64, DI=128, N=8258, topk=512, sms=1)["TOPK_SPLIT"] == 0
    # ROCm keeps topk_kernel for every row
    assert cfg(B=1, S=1, HI=64, DI=128, N=8258, topk=512, sms=304, backend="hip")["TOPK_SPLIT"] == 0
    # rows of at most 4096 scores (never timed split), or of at most one segment: one program
    assert cfg(B=1, S=1, HI=64, DI=128, N=4096, topk=512, sms=132)["TOPK_SPLIT"] == 0
    assert cfg(B=1, S=1, HI=64, DI=128, N=4097, topk=512, sms=132)["TOPK_SPLIT"] == 2048
    assert cfg(B=1, S=1, HI=64, DI=128, N=1090, topk=512, sms=132)["TOPK_SPLIT"] == 0
    # a segment that keeps all it reads, or candidates past a register row: no split
    assert cfg(B=1, S=1, HI=64, DI=128, N=8258, topk=16384, sms=132)["TOPK_SPLIT"] == 0
    assert cfg(B=1, S=1, HI=64, DI=128, N=4 << 20, topk=512, sms=132)["TOPK_SPLIT"] == 0


def test_split_config_forces_the_launches_on_and_off():
    """``TOPK_SPLIT`` overrides: 0 keeps the one row launch where the default splits; a segment
    size splits where the default does not (and rows of at most one segment never split)."""
    B, S, N, topk = 1, 1, 8258, 512
    scores = torch.empty(B, S, N, device="meta")
    visible = torch.empty(B, S, dtype=I32, device="meta")
    out = torch.empty(B, S, topk, dtype=I32, device="meta")
    cfg = indexer.indexer_config(B, S, 64, 128, N, topk, sms=132)
    rows, loop = indexer.topk_launches(scores, visible, topk, out, cfg)
    assert loop is None and [r.meta["STAGE"] for r in rows] == [1, 2]
    stage1, stage2 = rows
    assert stage1.grid == (1, 5) and stage1.meta["ROW"] == stage1.meta["SEG"] == 2048
    assert stage2.grid == (1,) and stage2.meta["ROW"] == 4096  # next_pow2(5 * 512) candidates
    cand_idx, cand_scores = stage1.args[2], stage1.args[3]
    assert cand_idx.shape == cand_scores.shape == (1, 1, 5 * 512)
    assert cand_idx.dtype == I32 and cand_scores.dtype == torch.float32
    assert stage2.args[0] is cand_scores and stage2.args[2] is out and stage2.args[3] is cand_idx
    rows, loop = indexer.topk_launches(scores, visible, topk, out, dict(cfg, TOPK_SPLIT=0))
    assert loop is None and len(rows) == 1 and rows[0].meta["STAGE"] == 0 and rows[0].meta["ROW"] == 16384
    big = indexer.indexer_config(256, S, 64, 128, N, topk, sms=132)
    assert big["TOPK_SPLIT"] == 0
    rows, _ = indexer.topk_launches(scores, visible, topk, out, dict(big, TOPK_SPLIT=8192))
    assert [r.meta["STAGE"] for r in rows] == [1, 2] and rows[0].grid == (1, 2)
    rows, _ = indexer.topk_launches(scores[..., :4096], visible, topk, out, dict(big, TOPK_SPLIT=4096))
    assert len(rows) == 1 and rows[0].meta["STAGE"] == 0
    with pytest.raises(AssertionError, match="power of two"):
        indexer.topk_launches(scores, visible, topk, out, dict(big, TOPK_SPLIT=3000))


# --------------------------------------------------------------------------------------
# exactness, forced split under the interpreter
# --------------------------------------------------------------------------------------
N_ROW = 300  # 5 segments of 64, the last 44 entries


@pytest.mark.parametrize("vis, topk", [(5, 16), (40, 16), (0, 16), (N_ROW, 16), (N_ROW, 32), (64, 32), (65, 32),
                                       (128, 16), (299, 32)],
                         ids=["below_topk", "inside_first_segment", "none", "all", "all_k32", "one_segment",
                              "one_past_a_segment", "two_segments", "mid_last_segment"])
def test_split_random_scores(vis, topk, poison):
    scores = torch.randn(1, 1, N_ROW)
    check(poison, scores, [[vis]], topk, 64)


def test_split_rows_of_one_batch_see_different_prefixes(poison):
    """Rows of one launch with their own ``visible`` (also out of range: read as clamped),
    and a pool that is not a whole number of segments."""
    B, S, N = 2, 4, 300
    scores = torch.randint(-40, 40, (B, S, N)).float()
    visible = [[300, 7, 0, 129], [-3, 2**31 - 1, 64, 250]]
    check(poison, scores, visible, 32, 64)
    check(poison, scores, visible, 16, 128)


@pytest.mark.parametrize("seg", [16, 64])
def test_split_heavy_ties_across_segments(seg, poison):
    """Three distinct scores over the row: every tie group crosses segment boundaries, and the
    k-th score's ties must go to the lowest indices of the whole row, not of a segment."""
    B, S, N = 1, 3, 300
    scores = torch.randint(0, 3, (B, S, N)).float()
    check(poison, scores, [[300, 211, 33]], 32, seg)
    # a high tier only in the last segments, ties below it at the top of earlier segments
    scores = torch.zeros(B, S, N)
    scores[..., 250:] = 1.0
    scores[..., ::7] = 0.5
    check(poison, scores, [[300, 260, 249]], 32, seg)


def test_split_all_equal_scores_pick_the_lowest_indices(poison):
    scores = torch.full((1, 2, 300), 2.5)
    got = check(poison, scores, [[300, 70]], 32, 64)
    assert got[0, 0].tolist() == list(range(32)) and got[0, 1].tolist() == list(range(32))


def test_split_signed_zeros_are_one_score(poison):
    """-0.0 and +0.0 tie (the stable sort's rule): picked by index across segments."""
    N = 300
    scores = torch.where(torch.rand(1, 2, N) < 0.5, -0.0, 0.0)
    scores[..., ::23] = torch.randn(1, 2, scores[..., ::23].shape[-1])  # a few other scores
    assert (scores == 0).sum() > 200 and torch.signbit(scores[scores == 0]).any()
    check(poison, scores, [[300, 190]], 32, 64)


def test_split_minus_inf_scores_inside_visible_still_beat_the_fillers(poison):
    """A visible entry scored ``-inf`` is still pickable (the reference's stable sort takes it
    before the invisible ones); stage 1's ``-inf`` fillers never are, also where they sit
    before later segments' candidates (``topk > SEG``: a full segment keeps fewer than topk)."""
    N = 300
    scores = torch.full((1, 2, N), NINF)
    scores[..., 3] = 1.0
    scores[..., 200] = 2.0
    check(poison, scores, [[300, 130]], 32, 64)
    check(poison, scores[..., :100], [[100, 40]], 32, 16)


def test_split_topk_wider_than_a_segment(poison):
    """``topk > SEG`` (allowed when forced): a segment keeps all its visible entries and fills
    the rest of its ``topk`` candidate slots."""
    scores = torch.randint(0, 5, (1, 2, 100)).float()
    check(poison, scores, [[100, 23]], 32, 16)
    # a pool narrower than topk, visible past it: min(topk, N) picks, not the candidates' count
    scores = torch.randint(0, 5, (1, 2, 40)).float()
    check(poison, scores, [[2**31 - 1, 40]], 64, 16)


def test_split_digit_widths(poison):
    """Both stages with other digit widths (8-bit: the select's last pass re-reads no bits; 3-bit)."""
    scores = torch.randint(-3, 4, (1, 2, 300)).float()
    for bits in (3, 8):
        check(poison, scores, [[300, 150]], 32, 64, TOPK_BITS=bits)


def test_split_through_indexer_topk_matches_reference(poison):
    """The whole raw launcher (scores kernel, then the split) with integer-valued inputs: exact
    scores with many ties, so the picks equal ``ref.indexer_topk`` exactly."""
    B, S, HI, DI, N, topk = 2, 2, 4, 32, 300, 16
    q, w, keys, visible = kernel_inputs(B, S, HI, DI, N, torch.float32, integer=True,
                                        visible=torch.tensor([[300, 71], [0, 190]], dtype=I32, device=DEVICE))
    out = poison(torch.empty(B, S, topk, dtype=I32, device=DEVICE))
    launches = indexer.indexer_launches(q, w, keys, visible, topk, out, config=dict(TOPK_SPLIT=64))
    assert [len(g[1]) for g in launches.groups] == [2]
    got = indexer.indexer_topk(q, w, keys, visible, topk, out=out, config=dict(TOPK_SPLIT=64))
    assert got is out
    assert torch.equal(got, ref.indexer_topk(q, w, keys, visible, topk))


def test_split_through_the_op_body(monkeypatch):
    """The ``dsv4::indexer_topk`` body's Triton branch launches both stages through
    ``wrap_triton`` when the config splits (forced here with small segments)."""
    launched = op_body_launches(monkeypatch, TOPK_SPLIT=64)
    q, w, keys, visible = kernel_inputs(1, 2, 4, 32, 200, torch.float32, integer=True,
                                        visible=torch.tensor([[200, 90]], dtype=I32, device=DEVICE))
    got = torch.ops.dsv4.indexer_topk(q, w, keys, visible, 24)
    assert launched == ["indexer_scores_kernel", "topk_row_kernel", "topk_row_kernel"]
    assert torch.equal(got, ref.indexer_topk(q, w, keys, visible, 24))


# --------------------------------------------------------------------------------------
# the default split, compiled, at the sizes that choose it
# --------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_split_default_at_batch1_decode_on_gpu(poison):
    """B=1, 8258 pool entries, top-512: the default config splits; random scores with ties."""
    N, topk = 8258, 512
    dev = torch.device("cuda")
    if indexer.backend() == "hip":
        pytest.skip("ROCm's config never splits")
    scores = (torch.randint(0, 200, (1, 1, N), device=dev).float() / 8).contiguous()  # many ties
    cfg = indexer.indexer_config(1, 1, 64, 128, N, topk, indexer.sm_count(dev), indexer.backend())
    assert cfg["TOPK_SPLIT"] > 0
    for vis in (N, 8200, 4097, 4096, 300, 0):
        visible = torch.tensor([[vis]], dtype=I32, device=dev)
        out = poison(torch.empty(1, 1, topk, dtype=I32, device=dev))
        got = indexer.topk_from_scores(scores, visible, topk, out, cfg)
        assert torch.equal(got, reference_topk(scores, visible, topk)), vis
    # a few rows of one launch, each with its own visible
    scores = torch.randint(0, 50, (2, 3, N), device=dev).float()
    visible = torch.tensor([[N, 8001, 4100], [513, 0, 6000]], dtype=I32, device=dev)
    cfg = indexer.indexer_config(2, 3, 64, 128, N, topk, indexer.sm_count(dev), indexer.backend())
    assert cfg["TOPK_SPLIT"] > 0
    out = poison(torch.empty(2, 3, topk, dtype=I32, device=dev))
    assert torch.equal(indexer.topk_from_scores(scores, visible, topk, out, cfg), reference_topk(scores, visible, topk))


@pytest.mark.gpu
def test_split_through_the_op_at_batch1_32k_context():
    """``dsv4::indexer_topk`` at batch 1 x 32K context (V4-Flash indexer: 64 heads x 128, bf16,
    8258 pool entries, top-512), eager and compiled, with integer-valued inputs (exact scores,
    many ties): the default config splits, and the picks equal the reference's exactly."""
    dev = torch.device("cuda")
    if indexer.backend() == "hip":
        pytest.skip("ROCm's config never splits")
    B, N, topk = 1, 8258, 512
    q, w, keys = v4_integer_inputs(B, N, dev)
    launches = indexer.indexer_launches(q, w, keys, torch.tensor([[N]], dtype=I32, device=dev), topk)
    assert [len(g[1]) for g in launches.groups] == [2]
    compiled = torch.compile(lambda *a: torch.ops.dsv4.indexer_topk(*a, topk), fullgraph=True)
    for vis in (N, 8192, 5000, 100):
        visible = torch.tensor([[vis]], dtype=I32, device=dev)
        want = ref.indexer_topk(q, w, keys, visible, topk)
        assert torch.equal(torch.ops.dsv4.indexer_topk(q, w, keys, visible, topk), want), vis
        assert torch.equal(compiled(q, w, keys, visible), want), vis
