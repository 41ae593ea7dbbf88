"""The cache_write op's test inputs: a cache, values and distinct slots per row (some -1), and the
opcheck cases."""
import torch

I32 = torch.int32


def distinct_slots(B, S, N, p_skip=0.3, device="cpu"):
    """[B, S] int32: distinct slots per row (a random permutation prefix), some -1."""
    slots = torch.stack([torch.randperm(max(N, S), device=device)[:S] for _ in range(B)]).to(I32)
    skip = (torch.rand(B, S, device=device) < p_skip) | (slots >= N)
    return torch.where(skip, torch.full_like(slots, -1), slots)


def make_inputs(B=2, N=8, S=3, C=5, dtype=torch.float32, device="cpu"):
    cache = torch.randn(B, N, C, device=device).to(dtype)
    values = torch.randn(B, S, C, device=device).to(dtype)
    return [cache, values, distinct_slots(B, S, N, device=device)]


OPCHECK_CASES = {
    "basic": dict(),
    "one_token": dict(S=1),
    "all_-1": dict(N=0),
    "full_ring": dict(N=4, S=4),
}
