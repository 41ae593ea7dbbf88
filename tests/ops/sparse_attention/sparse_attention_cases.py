"""The sparse_attention op's test inputs: random q, window rows, compressed entries and a sink, with
every index kind (real rows, -1 sentinels, a dense prefix), and the opcheck cases."""
import torch

I32 = torch.int32


def make_inputs(B=2, S=3, H=4, D=16, N=10, W=4, Nc=6, K=3, dtype=torch.float32, device="cpu"):
    """Random inputs with every index kind: real rows, -1 sentinels, a dense prefix."""
    q = torch.randn(B, S, H, D, device=device).to(dtype)
    kv = torch.randn(B, N, D, device=device).to(dtype)
    cmp = torch.randn(B, Nc, D, device=device).to(dtype)
    kv_idx = torch.randint(-1, max(N, 0), (B, S, W), dtype=I32, device=device) if N else \
        torch.full((B, S, W), -1, dtype=I32, device=device)
    cmp_idx = torch.randint(-1, Nc, (B, S, K), dtype=I32, device=device) if Nc else \
        torch.full((B, S, K), -1, dtype=I32, device=device)
    cmp_len = torch.randint(0, Nc + 1, (B, S), dtype=I32, device=device)
    sink = torch.randn(H, device=device)
    return [q, kv, kv_idx, cmp, cmp_idx, cmp_len, sink, D**-0.5]


OPCHECK_CASES = {
    "basic": dict(),
    "one_query": dict(B=1, S=1),
    "empty_pool": dict(Nc=0, K=0),
    "empty_pool_picks_all_-1": dict(Nc=0, K=3),
    "no_picks_dense_prefix": dict(K=0),
}
