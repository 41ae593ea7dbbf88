"""``dsv4_ops.export``: one AOTInductor ``.pt2`` package with the model's prefill-chunk and decode
programs (and, with ``spec_steps = k > 0``, the speculative prefill chunk and step), for
``AOTIGenerator`` (Python) and ``build/dsv4_run`` (C++, ``csrc/runner``).

Package layout (format 1). Models, each an AOTI program over a static batch ``B``:

* ``prefill(ids int64 [B, C], n_new int32 [B], lengths int32 [B], cache...) -> logits fp32 [B, V]``
  at each row's last new token of the chunk, ``C`` the largest of the package's chunk sizes
  (``dsv4.prefill_chunks``, ascending; ``dsv4.prefill_chunk`` is the largest); ``prefill_<C>``
  the same for each smaller one, so that a step whose rows have fewer tokens left runs the smallest
  chunk that holds them (``generation_loop.chunk_schedule``);
* ``decode(ids int64 [B], n_new int32 [B], lengths int32 [B], cache...) -> logits fp32 [B, V]``;
* with ``spec_steps = k``: ``spec_prefill(ids [B, C], next_ids [B, C], n_new, n_mtp, lengths,
  h_last, cache..., mtp_cache...) -> logits`` (also fills the MTP block's window) and
  ``spec(active int32 [B], lengths, last_tok int64 [B], drafts int64 [B, k], h_last, cache...,
  mtp_cache...) -> (tokens int64 [B, k+1], counts int32 [B])`` (verify + MTP drafts, one step;
  ``speculative.py``); ``spec_prefill_<C>`` for each smaller chunk size.

Every program updates its state inputs IN PLACE (the KV pool ``cache...`` — every layer's
window ring, compressor-input rings and pools, flattened in the order ``dsv4.cache`` lists —
``lengths += n_new``, and the speculative state): the state is allocated once by the caller
(zeros) and passed to every program, so they share it. A row with ``n_new == 0`` (``active ==
0``) is padding. Every model's metadata carries ``dsv4.format``, ``dsv4.max_batch_size``,
``dsv4.max_seq_len``, ``dsv4.prefill_chunk``, ``dsv4.prefill_chunks``, ``dsv4.vocab_size``,
``dsv4.spec_steps``, ``dsv4.device``, ``dsv4.cache`` (``"dtype:d0xd1x..;..."``) and, for ``k > 0``,
``dsv4.mtp_cache`` and ``dsv4.h_last``. The weights are compiled into each program.

The exported graphs mutate whole input tensors (never views), so Inductor writes the pool in
place: no cache copies (``tests/export`` pins the decode graph's op list). On CUDA the Triton
kernels of the ops are compiled into the package; no Python is needed to run it. The indexer's
CUDA top-k (``dsv4::topk_rows_cuda``, a C++ op of dsv4_ops' native library) stays a call, which
AOTInductor's proxy executor makes: a process that loads such a package must have loaded the
library first (``AOTIGenerator`` does by importing dsv4_ops, ``build/dsv4_run`` by ``--library``
or next to itself; ``dsv4_ops/native.py``).
"""
from __future__ import annotations

import io
import os
import tempfile

import torch
from torch import Tensor, nn

from .generation_loop import DEFAULT_MAX_PREFILL_TOKENS, chunk_buckets, chunks_within
from .model.attention import AttentionState
from .model.kv_cache_dtype import check_kv_cache_dtype
from .ops.validate import check_int
from .model.plan import RingSizes, ring_sizes
from .progress import Progress
from .speculative import SpecState, SpeculativeStep

__all__ = ["export", "FORMAT", "PROGRAMS", "SPEC_PROGRAMS", "cache_spec", "parse_cache_spec", "prefill_program",
           "prefill_chunks"]

FORMAT = "1"
PROGRAMS = ("prefill", "decode")
SPEC_PROGRAMS = ("spec_prefill", "spec")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int32": torch.int32,
           "int64": torch.int64, "uint8": torch.uint8}  # uint8: FP8 cache pages
