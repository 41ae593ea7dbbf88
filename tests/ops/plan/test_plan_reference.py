"""dsv4::plan against its meaning: every metadata tensor vs a per-(step, row, token) Python loop, plus
a ring simulation showing that win_idx really addresses the window positions; on random lengths
and the edge cases (first tokens, compression boundaries and multiples of 4 / 128, a chunk
longer than the compressor ring, all rows padding, the smallest rings, no query slots)."""
import pytest
import torch

from plan_cases import FIELDS, I32, cfg, run_plan


def oracle(lengths, n_new, c):
    """Brute force, one (step, row, token) at a time, straight from the documented meaning."""
    S, W, R = c["num_tokens"], c["window"], c["win_ring"]
    rates = [(c["csa_ratio"], c["csa_ring"]), (c["hca_ratio"], c["hca_ring"])]
    out = {f: [] for f in FIELDS}

    def ring_slot(p, end, ring):  # written unless a later token of the step maps to the same slot
        return -1 if any(q % ring == p % ring for q in range(p + 1, end)) else p % ring

    for i in range(c["steps"]):
        rows = {f: [] for f in FIELDS}
        for L, n in zip(lengths, n_new):
            start, end = L + i * n, L + (i + 1) * n
            new = list(range(start, end))
            pad = [-1] * (S - n)
            rows["positions"].append(new + pad)
            rows["win_write"].append([ring_slot(p, end, R) for p in new] + pad)
            idx = []
            for p in new:
                entries = []
                for w in range(W):
                    t = p - W + 1 + w  # oldest first
                    entries.append(-1 if t < 0 else R + t - start if (c["win_concat"] and t >= start) else t % R)
                idx.append(entries)
            rows["win_idx"].append(idx + [[-1] * W] * (S - n))
            for name, (m, ring) in zip(("csa", "hca"), rates):
                rows[f"{name}_len"].append([(p + 1) // m for p in new] + [0] * (S - n))
                closed = [p // m for p in new if (p + 1) % m == 0]  # blocks whose last token is new
                rows[f"{name}_emit"].append(closed + [-1] * (-(-S // m) - len(closed)))
                rows[f"{name}_write"].append([ring_slot(p, end, ring) for p in new] + pad)
        for f in FIELDS:
            out[f].append(rows[f])
    shape = (c["steps"], len(lengths), S)
    shapes = {f: shape for f in FIELDS}
    shapes.update(win_idx=(*shape, W), csa_emit=(*shape[:2], -(-S // c["csa_ratio"])),
                  hca_emit=(*shape[:2], -(-S // c["hca_ratio"])))
    return {f: torch.tensor(v, dtype=I32).reshape(shapes[f]) for f, v in out.items()}


def simulate_window(lengths, n_new, c, p):
    """Replay plan's window writes into a ring of positions; win_idx must resolve to exactly the
    positions [t-W+1, t] (>= 0) of each query t. The ring starts holding [L-R, L)."""
    R, W = c["win_ring"], c["window"]
    for b, (L, n) in enumerate(zip(lengths, n_new)):
        ring = {q % R: q for q in range(max(0, L - R), L)}
        for i in range(c["steps"]):
            start = L + i * n
            before = dict(ring)
            for j in range(n):
                slot = int(p.win_write[i, b, j])
                if slot >= 0:
                    ring[slot] = start + j
            source = {**before, **{R + j: start + j for j in range(n)}} if c["win_concat"] else ring
            for j in range(n):
                t = start + j
                seen = [source[int(e)] if e >= 0 else None for e in p.win_idx[i, b, j]]
                want = [x if x >= 0 else None for x in range(t - W + 1, t + 1)]
                assert seen == want, f"step {i} row {b} query {t}: window resolves to {seen}, want {want}"


def check(lengths, n_new, c, device="cpu"):
    p = run_plan(lengths, n_new, c, device)
    want = oracle(lengths, n_new, c)
    for f in FIELDS:
        got = getattr(p, f)
        assert got.dtype == I32 and got.is_contiguous(), f
        assert torch.equal(got.cpu(), want[f]), f"{f}:\n{got}\nwant\n{want[f]}"
    simulate_window(lengths, n_new, c, p)
    return p


@pytest.mark.parametrize(
    "c",
    [cfg(num_tokens=1), cfg(num_tokens=5), cfg(num_tokens=7, win_concat=True),
     cfg(num_tokens=1, steps=4), cfg(num_tokens=3, steps=2, window=6, csa_ratio=2, csa_ring=5, hca_ratio=3,
                                       hca_ring=3)],
    ids=["decode", "verify", "concat", "mtp", "multi_step_chunks"],
)
def test_plan_matches_reference(device, c):
    S = c["num_tokens"]
    B = 5
    lengths = torch.randint(0, 300, (B,)).tolist()
    n_new = torch.randint(0, S + 1, (B,)).tolist()
    n_new[0] = S  # at least one full row
    check(lengths, n_new, c, device)


def test_plan_edge_cases(device):
    # first tokens of a sequence (length 0): window entries at negative positions are -1
    check([0, 0, 0], [1, 3, 5], cfg(num_tokens=5), device)
    check([0, 0], [5, 2], cfg(num_tokens=5, win_concat=True), device)
    # lengths around compression boundaries and exact multiples of m (4 and 128)
    c = cfg(num_tokens=5, hca_ratio=128, hca_ring=128)
    check([3, 4, 5, 127, 128, 129, 255, 256], [1, 1, 1, 1, 1, 1, 1, 1], c, device)
    check([3, 4, 5, 124, 126, 127, 128, 251], [5, 4, 3, 5, 2, 1, 5, 5], c, device)
    # a single step bringing more tokens than the compressor ring: earlier slots are skipped
    p = check([2, 9], [13, 0], cfg(num_tokens=13, win_concat=True, csa_ring=8, hca_ring=8), device)
    assert (p.csa_write[0, 0] >= 0).sum() == 8 and (p.csa_write[0, 1] == -1).all()
    # a chunk of exactly 128 tokens from 0 closes 32 CSA blocks and one HCA block
    p = check([0], [128], cfg(num_tokens=128, win_concat=True, window=128, hca_ratio=128, hca_ring=128), device)
    assert p.csa_emit[0, 0].tolist() == list(range(32)) and p.hca_emit[0, 0].tolist() == [0]
    # all rows padding: every index tensor is -1 and nothing is visible
    p = check([10, 20], [0, 0], cfg(num_tokens=3), device)
    for f in FIELDS:
        assert ((getattr(p, f) == 0) if f.endswith("_len") else (getattr(p, f) == -1)).all(), f
    # the smallest rings each mode allows
    check([30, 1], [4, 3], cfg(num_tokens=4, window=4, win_ring=7), device)
    check([30, 1], [4, 3], cfg(num_tokens=4, window=4, win_ring=3, win_concat=True), device)
    # no query slots at all
    p = check([4], [0], cfg(num_tokens=0), device)
    assert p.win_idx.shape == (1, 1, 0, 4) and p.csa_emit.shape == (1, 1, 0)
