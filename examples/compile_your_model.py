"""Use the dsv4 ops inside YOUR OWN model and torch.compile it (fullgraph, no graph breaks).

A toy decoder step with DeepSeek-V4's sliding-window attention + per-head sink: `plan` turns
each row's length into cache slots and window indices, `cache_write` stores the new key/value
rows in a ring, `sparse_attention` attends over the window. The compiled step equals eager.

    python examples/compile_your_model.py
"""
import torch
from torch import nn

import dsv4_ops  # registers torch.ops.dsv4.*


class WindowAttention(nn.Module):
    """One MQA head group over a ring of the last `window` positions (K = V, as in V4)."""

    def __init__(self, dim=64, heads=4, window=16, batch=2):
        super().__init__()
        self.heads, self.dim, self.window = heads, dim, window
        self.q = nn.Linear(dim, heads * dim, bias=False)
        self.kv = nn.Linear(dim, dim, bias=False)
        self.sink = nn.Parameter(torch.zeros(heads))
        self.register_buffer("ring", torch.zeros(batch, window, dim), persistent=False)  # the KV cache

    def forward(self, x, lengths):  # x: [B, 1, dim], one new token per row at position lengths[b]
        B = x.shape[0]
        one = torch.ones_like(lengths)
        p = dsv4_ops.plan(lengths, one, num_tokens=1, steps=1, window=self.window, win_ring=self.window,
                          win_concat=False, csa_ratio=4, csa_ring=8, hca_ratio=16, hca_ring=16)
        dsv4_ops.cache_write(self.ring, self.kv(x), p.win_write[0])  # in place, position-addressed
        q = self.q(x).view(B, 1, self.heads, self.dim)
        none = torch.empty(B, 1, 0, dtype=torch.int32, device=x.device)
        no_prefix = torch.zeros(B, 1, dtype=torch.int32, device=x.device)
        empty_pool = x.new_zeros(B, 0, self.dim)
        return dsv4_ops.sparse_attention(q, self.ring, p.win_idx[0], empty_pool, none, no_prefix, self.sink,
                                         self.dim**-0.5)


def decode(step, model, xs):
    model.ring.zero_()
    lengths = torch.zeros(xs.shape[0], dtype=torch.int32)
    outs = []
    for t in range(xs.shape[1]):
        outs.append(step(xs[:, t : t + 1], lengths))
        lengths = lengths + 1
    return torch.stack(outs)


if __name__ == "__main__":
    torch.manual_seed(0)
    model = WindowAttention().eval()
    xs = torch.randn(2, 40, 64)  # 40 steps: the ring (16) wraps twice
    with torch.no_grad():
        want = decode(model, model, xs)
        compiled = torch.compile(model, fullgraph=True)
        got = decode(compiled, model, xs)
    err = (got - want).abs().max().item()
    print(f"compiled vs eager over {xs.shape[1]} decode steps: max abs diff {err:.2e}")
    assert err < 1e-5, err
    print("OK")
