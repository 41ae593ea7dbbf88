"""The sinkhorn op's test inputs: positive matrices like the mHC softmax + hc_eps, and the opcheck
cases."""
import torch


def make_comb(*lead, N=4, device="cpu", dtype=torch.float32):
    """Positive matrices like the mHC softmax + hc_eps: far from doubly stochastic, never zeros."""
    return (torch.rand(*lead, N, N, device=device) * 3 + 1e-3).softmax(-1).add(1e-6).to(dtype)


OPCHECK_CASES = {"decode": ((1, 1), 20), "prefill_chunk": ((2, 9), 20), "one_iter": ((3,), 1), "hc2": ((5,), 7)}