_NAMES = {v: k for k, v in _DTYPES.items()}


def prefill_program(name: str, chunk: int, chunks: list[int]) -> str:
    """The program of ``name`` (``"prefill"`` or ``"spec_prefill"``) for chunks of ``chunk`` tokens:
    ``name`` itself for the largest of ``chunks``, else ``name_<chunk>``."""
    return name if chunk == max(chunks) else f"{name}_{chunk}"


def prefill_chunks(metadata: dict[str, str]) -> list[int]:
    """A package's chunk sizes, ascending (a package without ``dsv4.prefill_chunks``: its one chunk)."""
    return [int(c) for c in metadata.get("dsv4.prefill_chunks", metadata["dsv4.prefill_chunk"]).split(",")]


def cache_spec(tensors: list[Tensor]) -> str:
    """``"float32:4x16x64;..."`` — what ``dsv4.cache`` stores."""
    return ";".join(f"{_NAMES[t.dtype]}:{'x'.join(map(str, t.shape))}" for t in tensors)


def parse_cache_spec(spec: str) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    out = []
    for item in filter(None, spec.split(";")):
        dtype, dims = item.split(":")
        out.append((_DTYPES[dtype], tuple(int(d) for d in dims.split("x"))))
    return out


def _unflatten(layout: list[list[str]], flat: list[Tensor]) -> list[AttentionState]:
    it = iter(flat)
    return [AttentionState(**{name: next(it) for name in names}) for names in layout]


class _CachedStep(nn.Module):
    """``prefill`` / ``decode``: the model's cached step over an explicit, flattened pool."""

    def __init__(self, model, layout: list[list[str]], rings: RingSizes) -> None:
        super().__init__()
        self.model, self.layout, self.rings = model, layout, rings

    def forward(self, ids: Tensor, n_new: Tensor, lengths: Tensor, cache: list[Tensor]) -> Tensor:
        states = _unflatten(self.layout, cache)
        if ids.dim() == 1:  # decode: one token per row
            ids = ids[:, None]
        meta = self.model.plan(lengths, n_new, ids.shape[1], rings=self.rings)
        logits = self.model.step_logits(ids, lengths, n_new, states, meta, last_only=True)
        lengths.add_(n_new)
        return logits


class _SpecProgram(nn.Module):
    """``SpeculativeStep`` over program inputs (the state is passed in, never owned)."""

    def __init__(self, model, k: int, layout, mtp_layout, rings: RingSizes, mtp_rings: RingSizes) -> None:
        super().__init__()
        self.model, self.layout, self.mtp_layout = model, layout, mtp_layout
        self.rings, self.mtp_rings, self.k = rings, mtp_rings, k

    def state(self, lengths, last_tok, drafts, h_last, cache, mtp_cache) -> SpecState:
        return SpecState(lengths, last_tok, drafts, h_last, _unflatten(self.layout, cache),
                         _unflatten(self.mtp_layout, mtp_cache)[0], self.rings, self.mtp_rings)


class _SpecPrefill(_SpecProgram):
    def forward(self, ids, next_ids, n_new, n_mtp, lengths, h_last, cache: list[Tensor], mtp_cache: list[Tensor]):
        st = self.state(lengths, None, None, h_last, cache, mtp_cache)
        return SpeculativeStep(self.model, self.k).prefill(st, ids, next_ids, n_new, n_mtp)


class _SpecStep(_SpecProgram):
    def forward(self, active, lengths, last_tok, drafts, h_last, cache: list[Tensor], mtp_cache: list[Tensor]):
        st = self.state(lengths, last_tok, drafts, h_last, cache, mtp_cache)
        return SpeculativeStep(self.model, self.k).step(st, active)


