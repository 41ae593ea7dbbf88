"""The gemv op's test inputs: ``x [T, G, K]`` and ``weight [G, N, K]`` scaled to keep outputs O(1), the
float64 oracle, and the opcheck cases."""
import torch


def make_case(T, G, N, K, device="cpu", dtype=torch.float32):
    x = torch.randn(T, G, K, device=device).to(dtype)
    w = (torch.randn(G, N, K, device=device) * max(K, 1)**-0.5).to(dtype)
    return x, w


def oracle(x, w):
    return torch.einsum("tgk,gnk->tgn", x.double().cpu(), w.double().cpu())


OPCHECK_CASES = {"decode_b1": (1, 1, 48, 32), "grouped": (2, 4, 16, 24), "eight_tokens": (8, 1, 8, 40)}
