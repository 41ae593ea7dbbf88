"""DeepSeek-V4 for causal LM on the dsv4 ops (dsv4_architecture.md §3-§9).

Parameter names equal HF transformers' ``DeepseekV4ForCausalLM`` (``model.embed_tokens``,
``model.layers.N.{self_attn,mlp,attn_hc,ffn_hc,input_layernorm,post_attention_layernorm}``,
``model.norm``, ``model.hc_head``, ``lm_head``), so ``load_state_dict(hf.state_dict())`` loads
everything. Numerics follow the official reference: norms, mHC, sinks, compressor gates and
the router stay fp32 whatever the model dtype (parameters created fp32, math upcast).

Two entry points, both ``torch.compile(model, fullgraph=True)``-able:

* ``model(input_ids)`` — cache-free full forward of whole prompts from position 0:
  ``[B, S] -> [B, S, vocab]`` fp32 logits. Needs no set-up (its scratch state is allocated
  inside the step).
* ``model(input_ids, lengths, n_new)`` — the cached step, after ``model.setup_caches(...)``
  (gpt-fast style: the KV pool is non-persistent module buffers, allocated once). Row ``b``
  brings ``n_new[b]`` new tokens (``input_ids[b, :n_new[b]]``; the rest is padding) at
  positions ``lengths[b]..``; the pool is updated in place and the CALLER advances
  ``lengths += n_new``. ``last_only=True`` returns only each row's last new token's logits
  ``[B, vocab]`` (what prefill chunks and decode steps need). Rows ``B <= max_batch_size``
  use the first ``B`` rows of the pool.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from ..config import DSV4Config
from ..ops.validate import check_int, reads_values
from ..reference.rope import rope_tables
from .attention import AttentionState, RMSNorm
from .decoder_layer import DecoderLayer
from .hyper_connection import HyperHead
from .kv_cache_dtype import check_kv_cache_dtype
from .mtp import MTPBlock
from .moe import SCORE_FUNCS
from .plan import RingSizes, StepMeta, plan_step, ring_sizes

__all__ = ["DeepseekV4ForCausalLM", "DeepseekV4Model", "CacheConfig", "DEFAULT_MAX_POSITIONS"]

# RoPE tables are precomputed per rope type; 1M positions would cost 256 MB each, so the
# default covers 32K and `setup_caches` / `set_max_positions` grow them.
DEFAULT_MAX_POSITIONS = 32768


class CacheConfig(NamedTuple):
    """What ``setup_caches`` allocated."""

    max_batch_size: int
    max_seq_len: int  # positions the pool can address
    lookahead: int  # extra ring slots for steps of up to 1 + lookahead tokens in ring mode
    mtp: bool  # the MTP block has a window ring too
    dtype: torch.dtype
    rings: RingSizes
    mtp_rings: RingSizes
    kv_cache_dtype: str = "auto"  # "auto" | "bf16" | "fp8" (kv_cache_dtype.py)


class DeepseekV4Model(nn.Module):
    def __init__(self, cfg: DSV4Config, rope: dict[str, tuple[Tensor, Tensor]]) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rope) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg.hidden_size, cfg.hc_mult, cfg.hc_eps, cfg.rms_norm_eps)


def set_rope(attentions, cfg: DSV4Config, n: int, device) -> None:
    """Give each attention layer the shared RoPE tables of its type for ``n`` positions."""
    rope = rope_tables_for(cfg, n, device)
    for attn in attentions:
        attn.cos, attn.sin = rope["main" if attn.ratio == 0 else "compress"]


def rope_tables_for(cfg: DSV4Config, max_positions: int, device=None) -> dict[str, tuple[Tensor, Tensor]]:
    """(cos, sin) of positions ``< max_positions`` for the main attention (``"main"``) and the
    compressed entries (``"compress"``), each with its own theta and YaRN settings."""
    tables = {}
    for name, layer_type in (("main", "sliding_attention"), ("compress", "compressed_sparse_attention")):
        theta, yarn = cfg.rope_params(layer_type)
        cos, sin = rope_tables(theta, cfg.rope_head_dim, max_positions, yarn)
        tables[name] = (cos.to(device), sin.to(device))
    return tables


class DeepseekV4ForCausalLM(nn.Module):
    """DeepSeek-V4 on the dsv4 ops.

    Args:
        config: a ``DSV4Config``.
        dtype: dtype of the projection / embedding / expert weights (fp32-only parameters —
            norms, mHC, sinks, position biases, router bias — stay fp32).
        device: where to build it. ``"meta"`` builds it without storage or random init (what
            ``load_pretrained`` does); then load every weight with ``load_state_dict(sd,
            assign=True)`` and call ``materialize_buffers(device)``.
        max_positions: RoPE table length (default ``min(max_position_embeddings, 32768)``).

    >>> m = DeepseekV4ForCausalLM(DSV4Config.tiny())
    >>> m(torch.randint(0, 256, (2, 9))).shape
    torch.Size([2, 9, 256])
    """

    def __init__(self, config: DSV4Config, dtype: torch.dtype = torch.float32, device=None,
                 max_positions: int | None = None) -> None:
        super().__init__()
        if config.scoring_func not in SCORE_FUNCS:
            # DSV4Config checks it too; a config edited after construction must not reach the router
            raise ValueError(f"DeepseekV4ForCausalLM: config.scoring_func={config.scoring_func!r} is not "
                             f"supported (one of {tuple(SCORE_FUNCS)}, as HF's DeepseekV4 router)")
        self.config = config
        max_positions = max_positions or min(config.max_position_embeddings, DEFAULT_MAX_POSITIONS)
        with torch.device(device or "cpu"):
            rope = rope_tables_for(config, max_positions)
            self.model = DeepseekV4Model(config, rope)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            # the MTP (NextN) drafter: `mtp.0.*`, used by Generator(spec_steps=k)
            self.mtp = nn.ModuleList(MTPBlock(config, rope) for _ in range(min(config.num_nextn_predict_layers, 1)))
        cast_non_fp32_params(self, dtype)
        self.cache_config: CacheConfig | None = None

    # ------------------------------------------------------------------ properties
    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def max_positions(self) -> int:
        return self.model.layers[0].self_attn.cos.shape[0]

    def _attention_layers(self):
        return [layer.self_attn for layer in [*self.model.layers, *self.mtp]]

    def set_max_positions(self, n: int) -> None:
        """Rebuild the shared RoPE tables for ``n`` positions (no-op if already that long)."""
        if n != self.max_positions:
            set_rope(self._attention_layers(), self.config, n, self.device)

    def materialize_buffers(self, device=None) -> None:
        """Compute the buffers derived from the config (the RoPE tables, non-persistent, in no
        checkpoint) on ``device`` (default: the model's). For a model built on the meta device
        whose weights were then loaded with ``load_state_dict(..., assign=True)``."""
        set_rope(self._attention_layers(), self.config, self.max_positions, device or self.device)

    # ------------------------------------------------------------------ caches
    def setup_caches(self, max_batch_size: int, max_seq_len: int, lookahead: int = 0, mtp: bool = False,
                     dtype: torch.dtype | None = None, kv_cache_dtype: str = "auto") -> CacheConfig:
        """Allocate the KV pool once, as non-persistent buffers of each attention layer: window
        rings, compressor-input rings, compressed pools and indexer-key pools for
        ``max_batch_size`` rows of up to ``max_seq_len`` positions (RoPE tables grow to match).

        ``lookahead``: extra ring slots so steps of ``1 + lookahead`` tokens (speculative verify)
        run in ring mode. ``mtp``: also give the MTP block a window ring (one slot more, see
        ``speculative.py``). ``dtype``: of the window and pools (default: the model's; the
        compressor-input rings are fp32). ``kv_cache_dtype``: ``"auto"`` (``dtype``), ``"bf16"``, or
        ``"fp8"`` -- FlashMLA's FP8 V4 page layout for window rings and compressed pools, FP8
        indexer keys (``dsv4_ops/reference/fp8_cache.py``; ``kv_cache_dtype.py`` says where it
        runs). Calling it again with the same arguments keeps the pool (compiled graphs stay
        valid); other arguments re-allocate it. ``state_dict`` is unchanged; ``model.to(device)``
        moves the pool with the weights.
        """
        for name, value, low in (("max_batch_size", max_batch_size, 1), ("max_seq_len", max_seq_len, 1),
                                 ("lookahead", lookahead, 0)):
            check_int(f"setup_caches: {name}", value, low)
        if mtp and len(self.mtp) == 0:
            raise ValueError("setup_caches: mtp=True but the model has no MTP block "
                             "(config.num_nextn_predict_layers = 0)")
        kv_cache_dtype = check_kv_cache_dtype("setup_caches: kv_cache_dtype", kv_cache_dtype, self.config,
                                              self.device)
        dtype = torch.bfloat16 if kv_cache_dtype == "bf16" else dtype or self.dtype
        fp8_cache = kv_cache_dtype == "fp8"
        cfg = self.config
        want = CacheConfig(max_batch_size, max_seq_len, lookahead, mtp, dtype, ring_sizes(cfg, lookahead),
                           ring_sizes(cfg, lookahead + 1), kv_cache_dtype)
        if want == self.cache_config and all(layer.self_attn.has_cache for layer in self.model.layers):
            return want
        if max_seq_len > self.max_positions:
            self.set_max_positions(max_seq_len)
        for layer in self.model.layers:
            layer.self_attn.setup_cache(max_batch_size, max_seq_len, want.rings, dtype, fp8_cache)
        for blk in self.mtp:
            if mtp:
                blk.self_attn.setup_cache(max_batch_size, max_seq_len, want.mtp_rings, dtype, fp8_cache)
            else:
                blk.self_attn.clear_cache()
        self.cache_config = want
        return want

    def simulate_fp8_cache(self, enabled: bool = True) -> None:
        """Reference FP8 numerics on float caches (the oracle of ``kv_cache_dtype="fp8"``): every
        row written to a window ring or compressed pool becomes what the FP8 cache would give
        back (quantise -> dequantise, ``fp8_cache.simulate_kv``), indexer keys and queries are
        rotated and quantised (``simulate_keys``, ``simulate_queries``). Applies to the cache-free
        forward and to float caches; an FP8 cache is quantised anyway."""
        for attn in self._attention_layers():
            attn.quant_sim = bool(enabled)

    def clear_caches(self) -> None:
        """Free the KV pool."""
        for attn in self._attention_layers():
            attn.clear_cache()
        self.cache_config = None

    def cache_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for a in self._attention_layers() if a.has_cache
                   for t in a.cache_state().tensors().values())

    def cache_states(self, rows: int | None = None) -> list[AttentionState]:
        """The main layers' cache buffers (the first ``rows`` rows)."""
        states = [layer.self_attn.cache_state() for layer in self.model.layers]
        return states if rows is None else [s.rows(rows) for s in states]

    def mtp_cache_state(self, rows: int | None = None) -> AttentionState:
        state = self.mtp[0].self_attn.cache_state()
        return state if rows is None else state.rows(rows)

    # ------------------------------------------------------------------ running
    def plan(self, lengths: Tensor, n_new: Tensor, num_tokens: int, concat: bool | None = None,
             rings: RingSizes | None = None) -> StepMeta:
        """The step's one ``plan`` call: metadata every layer reads."""
        return plan_step(self.config, lengths, n_new, num_tokens, rings or self.cache_config.rings, concat)

    def hidden_streams(self, input_ids: Tensor, lengths: Tensor, n_new: Tensor, meta: StepMeta | None = None,
                       states: list[AttentionState] | None = None) -> Tensor:
        """Final residual streams ``[B, S, hc_mult, hidden]`` (before ``hc_head``) of a cached step
        (``states``: default the cache buffers' first ``B`` rows)."""
        if states is None:
            states = self.cache_states(input_ids.shape[0])
        if meta is None:
            meta = self.plan(lengths, n_new, input_ids.shape[1])
        h = self.model.embed_tokens(input_ids)
        x = h.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        for layer, state in zip(self.model.layers, states):
            x = layer(x, meta, state, input_ids)
        return x

    def logits(self, streams: Tensor) -> Tensor:
        """``[..., hc_mult, hidden]`` streams -> fp32 logits ``[..., vocab]``."""
        return self.lm_head(self.model.norm(self.model.hc_head(streams))).float()

    def forward(self, input_ids: Tensor, lengths: Tensor | None = None, n_new: Tensor | None = None, *,
                last_only: bool = False) -> Tensor:
        """Cache-free (``lengths=None``) or cached step; see the module docstring.

        Returns fp32 logits ``[B, S, vocab]``, or ``[B, vocab]`` at each row's last new token
        with ``last_only=True``. Bad shapes raise ``ValueError``; in eager mode token ids,
        ``n_new`` and the pool's capacity are checked too (a compiled step reads no values).
        The dsv4 ops are inference kernels without a backward, so the step never records
        autograd (the logits do not require grad), also under ``torch.compile`` with grad enabled.
        """
        with torch.no_grad():
            return self._forward(input_ids, lengths, n_new, last_only)

    def _forward(self, input_ids: Tensor, lengths: Tensor | None, n_new: Tensor | None, last_only: bool) -> Tensor:
        B, S = self._check_input_ids(input_ids)
        if lengths is None:
            if n_new is not None:
                raise ValueError("forward: n_new needs lengths (the cached step); the cache-free forward "
                                 "runs every token of input_ids")
            if S > self.max_positions:
                raise ValueError(f"forward: input_ids has {S} tokens > max_positions {self.max_positions} "
                                 "(grow it with model.set_max_positions)")
            lengths = torch.zeros(B, dtype=torch.int32, device=input_ids.device)
            n_new = torch.full_like(lengths, S)
            states = [layer.self_attn.new_state(B, S, None, self.dtype, input_ids.device)
                      for layer in self.model.layers]
            meta = self.plan(lengths, n_new, S, rings=ring_sizes(self.config))
        else:
            n_new = self._check_cached_step(input_ids, lengths, n_new)
            states, meta = self.cache_states(B), None
        return self.step_logits(input_ids, lengths, n_new, states, meta, last_only)

    def step_logits(self, input_ids: Tensor, lengths: Tensor, n_new: Tensor, states: list[AttentionState],
                    meta: StepMeta | None = None, last_only: bool = False) -> Tensor:
        """The step over explicit ``states`` (no checks): fp32 logits ``[B, S, vocab]``, or
        ``[B, vocab]`` at each row's last new token. ``forward`` and the exported programs
        (``dsv4_ops.export``, whose KV pool is a program input) both run this."""
        streams = self.hidden_streams(input_ids, lengths, n_new, meta, states)
        if last_only:
            last = (n_new.long() - 1).clamp(min=0)
            streams = streams[torch.arange(input_ids.shape[0], device=input_ids.device), last][:, None]
            return self.logits(streams)[:, 0]
        return self.logits(streams)

    # ------------------------------------------------------------------ boundary checks
    def _check_input_ids(self, input_ids: Tensor) -> tuple[int, int]:
        if not isinstance(input_ids, Tensor):
            raise ValueError(f"forward: input_ids must be a LongTensor [B, S], got {type(input_ids).__name__}")
        if input_ids.dim() != 2:
            raise ValueError(f"forward: input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise ValueError(f"forward: input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        B, S = input_ids.shape
        if B == 0 or S == 0:
            raise ValueError(f"forward: input_ids must have at least one row and one token, got shape {(B, S)}")
        if reads_values(input_ids):
            bad = (input_ids < 0) | (input_ids >= self.config.vocab_size)
            if bool(bad.any()):
                b, s = (int(i) for i in bad.nonzero()[0])
                raise ValueError(f"forward: input_ids[{b}, {s}] = {int(input_ids[b, s])} is outside "
                                 f"[0, vocab_size={self.config.vocab_size})")
        return B, S

    def _check_cached_step(self, input_ids: Tensor, lengths: Tensor, n_new: Tensor | None) -> Tensor:
        cc = self.cache_config
        if cc is None:
            raise ValueError("forward: the cached step (lengths given) needs model.setup_caches(max_batch_size, "
                             "max_seq_len) first")
        B, S = input_ids.shape
        if B > cc.max_batch_size:
            raise ValueError(f"forward: input_ids has {B} rows > max_batch_size {cc.max_batch_size} "
                             "of setup_caches")
        if n_new is None:
            n_new = torch.full((B,), S, dtype=torch.int32, device=input_ids.device)
        for name, t in (("lengths", lengths), ("n_new", n_new)):
            if not isinstance(t, Tensor) or t.shape != (B,) or t.dtype != torch.int32:
                raise ValueError(f"forward: {name} must be an int32 tensor of shape [{B}] (the rows of "
                                 f"input_ids), got {getattr(t, 'dtype', type(t).__name__)} "
                                 f"{tuple(getattr(t, 'shape', ()))}")
        if reads_values(lengths, n_new):
            if bool(((n_new < 0) | (n_new > S)).any()):
                raise ValueError(f"forward: n_new must be in [0, {S}] (input_ids.shape[1]), got {n_new.tolist()}")
            end = lengths.long() + n_new.long()
            if bool(((lengths < 0) | (end > cc.max_seq_len)).any()):
                raise ValueError(f"forward: lengths + n_new = {end.tolist()} exceeds the pool's max_seq_len "
                                 f"{cc.max_seq_len} (or lengths < 0): call setup_caches with a larger max_seq_len")
        return n_new


def cast_non_fp32_params(model: nn.Module, dtype: torch.dtype) -> None:
    """Put the big weights in ``dtype``; parameters the reference keeps fp32 stay fp32 (norms,
    mHC, sinks, compressor position biases are created fp32; Linear/Embedding weights are
    the only ones cast)."""
    if dtype == torch.float32:
        return
    for mod in model.modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            mod.to(dtype)
    for name, p in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            p.data = p.data.to(dtype)
