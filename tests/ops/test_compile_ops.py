"""The five ops in a realistic layer step compile with fullgraph=True on CPU (Inductor), match
eager, and new per-row lengths (same shapes) do not recompile. One compile for the module."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend


from layer_step import CSA_RING, S, WIN_RING, csa_layer_step

B, H, D, HI = 2, 4, 32, 2  # rows, heads, head dim (= pool d), indexer heads
N, P = 16, 80  # pool entries, rope rows: positions up to 63 stay in range


def step(lengths, n_new, q, kv_new, ckv_new, cgate_new, iq, iw, sink, norm_w, cos, sin, win, ring_kv, ring_gate,
         pool):
    """``csa_layer_step`` with the pool as the indexer's keys."""
    out, picked, p = csa_layer_step(lengths, n_new, q, kv_new, ckv_new, cgate_new, iq, iw, sink, norm_w, cos, sin, win,
                                    ring_kv, ring_gate, pool, pool)
    return out, picked, p.positions


def make_inputs(lengths, n_new):
    """(step inputs, mutable state): fresh random data; state buffers hold random 'history'."""
    angle = torch.rand(P, 8) * 6.28
    inputs = [torch.tensor(lengths, dtype=torch.int32), torch.tensor(n_new, dtype=torch.int32),
              torch.randn(B, S, H, D), torch.randn(B, S, D), torch.randn(B, S, 2 * D), torch.randn(B, S, 2 * D),
              torch.randn(B, S, HI, D), torch.randn(B, S, HI), torch.randn(H), torch.rand(D) + 0.5,
              angle.cos(), angle.sin()]
    state = [torch.randn(B, WIN_RING, D), torch.randn(B, CSA_RING, 2 * D), torch.randn(B, CSA_RING, 2 * D),
             torch.randn(B, N, D)]
    return inputs, state


@pytest.fixture(scope="module")
def compiled():
    counter = CompileCounterWithBackend("inductor")
    return counter, torch.compile(step, backend=counter, fullgraph=True)


def run_both(compiled_step, lengths, n_new, tol):
    inputs, state = make_inputs(lengths, n_new)
    eager_state = [t.clone() for t in state]
    want = step(*inputs, *eager_state)
    got = compiled_step(*inputs, *state)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol(torch.float32))
    for name, g, w in zip(("win", "ring_kv", "ring_gate", "pool"), state, eager_state):
        torch.testing.assert_close(g, w, **tol(torch.float32), msg=lambda m: f"state {name}: {m}")


def test_compiled_step_matches_eager(compiled, tol):
    counter, compiled_step = compiled
    # decode-ish rows and a verify row crossing block boundaries; a padding row
    run_both(compiled_step, [7, 30], [4, 1], tol)
    run_both(compiled_step, [0, 12], [3, 0], tol)
    assert counter.frame_count == 1


def test_new_lengths_do_not_recompile(compiled, tol):
    counter, compiled_step = compiled
    for lengths, n_new in (([3, 50], [2, 4]), ([59, 0], [1, 4]), ([16, 27], [4, 3])):
        run_both(compiled_step, lengths, n_new, tol)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"
