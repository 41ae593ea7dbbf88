"""The plan op's test inputs: ``cfg`` (the static sizes, with the smallest window ring each mode
allows by default) and the opcheck cases."""
import torch

import dsv4_ops

I32 = torch.int32
FIELDS = dsv4_ops.Plan._fields


def cfg(num_tokens=4, steps=1, window=4, win_ring=None, win_concat=False, csa_ratio=4, csa_ring=8, hca_ratio=8,
        hca_ring=8):
    if win_ring is None:
        win_ring = window + num_tokens - 1 + (0 if win_concat else 2)
    return dict(num_tokens=num_tokens, steps=steps, window=window, win_ring=win_ring, win_concat=win_concat,
                csa_ratio=csa_ratio, csa_ring=csa_ring, hca_ratio=hca_ratio, hca_ring=hca_ring)


def run_plan(lengths, n_new, c, device="cpu"):
    lengths = torch.tensor(lengths, dtype=I32, device=device)
    n_new = torch.tensor(n_new, dtype=I32, device=device)
    return dsv4_ops.plan(lengths, n_new, *c.values())


def args_of(lengths, n_new, c):
    return [torch.tensor(lengths, dtype=I32), torch.tensor(n_new, dtype=I32), *c.values()]


OPCHECK_CASES = {
    "decode": ([5, 0], [1, 1], cfg(num_tokens=1)),
    "verify_with_padding_row": ([7, 126, 3], [4, 0, 2], cfg(num_tokens=4)),
    "concat_prefill": ([0, 13], [9, 5], cfg(num_tokens=9, win_concat=True, hca_ratio=4, hca_ring=4)),
    "mtp_steps": ([127, 128], [1, 1], cfg(num_tokens=1, steps=3)),
}
