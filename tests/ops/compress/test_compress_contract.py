"""dsv4::compress as an op: opcheck on decode and prefill chunks (overlapping CSA and HCA rates),
nothing emitted and an empty pool; the fake matches the real op; the public wrapper refuses bad
input naming the argument and the limit (widths, rope dims, dtypes, device, ring slots, emitted
blocks out of the pool, past the new rows, older than the ring, past the rope table); the raw op
skips blocks outside the pool like -1 and leaves an entry past the rope table unrotated."""
import pytest
import torch
from torch.library import opcheck

import dsv4_ops
from compress_cases import I32, OPCHECK_CASES, make_inputs


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_compress_opcheck(case):
    opcheck(torch.ops.dsv4.compress.default, make_inputs(**OPCHECK_CASES[case]))


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_compress_fake_matches_real(fake_check, case):
    fake_check(torch.ops.dsv4.compress.default, *make_inputs(**OPCHECK_CASES[case]))


def test_compress_rejects_bad_input():
    def bad(match, change, **kw):
        args = make_inputs(**kw)
        change(args)
        with pytest.raises(ValueError, match=match):
            dsv4_ops.compress(*args)

    def setitem(i, value):
        return lambda a: a.__setitem__(i, value(a) if callable(value) else value)

    bad(r"compress: ring_kv.shape\[2\] must be 32 \(\(2 if overlap else 1\) \* d = 2 \* 16\), got 16",
        setitem(0, lambda a: a[0][..., :16]))
    bad(r"new_gate.shape\[2\] must be 16 \(\(2 if overlap else 1\) \* d = 1 \* 16\), got 32",
        lambda a: (a.__setitem__(0, a[0][..., :16]), a.__setitem__(1, a[1][..., :16]),
                   a.__setitem__(2, a[2][..., :16]), a.__setitem__(11, False)))
    bad(r"rope dims 2 \* cos.shape\[-1\] = 18 exceed d = 16", lambda a: (a.__setitem__(7, torch.rand(20, 9)),
                                                                       a.__setitem__(8, torch.rand(20, 9))))
    bad(r"start must be torch.int32, got torch.int64", setitem(4, lambda a: a[4].long()))
    bad(r"emit must be torch.int32, got torch.int64", setitem(5, lambda a: a[5].long()))
    bad(r"new_gate must have the dtype of ring_gate \(torch.float32\), got torch.bfloat16",
        setitem(3, lambda a: a[3].bfloat16()))
    bad(r"pool must be a floating-point tensor", setitem(9, lambda a: a[9].int()))
    bad(r"norm_weight.shape\[0\] must be 16 \(d of pool\), got 8", setitem(6, torch.rand(8)))
    bad(r"all tensors must be on one device: ring_kv is on cpu, pool is on meta", setitem(9, lambda a: a[9].to("meta")))
    bad(r"ring_kv.shape\[1\] must be >= 8 \(ring slots R >= 2 \* ratio = 8\), got 7",
        lambda a: (a.__setitem__(0, a[0][:, :7]), a.__setitem__(1, a[1][:, :7])))
    bad(r"emit\[0, 0\] = 5 is beyond pool entries N=2", setitem(5, torch.tensor([[5], [-1]], dtype=I32)))
    bad(r"emit\[1, 0\] = block 1 ends at position 7, past the new rows \(start\[1\] = 6, S = 1\)",
        setitem(5, torch.tensor([[0], [1]], dtype=I32)))
    bad(r"emit\[0, 0\] = block 0 needs position 0, older than the ring of R=8 slots holds \(start\[0\] = 11\)",
        setitem(5, torch.tensor([[0], [-1]], dtype=I32)), lengths=(11, 6))
    bad(r"cos.shape\[0\] must be >= 1 \(rope table rows\), got 0",
        lambda a: (a.__setitem__(7, torch.rand(0, 4)), a.__setitem__(8, torch.rand(0, 4))))
    bad(r"emit\[0, 0\] = block 3 is rotated at position 12, beyond the rope table rows P=12",
        lambda a: (a.__setitem__(7, torch.rand(12, 4)), a.__setitem__(8, torch.rand(12, 4))),
        lengths=(15, 6), N=5)


def test_compress_raw_op_skips_out_of_range_blocks(device):
    """The raw op (no wrapper checks), on every backend: emitted blocks outside [0, N) are
    skipped like -1, and an entry whose rope row is past the table is left unrotated (as by
    an identity row there)."""
    args = make_inputs(lengths=(3, 7), device=device)  # emits block 0 (row 0) and block 1 (row 1)
    N = args[9].shape[1]
    extra = torch.tensor([[N, -5], [2**31 - 1, 99]], dtype=I32, device=device)
    runs = []
    for emit in (torch.cat([args[5], extra], 1), torch.cat([args[5], torch.full_like(extra, -1)], 1)):
        pool = args[9].clone()
        torch.ops.dsv4.compress(*args[:5], emit, *args[6:9], pool, *args[10:])
        runs.append(pool)
    assert torch.equal(runs[0], runs[1])
    half = args[7].shape[-1]
    cut = (args[7][:4], args[8][:4])  # block 1 rotates at position 4: past a 4-row table
    identity = (torch.cat([cut[0], torch.ones(1, half, device=device)]),
                torch.cat([cut[1], torch.zeros(1, half, device=device)]))
    runs = []
    for cos, sin in (cut, identity):
        pool = args[9].clone()
        torch.ops.dsv4.compress(*args[:7], cos, sin, pool, *args[10:])
        runs.append(pool)
    assert torch.equal(runs[0], runs[1])
