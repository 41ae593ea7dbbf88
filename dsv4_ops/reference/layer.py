"""Reference DeepSeek-V4 attention layer in plain PyTorch (sliding / CSA / HCA).

Parameter names equal HF's ``DeepseekV4Attention`` so ``load_state_dict(hf_attn.state_dict())``
works as is. Two ways to run it:

* ``forward_full(x)`` — the dense-mask oracle of architecture.md §11 for a whole prompt that
  starts at position 0: every query ``t`` sees the window ``t-W+1..t`` and the compressed
  entries ``i < (t+1)//m`` (CSA: only the indexer's top-k of those). O(S^2); tests only.
* ``step(x, state, lengths, n_new)`` — the incremental path, built only from the op-level
  references (``ops.plan``, ``cache_write``, ``compress``, ``indexer_topk``,
  ``sparse_attention``) over a static per-layer ``AttentionState``. It takes any number of
  new tokens per row (a whole prompt, a prefill chunk, one decode token) and rows with
  different lengths; ``prefill`` and ``decode`` are thin wrappers. This is the building
  block of the model.

Window addressing: a multi-token step uses ``plan``'s concat mode (attend over
``cat(ring_before_write, new_kv)``, so a chunk may be longer than the ring); a one-token
step uses ring mode (write the new kv into the ring, attend over the ring).

Order inside ``step`` (architecture.md §6): q / qr, kv -> compressor: emit every block the
new tokens close, then store the new compressor-input rows in the rings (the emit reads
new rows straight from the step's own tensors, so storing afterwards cannot clobber an
old row a block still needs) -> CSA indexer (its compressor emits first, so a block that
closes at query ``t`` is selectable by ``t``) + top-k -> window write -> sparse attention
with sink -> inverse RoPE on the output -> grouped ``o_a_proj`` -> ``o_b_proj``.
Everything position-dependent is addressed by absolute position (DESIGN.md rule 3).
Math in fp32 like HF; projections run in the input dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ..config import CSA, HCA, SLIDING, DSV4Config
from . import ops
from .rope import rope_tables

__all__ = ["ReferenceAttention", "AttentionState", "StepPlan", "RingSizes", "ring_sizes", "plan_step", "plan_steps"]


# --------------------------------------------------------------------------------------
# step metadata
# --------------------------------------------------------------------------------------
class RingSizes(NamedTuple):
    window: int  # window-ring slots
    csa: int  # compressor-input ring slots at the CSA rate
    hca: int  # ... at the HCA rate


def ring_sizes(cfg: DSV4Config, lookahead: int = 0) -> RingSizes:
    """Smallest rings that serve steps of up to ``1 + lookahead`` tokens in ring mode.

    Window: ring mode needs ``W + S - 1`` slots. Compressor inputs: the first block a step
    can close starts up to ``2m - 1`` (CSA, overlapping) or ``m - 1`` (HCA) positions
    before the step, so ``2m`` / ``m`` slots hold every old row an emit reads; the
    lookahead term leaves room for speculative tokens that may be rejected.
    """
    return RingSizes(
        window=cfg.sliding_window + lookahead,
        csa=2 * cfg.csa_ratio + lookahead,
        hca=cfg.hca_ratio + lookahead,
    )


class StepPlan(NamedTuple):
    """One step's metadata, ``ops.plan`` output with the ``steps`` dim dropped."""

    start: Tensor  # [B] int32 first new position (= cached length)
    positions: Tensor  # [B, S] absolute position, -1 = padding
    win_write: Tensor  # [B, S] window-ring slot, -1 = skip
    win_idx: Tensor  # [B, S, W] window rows each query reads, -1 = none
    win_concat: bool  # True: win_idx addresses cat(ring, new_kv)
    csa_len: Tensor
    csa_emit: Tensor
    csa_write: Tensor
    hca_len: Tensor
    hca_emit: Tensor
    hca_write: Tensor


