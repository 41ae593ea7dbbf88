"""The moe_gemv op's test inputs: tokens, their experts and router weights, the experts' gate/up and
down weights, the SwiGLU clamp ``LIMIT``; the float64 per-assignment oracle; the opcheck cases."""
import torch

LIMIT = 10.0


def make_case(T, K, E, D, I, device="cpu", dtype=torch.float32, scale=0.2):
    x = torch.randn(T, D, device=device).to(dtype)
    indices = torch.randint(0, E, (T, K), device=device)
    weights = torch.rand(T, K, device=device) + 0.1
    w13 = (torch.randn(E, 2 * I, D, device=device) * scale).to(dtype)
    w2 = (torch.randn(E, D, I, device=device) * scale).to(dtype)
    return x, indices, weights, w13, w2


def oracle(x, indices, weights, w13, w2, limit):
    """One (token, k) at a time in float64, no rounding: the math the op approximates."""
    T, K = indices.shape
    I = w2.shape[2]
    out = torch.zeros(T, x.shape[1], dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(indices[t, k])
            gu = w13[e].double().cpu() @ x[t].double().cpu()
            gate, up = gu[:I].clamp(max=limit), gu[I:].clamp(-limit, limit)
            out[t] += float(weights[t, k]) * (w2[e].double().cpu() @ (torch.nn.functional.silu(gate) * up))
    return out


OPCHECK_CASES = {"decode_b1_top6": (1, 6, 16, 32, 16), "b3_top2": (3, 2, 4, 24, 8), "top1": (2, 1, 3, 16, 8)}
