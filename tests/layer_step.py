"""One CSA layer step through the five ops -- plan, three cache writes, compress, indexer_topk,
sparse_attention -- at small static sizes, for the tests that compile it (``ops/test_compile_ops.py``
on CPU, ``runtime/test_inductor_codegen.py`` on the GPU)."""
import torch

import dsv4_ops

S, W, WIN_RING = 4, 4, 8  # query width, window, ring slots (ring mode needs >= W + S - 1)
M, CSA_RING, TOPK = 4, 8, 3  # CSA rate (overlap), compressor ring, indexer width


def csa_layer_step(lengths, n_new, q, kv_new, ckv_new, cgate_new, iq, iw, sink, norm_w, cos, sin, win, ring_kv,
                   ring_gate, pool, ikeys):
    """The step's attention output ``[B, S, H, D]``, the indexer's picks and the plan; writes the window
    ring ``win``, the compressor rings and the pool in place. ``ikeys``: the indexer's keys."""
    p = dsv4_ops.plan(lengths, n_new, S, 1, W, WIN_RING, False, M, CSA_RING, 8, 8)
    dsv4_ops.cache_write(win, kv_new, p.win_write[0])
    dsv4_ops.compress(ring_kv, ring_gate, ckv_new, cgate_new, lengths, p.csa_emit[0], norm_w, cos, sin, pool, M,
                      True, 1e-6)
    dsv4_ops.cache_write(ring_kv, ckv_new, p.csa_write[0])
    dsv4_ops.cache_write(ring_gate, cgate_new, p.csa_write[0])
    picked = dsv4_ops.indexer_topk(iq, iw, ikeys, p.csa_len[0], TOPK)
    out = dsv4_ops.sparse_attention(q, win, p.win_idx[0], pool, picked, torch.zeros_like(p.csa_len[0]), sink,
                                    q.shape[-1]**-0.5)
    return out, picked, p