def plan_steps(
    cfg: DSV4Config,
    lengths: Tensor,
    n_new: Tensor,
    num_tokens: int,
    rings: RingSizes,
    steps: int = 1,
    concat: bool | None = None,
    kernels=ops,
) -> list[StepPlan]:
    """ONE ``plan`` call for ``steps`` consecutive sub-steps (sub-step ``i`` starts at
    ``lengths + i * n_new``), split into one ``StepPlan`` per sub-step. ``concat=None``:
    concat mode iff ``num_tokens > 1``. ``kernels``: where ``plan`` comes from
    (``reference.ops`` or the registered ``dsv4_ops.ops``)."""
    if concat is None:
        concat = num_tokens > 1
    if not concat and rings.window < cfg.sliding_window + num_tokens - 1:
        raise ValueError(
            f"ring mode with {num_tokens} tokens needs a window ring of >= "
            f"{cfg.sliding_window + num_tokens - 1} slots, have {rings.window}"
        )
    out = kernels.plan(
        lengths, n_new, num_tokens, steps, cfg.sliding_window, rings.window, concat,
        cfg.csa_ratio, rings.csa, cfg.hca_ratio, rings.hca,
    )  # fmt: skip
    lengths = lengths.to(torch.int32)
    return [
        StepPlan(lengths + i * n_new.to(torch.int32), *(t[i] for t in out[:3]), concat, *(t[i] for t in out[3:]))
        for i in range(steps)
    ]


def plan_step(
    cfg: DSV4Config,
    lengths: Tensor,
    n_new: Tensor,
    num_tokens: int,
    rings: RingSizes,
    concat: bool | None = None,
    kernels=ops,
) -> StepPlan:
    """Plan one step for every layer (``plan_steps`` with ``steps=1``)."""
    return plan_steps(cfg, lengths, n_new, num_tokens, rings, 1, concat, kernels)[0]


# --------------------------------------------------------------------------------------
# per-layer static state
# --------------------------------------------------------------------------------------
@dataclass
class AttentionState:
    """Static cache of one attention layer for ``B`` rows (all tensors allocated once).

    window:            ``[B, Rw, D]`` roped kv, position ``p`` at slot ``p % Rw``.
    kv_ring/gate_ring: ``[B, Rc, c*D]`` fp32 compressor inputs (gate includes
                       ``position_bias[p % m]``), position ``p`` at slot ``p % Rc``.
    pool:              ``[B, N, D]`` compressed entries, entry ``i`` at index ``i``.
    idx_*:             the same for the CSA indexer's compressor (``D -> DI``).
    Sliding layers only have ``window``; HCA layers have no ``idx_*``.
    """

    window: Tensor
    kv_ring: Tensor | None = None
    gate_ring: Tensor | None = None
    pool: Tensor | None = None
    idx_kv_ring: Tensor | None = None
    idx_gate_ring: Tensor | None = None
    idx_pool: Tensor | None = None


# --------------------------------------------------------------------------------------
# modules (names mirror HF)
# --------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return ops.rms_norm(x, self.weight, self.eps).to(x.dtype)


