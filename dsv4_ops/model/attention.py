"""DeepSeek-V4 attention layer on the ``torch.ops.dsv4`` ops (sliding / CSA / HCA).

Parameter names equal HF's ``DeepseekV4Attention``, so ``load_state_dict(hf_attn.state_dict())``
works as is. The layer consumes any number of new tokens per row (a whole prompt, a prefill
chunk, one decode token, a speculative verify) for rows of different lengths, over a static
per-layer :class:`AttentionState`: either the layer's own cache buffers (``setup_cache``, the
cached step) or a transient state the caller allocates (the cache-free forward).

Window addressing: a multi-token step uses ``plan``'s concat mode (attend over
``cat(ring_before_write, new_kv)``, so a chunk may be longer than the ring); a one-token step
uses ring mode (write the new kv into the ring, attend over the ring).

Order inside a step (architecture.md §6): q / qr, kv -> compressor: emit every block the new
tokens close, then store the new compressor-input rows in the rings (the emit reads new rows
straight from the step's own tensors, so storing afterwards cannot clobber an old row a block
still needs) -> CSA indexer (its compressor emits first, so a block that closes at query ``t``
is selectable by ``t``) + top-k -> window write -> sparse attention with sink -> inverse RoPE
on the output -> grouped ``o_a_proj`` -> ``o_b_proj``. Everything position-dependent is
addressed by absolute position (DESIGN.md rule 3). Math in fp32 like HF; projections run in
the input dtype. The raw ops are called directly: the model's boundary (``forward``, the
generators) checks what it passes them.

FP8 cache (``kv_cache_dtype="fp8"``, ``dsv4_ops/reference/fp8_cache.py``): the window ring and
the compressed pools are FP8 pages (``cache_write`` / ``compress`` quantise, ``sparse_attention``
reads them), the indexer keys are Hadamard-rotated FP8 (the indexer queries are rotated to
match). Every kv the step attends to is the quantised one, also the step's own new rows in
concat mode. ``quant_sim`` (the reference numerics, ``model.simulate_fp8_cache``) gives float
caches exactly those values: quantise -> dequantise on write.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..config import CSA, HCA, SLIDING, DSV4Config
from ..ops.direct import dsv4
from ..reference import fp8_cache as fp8
from ..reference.ops import apply_rope, physical_entries, rms_norm
from .linear import Linear, grouped_linear
from .plan import RingSizes, StepMeta, ring_sizes

__all__ = ["Attention", "AttentionState", "RMSNorm", "Compressor", "Indexer"]


@dataclass
class AttentionState:
    """Static cache of one attention layer for ``B`` rows (all tensors allocated once).

    window:            ``[B, Rw, D]`` roped kv, position ``p`` at slot ``p % Rw`` (FP8 cache:
                       ``uint8 [B, pages, page, bytes]`` pages, ``fp8_cache.py``; so are
                       ``pool`` and ``idx_pool``).
    kv_ring/gate_ring: ``[B, Rc, c*D]`` fp32 compressor inputs (gate includes
                       ``position_bias[p % m]``), position ``p`` at slot ``p % Rc``.
    pool:              ``[B, N, D]`` compressed entries, entry ``i`` at index ``i``.
    idx_*:             the same for the CSA indexer's compressor (``D -> DI``).
    block_table:       ``None``, or ``int32 [B, P]``: then ``pool`` / ``idx_pool`` are pages
                       ``[num_pages, page, ...]`` shared by the rows (the serving engine's pool),
                       row ``b``'s entry ``i`` in page ``block_table[b, i // page]``; the ops read
                       and write them through it.
    Sliding layers only have ``window``; HCA layers have no ``idx_*``.
    """

    window: Tensor
    kv_ring: Tensor | None = None
    gate_ring: Tensor | None = None
    pool: Tensor | None = None
    idx_kv_ring: Tensor | None = None
    idx_gate_ring: Tensor | None = None
    idx_pool: Tensor | None = None
    block_table: Tensor | None = None

    def tensors(self) -> dict[str, Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def rows(self, n: int) -> "AttentionState":
        """The first ``n`` rows (views: writes land in this state). All rows: the tensors
        themselves, so an exported step mutates whole buffers, never views."""
        if n == self.window.shape[0]:
            return self
        shared = ("pool", "idx_pool") if self.block_table is not None else ()  # pages: all rows' at once
        return AttentionState(**{k: t if k in shared else t[:n] for k, t in self.tensors().items()})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps).to(x.dtype)


class Compressor(nn.Module):
    """Token-level compressor (architecture.md §4): rate ``m``, entry width ``dim``,
    CSA layout (``overlap``: each token projects to ``2*dim``) or HCA layout."""

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        c = 2 if overlap else 1
        self.dim, self.ratio, self.overlap, self.eps = dim, ratio, overlap, eps
        self.kv_proj = Linear(hidden, c * dim, bias=False)
        self.gate_proj = Linear(hidden, c * dim, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, c * dim, dtype=torch.float32))
        self.kv_norm = RMSNorm(dim, eps)

    def rows(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """fp32 ring rows of tokens at ``positions`` (>= 0): ``(kv, gate + bias[p % m])``."""
        kv = self.kv_proj(x).float()
        gate = self.gate_proj(x).float() + self.position_bias[positions % self.ratio]
        return kv, gate

    def step(self, x, positions, start, emit, write, kv_ring, gate_ring, pool, cos, sin, block_table=None) -> None:
        """Emit every block in ``emit`` into ``pool`` (pages through ``block_table``, if given), then
        store the new rows in the rings."""
        kv, gate = self.rows(x, positions)
        dsv4.compress(kv_ring, gate_ring, kv, gate, start, emit, self.kv_norm.weight, cos, sin, pool, self.ratio,
                      self.overlap, self.eps, block_table)
        dsv4.cache_write(kv_ring, kv, write)
        dsv4.cache_write(gate_ring, gate, write)


class Scorer(nn.Module):
    def __init__(self, hidden: int, n_heads: int) -> None:
        super().__init__()
        self.weights_proj = Linear(hidden, n_heads, bias=False)


class Indexer(Compressor):
    """Lightning indexer (§5): its own CSA-layout compressor at ``index_head_dim`` plus the
    query projection (from the main query latent ``qr``) and per-head weights."""

    def __init__(self, cfg: DSV4Config) -> None:
        super().__init__(cfg.hidden_size, cfg.index_head_dim, cfg.csa_ratio, True, cfg.rms_norm_eps)
        self.n_heads, self.topk = cfg.index_n_heads, cfg.index_topk
        self.q_b_proj = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.scorer = Scorer(cfg.hidden_size, cfg.index_n_heads)
        # HF: sum_h (w_h * HI^-0.5) * relu(q_h . k) * DI^-0.5; both scales folded into w.
        self.weight_scale = cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5

    def queries(self, x: Tensor, qr: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Roped indexer queries ``[B, S, HI, DI]`` and folded weights ``[B, S, HI]`` (fp32)."""
        B, S, _ = x.shape
        q = self.q_b_proj(qr).view(B, S, self.n_heads, self.dim)
        q = apply_rope(q, cos[:, :, None], sin[:, :, None])
        w = self.scorer.weights_proj(x).float() * self.weight_scale
        return q, w


class MainCompressor(Compressor):
    def __init__(self, cfg: DSV4Config, layer_type: str) -> None:
        csa = layer_type == CSA
        ratio = cfg.csa_ratio if csa else cfg.hca_ratio
        super().__init__(cfg.hidden_size, cfg.head_dim, ratio, csa, cfg.rms_norm_eps)
        self.indexer = Indexer(cfg) if csa else None


class Attention(nn.Module):
    """One DeepSeek-V4 attention layer (input: the normed, mHC-collapsed hidden state).

    ``rope``: the ``(cos, sin)`` tables of this layer's rope type (shared between layers).
    """

    def __init__(self, cfg: DSV4Config, layer_idx: int, rope: tuple[Tensor, Tensor]) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_type = cfg.layer_types[layer_idx]
        self.ratio = cfg.compress_ratio(layer_idx)
        H, D = cfg.num_attention_heads, cfg.head_dim
        self.num_heads, self.head_dim, self.eps = H, D, cfg.rms_norm_eps
        self.o_groups = cfg.o_groups  # this module's heads / groups: a tensor-parallel shard holds a slice
        self.scale = D**-0.5

        self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = Linear(cfg.q_lora_rank, H * D, bias=False)
        self.kv_proj = Linear(cfg.hidden_size, D, bias=False)
        self.kv_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.o_a_proj = Linear(H * D // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.o_b_proj = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.compressor = MainCompressor(cfg, self.layer_type) if self.layer_type != SLIDING else None
        self.register_buffer("cos", rope[0], persistent=False)
        self.register_buffer("sin", rope[1], persistent=False)
        self._cache_names: tuple[str, ...] = ()
        self.quant_sim = False  # reference FP8 numerics on float caches (model.simulate_fp8_cache)

    # ---------------------------------------------------------------- state
    def new_state(self, batch_size: int, max_seq_len: int, rings: RingSizes | None = None,
                  dtype: torch.dtype = torch.float32, device=None, fp8_cache: bool = False) -> AttentionState:
        """A zero-filled state for ``batch_size`` rows of up to ``max_seq_len`` tokens (the ops
        never give weight to a slot that was not written). Plain tensor ops: it also runs inside
        a compiled graph (the cache-free forward's scratch state). ``fp8_cache``: window and
        pools in the FP8 page layouts (pools: ``fp8_cache.PAGE_SIZE`` entries per page)."""
        rings = rings or ring_sizes(self.cfg)
        B, D = batch_size, self.head_dim
        kv_layout = fp8.KVLayout(D, self.cfg.rope_head_dim) if fp8_cache else None
        # the window ring is ONE page of exactly Rw entries per row: concat mode addresses the
        # step's new rows at Rw + j, after the ring's rows (SGLang's SWA page is 128 = the ring too)
        win_layout = fp8.KVLayout(D, self.cfg.rope_head_dim, rings.window) if fp8_cache else None

        def kv_buffer(n: int, width: int, layout) -> Tensor:
            if layout is None:
                return torch.zeros(B, n, width, dtype=dtype, device=device)
            return torch.zeros(layout.shape(B, n), dtype=torch.uint8, device=device)

        st = AttentionState(window=kv_buffer(rings.window, D, win_layout))
        c = self.compressor
        if c is not None:
            R = rings.csa if self.layer_type == CSA else rings.hca
            n = -(-max_seq_len // c.ratio)
            width = (2 if c.overlap else 1) * D
            st.kv_ring = torch.zeros(B, R, width, dtype=torch.float32, device=device)
            st.gate_ring = torch.zeros(B, R, width, dtype=torch.float32, device=device)
            st.pool = kv_buffer(n, D, kv_layout)
            if c.indexer is not None:
                DI = c.indexer.dim
                st.idx_kv_ring = torch.zeros(B, R, 2 * DI, dtype=torch.float32, device=device)
                st.idx_gate_ring = torch.zeros(B, R, 2 * DI, dtype=torch.float32, device=device)
                st.idx_pool = kv_buffer(n, DI, fp8.IndexerLayout(DI) if fp8_cache else None)
        return st

    def setup_cache(self, batch_size: int, max_seq_len: int, rings: RingSizes, dtype: torch.dtype,
                    fp8_cache: bool = False) -> None:
        """Register this layer's cache as non-persistent buffers (``state_dict`` is unchanged;
        ``module.to(device)`` moves them)."""
        self.clear_cache()
        state = self.new_state(batch_size, max_seq_len, rings, dtype, self.q_a_proj.weight.device, fp8_cache)
        for name, t in state.tensors().items():
            self.register_buffer(name, t, persistent=False)
        self._cache_names = tuple(state.tensors())

    def clear_cache(self) -> None:
        for name in self._cache_names:
            delattr(self, name)
        self._cache_names = ()

    @property
    def has_cache(self) -> bool:
        return bool(self._cache_names)

    def cache_state(self) -> AttentionState:
        """The cache buffers as an :class:`AttentionState` (``setup_cache`` first)."""
        return AttentionState(**{name: getattr(self, name) for name in self._cache_names})

    # ---------------------------------------------------------------- pieces shared with the oracle
    def q_kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Roped queries ``[B,S,H,D]``, query latent ``qr`` and roped kv ``[B,S,D]``."""
        B, S, _ = x.shape
        qr = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(qr).view(B, S, self.num_heads, self.head_dim)
        q = rms_norm(q, None, self.eps).to(x.dtype)  # per-head unweighted norm
        q = apply_rope(q, cos[:, :, None], sin[:, :, None])
        kv = apply_rope(self.kv_norm(self.kv_proj(x)), cos, sin)
        return q, qr, kv

    def out(self, o: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Undo the value rotation at the query position, then the grouped output projection."""
        B, S = o.shape[:2]
        g = self.o_groups
        o = apply_rope(o, cos[:, :, None], sin[:, :, None], inverse=True)
        w_a = self.o_a_proj.weight.view(g, self.cfg.o_lora_rank, -1)
        z = grouped_linear(o.reshape(B, S, g, -1), w_a)  # [B, S, g, r]
        return self.o_b_proj(z.flatten(2))

    # ---------------------------------------------------------------- the step
    def forward(self, x: Tensor, meta: StepMeta, state: AttentionState) -> Tensor:
        """Consume ``n_new[b]`` new tokens per row (``x[b, :n_new[b]]`` at positions
        ``meta.start[b]..``; ``meta`` comes from ``plan_step``), update ``state`` in place and
        return ``[B, S, hidden]`` (rows past ``n_new`` are padding)."""
        B, S, _ = x.shape
        plan, start = meta.plan, meta.start
        pos = plan.positions.clamp(min=0).long()
        cos, sin = self.cos[pos], self.sin[pos]  # [B, S, r/2]
        q, qr, kv = self.q_kv(x, cos, sin)

        c = self.compressor
        is_fp8 = fp8.is_fp8_cache(state.window)  # static: the state's layout
        sim = self.quant_sim and not is_fp8
        rope = self.cfg.rope_head_dim
        # a layer without a pool attends over an empty one of the window's dtype (the kernels take
        # one dtype for both; an FP8 window pairs with an empty pool in the model's dtype)
        cmp = kv.new_zeros(B, 0, self.head_dim, dtype=kv.dtype if is_fp8 else state.window.dtype)
        cmp_idx = torch.full((B, S, 0), -1, dtype=torch.int32, device=x.device)
        cmp_len = torch.zeros(B, S, dtype=torch.int32, device=x.device)
        table = None  # the compressed pools' block table (a paged pool), for the ops that read them
        if c is not None:
            csa = self.layer_type == CSA
            table = state.block_table
            emit, write, visible = ((plan.csa_emit, plan.csa_write, plan.csa_len) if csa
                                    else (plan.hca_emit, plan.hca_write, plan.hca_len))
            c.step(x, pos, start, emit, write, state.kv_ring, state.gate_ring, state.pool, self.cos, self.sin, table)
            if sim:
                _simulate_rows(state.pool, emit, lambda e: fp8.simulate_kv(e, rope), table)
            cmp = state.pool
            if csa:
                idx = c.indexer
                idx.step(x, pos, start, emit, write, state.idx_kv_ring, state.idx_gate_ring, state.idx_pool,
                         self.cos, self.sin, table)
                if sim:
                    _simulate_rows(state.idx_pool, emit, fp8.simulate_keys, table)
                qI, w = idx.queries(x, qr, cos, sin)
                if is_fp8 or sim:  # the keys are stored rotated: rotate the queries alike
                    qI = fp8.rotate(qI).to(qI.dtype)
                if sim:  # what the op does over FP8 keys: FP8 queries
                    qI = fp8.simulate_queries(qI).to(qI.dtype)
                cmp_idx = dsv4.indexer_topk(qI, w, state.idx_pool, visible, idx.topk, table)
            else:
                cmp_len = visible

        if is_fp8:
            # concat mode attends over the dequantised ring + the new rows as the cache will hold them
            src = (torch.cat([fp8.read_kv(state.window, self.head_dim).to(kv.dtype), fp8.simulate_kv(kv, rope)], dim=1)
                   if meta.concat else state.window)
            dsv4.cache_write(state.window, kv, plan.win_write)  # quantises on write
        else:
            kv = fp8.simulate_kv(kv, rope).to(state.window.dtype) if sim else kv.to(state.window.dtype)
            src = torch.cat([state.window, kv], dim=1) if meta.concat else state.window
            dsv4.cache_write(state.window, kv, plan.win_write)  # concat mode: src was copied before
        o = dsv4.sparse_attention(q, src, plan.win_idx, cmp, cmp_idx, cmp_len, self.sinks, self.scale, table)
        return self.out(o, cos, sin)

    def rings(self, state: AttentionState) -> RingSizes:
        """Ring sizes of ``state`` (rates this layer does not use get the defaults)."""
        default = ring_sizes(self.cfg)
        rc = state.kv_ring.shape[1] if state.kv_ring is not None else 0
        window = fp8.entries(state.window)
        return RingSizes(window=window, csa=rc if self.layer_type == CSA else default.csa,
                         hca=rc if self.layer_type == HCA else default.hca)


def _simulate_rows(pool: Tensor, slots: Tensor, simulate, block_table: Tensor | None = None) -> None:
    """Reference FP8 numerics on a float pool (pages through ``block_table``, if given): the rows
    just written at ``slots [B, E]`` (-1 = none) become ``simulate(rows)``, what an FP8 pool would
    give back."""
    B, E = slots.shape
    if block_table is None:
        rows = torch.gather(pool, 1, slots.clamp(min=0).long()[..., None].expand(B, E, pool.shape[-1]))
    else:  # the pages as one row of entries
        rows = pool.flatten(0, 1)[physical_entries(slots, block_table, pool).clamp(min=0)]
    dsv4.cache_write(pool, simulate(rows).to(pool.dtype), slots, block_table)
