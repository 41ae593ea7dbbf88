"""The compress op's test inputs: random rope tables, and direct op inputs in a consistent state
(``emit`` from plan, rings of R = c*m slots), with the opcheck cases."""
import math

import torch

import dsv4_ops

I32 = torch.int32
EPS = 1e-6


def rope_tables(P, half, device="cpu"):
    angle = torch.rand(P, half, device=device) * 2 * math.pi
    return angle.cos(), angle.sin()


def make_inputs(m=4, overlap=True, lengths=(3, 6), n_new=(1, 1), S=1, d=16, half=4, N=None, device="cpu"):
    """Direct op inputs in a consistent state: emit from plan, rings of R = c*m slots."""
    B, c = len(lengths), (2 if overlap else 1)
    L = torch.tensor(lengths, dtype=I32, device=device)
    p = dsv4_ops.plan(L, torch.tensor(n_new, dtype=I32, device=device), S, 1, 1, max(S, 1), False, m, 2 * m, m, m)
    emit = (p.csa_emit if overlap else p.hca_emit)[0]
    cos, sin = rope_tables(max(lengths) + S + m, half, device)
    N = max(lengths) // m + S // m + 1 if N is None else N
    return [torch.randn(B, c * m, c * d, device=device), torch.randn(B, c * m, c * d, device=device),
            torch.randn(B, S, c * d, device=device), torch.randn(B, S, c * d, device=device), L, emit,
            torch.rand(d, device=device) + 0.5, cos, sin, torch.randn(B, N, d, device=device), m, overlap, EPS]


OPCHECK_CASES = {
    "decode_overlap": dict(),
    "prefill_chunk_overlap": dict(lengths=(0, 5), n_new=(9, 4), S=9),
    "non_overlap": dict(m=8, overlap=False, lengths=(7, 15), n_new=(1, 1)),
    "nothing_emitted_all_-1": dict(lengths=(0, 0), n_new=(1, 2), S=2),
    "empty_pool": dict(lengths=(0, 0), n_new=(1, 1), N=0),
}