def export(model, path: str | os.PathLike, max_batch_size: int = 4, max_seq_len: int = 4096, spec_steps: int = 0,
           prefill_chunk: int | list[int] | tuple[int, ...] | None = None, *, verbose: bool = True,
           kv_cache_dtype: str = "auto") -> str:
    """Export ``model`` (a ``dsv4_ops.DeepseekV4ForCausalLM``, on the device the package will run
    on) as ONE ``.pt2`` package (see the module docstring) for batches of up to
    ``max_batch_size`` requests of up to ``max_seq_len`` tokens, prefilled in chunks:
    ``prefill_chunk`` one chunk size or several (a prefill program each); default: ``Generator``'s
    chunk buckets whose step of ``max_batch_size`` rows stays in its default token budget (64,
    256, 1024 and 2048 tokens for 4 rows; 64 for 64), so a short prompt does not pay for a long
    chunk; ``spec_steps = k > 0`` adds the MTP speculative programs (``k`` drafts per step).
    Returns the path. Load it with ``dsv4_ops.AOTIGenerator(path)`` or run it with
    ``build/dsv4_run``. Compiling takes tens of seconds to minutes per program on a CPU, about a
    minute on a GPU; ``verbose`` prints one progress line per program. ``kv_cache_dtype``
    (``"auto"`` = the model's dtype, ``"bf16"``, ``"fp8"``) fixes the pool's layout in the package
    (``dsv4.kv_cache_dtype``; ``AOTIGenerator`` allocates what ``dsv4.cache`` lists).
    """
    path = os.fspath(path)
    if not path.endswith(".pt2"):
        raise ValueError(f"export: path must end in .pt2, got {path!r}")
    check_int("export: max_batch_size", max_batch_size, 1)
    check_int("export: max_seq_len", max_seq_len, 1)
    if prefill_chunk is None:  # Generator's chunk buckets for a step of B rows
        chunks = chunks_within(chunk_buckets(max_seq_len), DEFAULT_MAX_PREFILL_TOKENS, max_batch_size)
    else:
        chunks = list(prefill_chunk) if isinstance(prefill_chunk, (list, tuple)) else [prefill_chunk]
        if not chunks:
            raise ValueError("export: prefill_chunk must be a positive int or a non-empty list of them, got []")
        for c in chunks:
            check_int("export: prefill_chunk", c, 1)
    chunks = sorted(set(chunks))
    prefill_chunk = chunks[-1]
    check_int("export: spec_steps", spec_steps, 0)
    k = spec_steps
    if k and len(model.mtp) == 0:
        raise ValueError("export: spec_steps > 0 needs the model's MTP block (config.num_nextn_predict_layers >= 1)")
    cfg, device, dtype = model.config, model.device, model.dtype
    kv_cache_dtype = check_kv_cache_dtype("export: kv_cache_dtype", kv_cache_dtype, cfg, device)
    fp8_cache = kv_cache_dtype == "fp8"
    cache_dtype = torch.bfloat16 if kv_cache_dtype == "bf16" else dtype
    model = model.eval()
    # a speculative step may write k + 1 positions past a request's last token (as in Generator)
    capacity = max_seq_len + 2 * (k + 1) if k else max_seq_len
    if capacity > model.max_positions:
        model.set_max_positions(capacity)
    B = max_batch_size
    rings, mtp_rings = ring_sizes(cfg, k), ring_sizes(cfg, k + 1)
    states = [layer.self_attn.new_state(B, capacity, rings, cache_dtype, device, fp8_cache) for layer in model.model.layers]
    layout = [list(st.tensors()) for st in states]
    cache = [t for st in states for t in st.tensors().values()]
    lengths = torch.zeros(B, dtype=torch.int32, device=device)
    metadata = {"dsv4.format": FORMAT, "dsv4.max_batch_size": str(B), "dsv4.max_seq_len": str(max_seq_len),
                "dsv4.prefill_chunk": str(prefill_chunk), "dsv4.prefill_chunks": ",".join(map(str, chunks)),
                "dsv4.vocab_size": str(cfg.vocab_size),
                "dsv4.spec_steps": str(k), "dsv4.device": device.type, "dsv4.cache": cache_spec(cache),
                "dsv4.kv_cache_dtype": kv_cache_dtype}
    ones = torch.ones(B, dtype=torch.int32, device=device)
    cached = _CachedStep(model, layout, rings)

    def chunk_args(C: int) -> tuple[Tensor, Tensor]:  # a chunk's ids and n_new
        ids = torch.zeros(B, C, dtype=torch.long, device=device)
        return ids, torch.full((B,), C, dtype=torch.int32, device=device)

    programs = {prefill_program("prefill", C, chunks): (cached, (*chunk_args(C), lengths, cache)) for C in chunks}
    programs["decode"] = (cached, (torch.zeros(B, dtype=torch.long, device=device), ones, lengths, cache))
    if k:
        mtp_state = model.mtp[0].self_attn.new_state(B, capacity, mtp_rings, cache_dtype, device, fp8_cache)
        mtp_layout, mtp_cache = [list(mtp_state.tensors())], list(mtp_state.tensors().values())
        h_last = torch.zeros(B, cfg.hc_mult, cfg.hidden_size, dtype=dtype, device=device)
        metadata.update({"dsv4.mtp_cache": cache_spec(mtp_cache), "dsv4.h_last": cache_spec([h_last])})
        spec_args = (model, k, layout, mtp_layout, rings, mtp_rings)
        spec_prefill = _SpecPrefill(*spec_args)
        for C in chunks:
            ids_c, full = chunk_args(C)
            programs[prefill_program("spec_prefill", C, chunks)] = (
                spec_prefill, (ids_c, ids_c, full, full - 1, lengths, h_last, cache, mtp_cache))
        programs["spec"] = (_SpecStep(*spec_args), (ones, lengths, torch.zeros(B, dtype=torch.long, device=device),
                                                    torch.zeros(B, k, dtype=torch.long, device=device), h_last,
                                                    cache, mtp_cache))
    saved_cache = model.cache_config
    model.clear_caches()  # the pool is a program input here, not a set of constants
    try:
        estimate = 60 if device.type == "cuda" else 45
        # each export compiles into its own directory: Inductor names its output by the generated
        # code, and two models of one shape generate the same code with different weights
        with tempfile.TemporaryDirectory(prefix="dsv4_export_") as work:
            files = {}
            for i, (name, (module, args)) in enumerate(programs.items()):
                os.makedirs(os.path.join(work, name))
                # AOTInductor's C++ runtime cannot call the Gluon attention (a Python op), so that route
                # steps aside while torch exports (attention_sm90.applies); the CUDA top-k is a C++ op,
                # which the package calls. The route is taken inside the op bodies, after the AOTAutograd
                # cache's key (the graph before them) is made: a graph torch.compile cached must not serve.
                with Progress(f"export {i + 1}/{len(programs)}: {name} program (torch.export + AOTInductor)",
                              estimate_s=estimate, stream=None if verbose else io.StringIO()), \
                        torch._functorch.config.patch(enable_autograd_cache=False):
                    ep = exported_program(module, args)
                    files[name] = torch._inductor.aot_compile(
                        ep.module(), ep.example_inputs[0], ep.example_inputs[1],
                        options={"aot_inductor.package": True, "aot_inductor.metadata": dict(metadata),
                                 "aot_inductor.output_path": os.path.join(work, name)})
            from torch._inductor.package import package_aoti

            folder = os.path.dirname(os.path.abspath(path))
            os.makedirs(folder, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder, suffix=".pt2", delete=False) as tmp:
                tmp_path = tmp.name
            package_aoti(tmp_path, files)
            os.replace(tmp_path, path)  # a half-written package never sits at `path`
    finally:
        if saved_cache is not None:
            model.setup_caches(saved_cache.max_batch_size, saved_cache.max_seq_len, saved_cache.lookahead,
                               saved_cache.mtp, saved_cache.dtype, saved_cache.kv_cache_dtype)
    return path


def exported_program(module: nn.Module, args: tuple):
    """``torch.export`` of one program on copies of its example state (static shapes: the batch,
    chunk and pool are fixed; the example values are never read)."""
    def copy(a):
        return [t.clone() for t in a] if isinstance(a, list) else a.clone()

    with torch.no_grad():
        return torch.export.export(module, tuple(copy(a) for a in args))