class Compressor(nn.Module):
    """Token-level compressor (architecture.md §4): rate ``m``, entry width ``dim``,
    CSA layout (``overlap``: each token projects to ``2*dim``) or HCA layout."""

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        c = 2 if overlap else 1
        self.dim, self.ratio, self.overlap, self.eps = dim, ratio, overlap, eps
        self.kv_proj = nn.Linear(hidden, c * dim, bias=False)
        self.gate_proj = nn.Linear(hidden, c * dim, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, c * dim, dtype=torch.float32))
        self.kv_norm = RMSNorm(dim, eps)

    def rows(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """fp32 ring rows of tokens at ``positions`` (>= 0): ``(kv, gate + bias[p % m])``."""
        kv = self.kv_proj(x).float()
        gate = self.gate_proj(x).float() + self.position_bias[positions % self.ratio]
        return kv, gate

    def step(self, x, positions, start, emit, write, kv_ring, gate_ring, pool, cos, sin, kernels=ops) -> None:
        """Emit every block in ``emit`` into ``pool``, then store the new rows in the rings."""
        kv, gate = self.rows(x, positions)
        kernels.compress(
            kv_ring, gate_ring, kv, gate, start, emit, self.kv_norm.weight, cos, sin,
            pool, self.ratio, self.overlap, self.eps,
        )  # fmt: skip
        kernels.cache_write(kv_ring, kv, write)
        kernels.cache_write(gate_ring, gate, write)

    def dense(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """All complete blocks of a prompt starting at position 0 (§11 ``compress``) -> [B, n, dim]."""
        B, S, _ = x.shape
        m, d = self.ratio, self.dim
        n = S // m
        c = self.position_bias.shape[-1]
        a = self.kv_proj(x[:, : n * m]).float().view(B, n, m, c)
        z = self.gate_proj(x[:, : n * m]).float().view(B, n, m, c) + self.position_bias
        if self.overlap:  # entry i: first halves of block i-1 (slots 0..m-1), second halves of block i
            K = a.new_zeros(B, n, 2 * m, d)
            L = a.new_full((B, n, 2 * m, d), float("-inf"))
            K[:, :, m:], L[:, :, m:] = a[..., d:], z[..., d:]
            K[:, 1:, :m], L[:, 1:, :m] = a[:, :-1, :, :d], z[:, :-1, :, :d]
        else:
            K, L = a, z
        C = (K * L.softmax(dim=2)).sum(dim=2)
        C = ops.rms_norm(C, self.kv_norm.weight, self.eps)
        bpos = torch.arange(n, device=x.device) * m
        return ops.apply_rope(C, cos[bpos], sin[bpos])


class Scorer(nn.Module):
    def __init__(self, hidden: int, n_heads: int) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(hidden, n_heads, bias=False)


class Indexer(Compressor):
    """Lightning indexer (§5): its own CSA-layout compressor at ``index_head_dim`` plus the
    query projection (from the main query latent ``qr``) and per-head weights."""

    def __init__(self, cfg: DSV4Config) -> None:
        super().__init__(cfg.hidden_size, cfg.index_head_dim, cfg.csa_ratio, True, cfg.rms_norm_eps)
        self.n_heads, self.topk = cfg.index_n_heads, cfg.index_topk
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.scorer = Scorer(cfg.hidden_size, cfg.index_n_heads)
        # HF: sum_h (w_h * HI^-0.5) * relu(q_h . k) * DI^-0.5; both scales folded into w.
        self.weight_scale = cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5

    def queries(self, x: Tensor, qr: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Roped indexer queries ``[B, S, HI, DI]`` and folded weights ``[B, S, HI]`` (fp32)."""
        B, S, _ = x.shape
        q = self.q_b_proj(qr).view(B, S, self.n_heads, self.dim)
        q = ops.apply_rope(q, cos[:, :, None], sin[:, :, None])
        w = self.scorer.weights_proj(x).float() * self.weight_scale
        return q, w


class MainCompressor(Compressor):
    def __init__(self, cfg: DSV4Config, layer_type: str) -> None:
        csa = layer_type == CSA
        ratio = cfg.csa_ratio if csa else cfg.hca_ratio
        super().__init__(cfg.hidden_size, cfg.head_dim, ratio, csa, cfg.rms_norm_eps)
        self.indexer = Indexer(cfg) if csa else None


# --------------------------------------------------------------------------------------
# the layer
# --------------------------------------------------------------------------------------
class ReferenceAttention(nn.Module):
    """One DeepSeek-V4 attention layer (input: the normed, mHC-collapsed hidden state)."""

    # The five stateful kernels (plan, cache_write, compress, indexer_topk, sparse_attention)
    # come from here: the plain references by default; the model's subclass swaps in the
    # registered torch.ops.dsv4 ops, whose signatures are identical.
    kernels = ops

    def __init__(
        self,
        cfg: DSV4Config,
        layer_idx: int,
        max_positions: int | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
    ) -> None:
        """``max_positions`` sizes the RoPE tables (default ``cfg.max_position_embeddings``);
        ``rope`` = precomputed ``(cos, sin)`` for this layer's rope type (to share tables)."""
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.layer_type = cfg.layer_types[layer_idx]
        self.ratio = cfg.compress_ratio(layer_idx)
        H, D = cfg.num_attention_heads, cfg.head_dim
        self.num_heads, self.head_dim, self.eps = H, D, cfg.rms_norm_eps
        self.window = cfg.sliding_window
        self.scale = D**-0.5

        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * D, bias=False)
        self.kv_proj = nn.Linear(cfg.hidden_size, D, bias=False)
        self.kv_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.o_a_proj = nn.Linear(H * D // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.compressor = MainCompressor(cfg, self.layer_type) if self.layer_type != SLIDING else None

        if rope is None:
            theta, yarn = cfg.rope_params(self.layer_type)
            rope = rope_tables(theta, cfg.rope_head_dim, max_positions or cfg.max_position_embeddings, yarn)
        self.register_buffer("cos", rope[0], persistent=False)
        self.register_buffer("sin", rope[1], persistent=False)

    # ---------------------------------------------------------------- shared pieces
    def _q_kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Roped queries ``[B,S,H,D]``, query latent ``qr`` and roped kv ``[B,S,D]``."""
        B, S, _ = x.shape
        qr = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(qr).view(B, S, self.num_heads, self.head_dim)
        q = ops.rms_norm(q, None, self.eps).to(x.dtype)  # per-head unweighted norm
        q = ops.apply_rope(q, cos[:, :, None], sin[:, :, None])
        kv = ops.apply_rope(self.kv_norm(self.kv_proj(x)), cos, sin)
        return q, qr, kv

    def _out(self, o: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Undo the value rotation at the query position, then the grouped output projection."""
        B, S = o.shape[:2]
        g = self.cfg.o_groups
        o = ops.apply_rope(o, cos[:, :, None], sin[:, :, None], inverse=True)
        w_a = self.o_a_proj.weight.view(g, self.cfg.o_lora_rank, -1)
        z = torch.einsum("bsgi,gri->bsgr", o.reshape(B, S, g, -1), w_a)
        return self.o_b_proj(z.flatten(2))

    # ---------------------------------------------------------------- dense oracle
    def forward_full(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """Whole prompt from position 0 with dense masks (architecture.md §11). ``positions``
        is accepted for symmetry and must be ``arange(S)`` when given."""
        B, S, _ = x.shape
        t = torch.arange(S, device=x.device)
        if positions is not None and not torch.equal(positions.broadcast_to(B, S).to(t), t.expand(B, S)):
            raise ValueError("forward_full: positions must be 0..S-1 (a whole prompt)")
        cos, sin = self.cos[t].expand(B, S, -1), self.sin[t].expand(B, S, -1)
        q, qr, kv = self._q_kv(x, cos, sin)

        s = t[None, :]
        allowed = ((s <= t[:, None]) & (s > t[:, None] - self.window)).expand(B, S, S)
        keys = kv.float()
        c = self.compressor
        if c is not None:
            C = c.dense(x, self.cos, self.sin)  # [B, n, D]
            n = C.shape[1]
            vis = (torch.arange(n, device=x.device)[None, :] < ((t + 1) // c.ratio)[:, None]).expand(B, S, n)
            if c.indexer is not None and n > 0:
                idx = c.indexer
                KI = idx.dense(x, self.cos, self.sin)  # [B, n, DI]
                qI, w = idx.queries(x, qr, cos, sin)
                I = (torch.einsum("bshd,bnd->bshn", qI.float(), KI).relu() * w[..., None]).sum(dim=2)
                I = I.masked_fill(~vis, float("-inf"))
                top = I.topk(min(idx.topk, n), dim=-1).indices
                vis = torch.zeros_like(vis).scatter_(-1, top, True) & vis
            keys = torch.cat([keys, C], dim=1)
            allowed = torch.cat([allowed, vis], dim=-1)

        logits = torch.einsum("bshd,bjd->bshj", q.float(), keys) * self.scale
        logits = logits.masked_fill(~allowed[:, :, None, :], float("-inf"))
        sink = self.sinks.float().view(1, 1, -1, 1).expand(B, S, -1, 1)
        probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
        o = torch.einsum("bshj,bjd->bshd", probs, keys).to(x.dtype)
        return self._out(o, cos, sin)

    # ---------------------------------------------------------------- incremental path
    def init_state(
        self,
        batch_size: int,
        max_seq_len: int,
        rings: RingSizes | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> AttentionState:
        """Allocate this layer's static state for ``batch_size`` rows of up to ``max_seq_len``
        tokens. Zero-filled: the ops never give weight to a slot that was not written."""
        cfg = self.cfg
        rings = rings or ring_sizes(cfg)
        if max_seq_len > self.cos.shape[0]:
            raise ValueError(f"max_seq_len {max_seq_len} > RoPE table length {self.cos.shape[0]}")
        B, D = batch_size, self.head_dim
        kw = dict(device=device)
        st = AttentionState(window=torch.zeros(B, rings.window, D, dtype=dtype, **kw))
        c = self.compressor
        if c is not None:
            R = rings.csa if self.layer_type == CSA else rings.hca
            n = -(-max_seq_len // c.ratio)
            width = (2 if c.overlap else 1) * D
            st.kv_ring = torch.zeros(B, R, width, dtype=torch.float32, **kw)
            st.gate_ring = torch.zeros(B, R, width, dtype=torch.float32, **kw)
            st.pool = torch.zeros(B, n, D, dtype=dtype, **kw)
            if c.indexer is not None:
                DI = c.indexer.dim
                st.idx_kv_ring = torch.zeros(B, R, 2 * DI, dtype=torch.float32, **kw)
                st.idx_gate_ring = torch.zeros(B, R, 2 * DI, dtype=torch.float32, **kw)
                st.idx_pool = torch.zeros(B, n, DI, dtype=dtype, **kw)
        return st

    def rings(self, state: AttentionState) -> RingSizes:
        """Ring sizes of ``state`` (rates this layer does not use get the defaults)."""
        default = ring_sizes(self.cfg)
        rc = state.kv_ring.shape[1] if state.kv_ring is not None else 0
        return RingSizes(
            window=state.window.shape[1],
            csa=rc if self.layer_type == CSA else default.csa,
            hca=rc if self.layer_type == HCA else default.hca,
        )

    def capacity(self, state: AttentionState) -> int:
        """Most positions ``state`` (pool size) and the RoPE tables can address."""
        cap = self.cos.shape[0]
        if state.pool is not None:
            cap = min(cap, state.pool.shape[1] * self.ratio)
        return cap

    def plan(self, lengths: Tensor, n_new: Tensor, num_tokens: int, state: AttentionState) -> StepPlan:
        """Metadata for one step of this layer alone (a model plans once for all layers)."""
        return plan_step(self.cfg, lengths, n_new, num_tokens, self.rings(state), kernels=self.kernels)

    def step(
        self,
        x: Tensor,
        state: AttentionState,
        lengths: Tensor,
        n_new: Tensor,
        meta: StepPlan | None = None,
    ) -> Tensor:
        """Consume ``n_new[b]`` new tokens per row (``x[b, :n_new[b]]``, positions
        ``lengths[b] ..``), update ``state`` in place, return ``[B, S, hidden]`` (rows past
        ``n_new`` are padding: zeros). The caller advances ``lengths += n_new``."""
        B, S, _ = x.shape
        if meta is None:
            meta = self.plan(lengths, n_new, S, state)
        pos = meta.positions.clamp(min=0).long()
        cos, sin = self.cos[pos], self.sin[pos]  # [B, S, r/2]
        q, qr, kv = self._q_kv(x, cos, sin)

        c = self.compressor
        cmp = kv.new_zeros(B, 0, self.head_dim)
        cmp_idx = torch.full((B, S, 0), -1, dtype=torch.int32, device=x.device)
        cmp_len = torch.zeros(B, S, dtype=torch.int32, device=x.device)
        if c is not None:
            csa = self.layer_type == CSA
            emit, write, visible = (
                (meta.csa_emit, meta.csa_write, meta.csa_len) if csa else (meta.hca_emit, meta.hca_write, meta.hca_len)
            )
            k = self.kernels
            c.step(x, pos, meta.start, emit, write, state.kv_ring, state.gate_ring, state.pool, self.cos, self.sin, k)
            cmp = state.pool
            if csa:
                idx = c.indexer
                idx.step(x, pos, meta.start, emit, write, state.idx_kv_ring, state.idx_gate_ring,
                         state.idx_pool, self.cos, self.sin, k)  # fmt: skip
                qI, w = idx.queries(x, qr, cos, sin)
                cmp_idx = k.indexer_topk(qI, w, state.idx_pool, visible, idx.topk)
            else:
                cmp_len = visible

        kv = kv.to(state.window.dtype)
        src = torch.cat([state.window, kv], dim=1) if meta.win_concat else state.window
        self.kernels.cache_write(state.window, kv, meta.win_write)  # concat mode: src was copied before
        o = self.kernels.sparse_attention(q, src, meta.win_idx, cmp, cmp_idx, cmp_len, self.sinks, self.scale)
        return self._out(o, cos, sin)

    def prefill(
        self,
        x: Tensor,
        state: AttentionState,
        lengths: Tensor,
        n_new: Tensor,
        chunk: int | None = None,
    ) -> Tensor:
        """``step`` over ``x`` in chunks of ``chunk`` tokens (None: one chunk). Row ``b``
        takes ``n_new[b]`` tokens; returns ``[B, S, hidden]``. ``lengths`` is not modified."""
        S = x.shape[1]
        chunk = chunk or max(S, 1)
        # Python-boundary checks (a host sync is fine here, never inside `step`)
        if bool(((n_new < 0) | (n_new > S)).any()):
            raise ValueError(f"n_new must be in [0, {S}] (x.shape[1]), got {n_new.tolist()}")
        if bool((lengths + n_new > self.capacity(state)).any()):
            raise ValueError(
                f"lengths + n_new = {(lengths + n_new).tolist()} exceeds the state's capacity of "
                f"{self.capacity(state)} positions"
            )
        outs, done = [], torch.zeros_like(n_new)
        for j in range(0, S, chunk):
            w = min(chunk, S - j)
            take = (n_new - done).clamp(0, w)  # tokens of each row inside this chunk
            outs.append(self.step(x[:, j : j + w], state, lengths + done, take))
            done = done + take
        return torch.cat(outs, dim=1)

    def decode(self, x: Tensor, state: AttentionState, lengths: Tensor) -> Tensor:
        """One token per row: ``x [B, 1, hidden]`` at positions ``lengths``."""
        return self.step(x, state, lengths, torch.ones_like(lengths))
