"""Generator: ragged-batch prefill, decode and greedy generate over a static KV pool.

The step functions are plain tensor programs (one ``plan`` per step, every layer reads it)
with no host syncs, no data-dependent shapes and all state in static buffers, so
``compile=True`` wraps them in ``torch.compile(fullgraph=True)`` and, on CUDA, in CUDA
graphs (Inductor's cudagraph trees, ``mode="reduce-overhead"``). Shapes are frozen per
batch bucket: prefill runs chunks of ``prefill_chunk`` tokens, decode one token per row, so
new prompts of any length (within the bucket) reuse the compiled graphs.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import torch
from torch import Tensor

from .cache import StaticCache
from .ops._validate import trusted_inputs
from .speculative import SpecDecoding

__all__ = ["Generator"]


def _buckets(max_batch_size: int) -> list[int]:
    out, b = [], 1
    while b < max_batch_size:
        out.append(b)
        b *= 2
    return out + [max_batch_size]


class Generator:
    """Greedy generation for a ``DeepseekV4ForCausalLM`` on the dsv4 ops.

    Args:
        model: a ``dsv4_ops.DeepseekV4ForCausalLM``.
        max_batch_size: most prompts per ``prefill`` call.
        max_seq_len: most tokens (prompt + generated) per request.
        spec_steps: MTP draft tokens per step (0 = plain decode).
        compile: wrap the prefill and decode steps in ``torch.compile(fullgraph=True)``.
        cuda_graphs: replay the compiled steps as CUDA graphs (None = on when compiling a CUDA model).
        prefill_chunk: tokens per prefill step (long prompts run in several steps).

    >>> gen = Generator(DeepseekV4ForCausalLM(DSV4Config.tiny()), max_batch_size=2, max_seq_len=64, compile=False)
    >>> [len(t) for t in gen.generate([[1, 2, 3], [4]], max_new_tokens=5)]
    [5, 5]
    """

    def __init__(self, model, max_batch_size: int = 4, max_seq_len: int = 4096, spec_steps: int = 0,
                 compile: bool = True, cuda_graphs: bool | None = None, prefill_chunk: int = 64,
                 _draft: str = "mtp") -> None:
        if not isinstance(spec_steps, int) or spec_steps < 0:
            raise ValueError(f"spec_steps must be an int >= 0, got {spec_steps!r}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.model = model.eval()
        self.config = model.config
        self.device = model.device
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.prefill_chunk = prefill_chunk
        self.spec_steps = spec_steps
        # a speculative step may write up to spec_steps + 1 positions past a request's last
        # accepted token (rejected drafts), so the pool has that much slack past max_seq_len
        capacity = max_seq_len + 2 * (spec_steps + 1) if spec_steps else max_seq_len
        if capacity > model.max_positions:
            model.set_max_positions(capacity)
        self.cache = StaticCache(model, max_batch_size, capacity, lookahead=spec_steps, mtp=spec_steps > 0)
        # auto: CUDA graphs whenever the steps are compiled for a CUDA model
        self.cuda_graphs = (self.device.type == "cuda" and compile) if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and not compile:
            raise ValueError("cuda_graphs=True needs compile=True (graphs are captured by Inductor)")
        self.compiled = compile
        self.buckets = _buckets(max_batch_size)
        # device-side state: a row's only mutable scalar is its length
        self.lengths = torch.zeros(max_batch_size, dtype=torch.int32, device=self.device)
        torch._dynamo.mark_static_address(self.lengths)
        self._host_lengths: list[int] = []  # mirror for boundary checks (no device sync)
        self._bucket = 0
        self._views = {b: _BucketView(self.cache, b) for b in self.buckets}
        self._steps: dict[tuple[str, int], object] = {}
        self._graphs: dict[tuple[str, int], int] = {}  # graphs compiled per step function
        self.spec = SpecDecoding(self, spec_steps, _draft) if spec_steps else None
        self.spec_history: list[list[int]] = []  # tokens emitted per row, per speculative step
        self._stats = dict(prefill_steps=0, decode_steps=0, compile_time_s=0.0, recompiles=0, graph_breaks=0,
                           cuda_graph_replays=0, tokens_generated=0, decode_tokens=0, decode_time_s=0.0,
                           spec_steps_run=0, accepted_tokens=0, drafted_tokens=0)

    # ------------------------------------------------------------------ step functions
    def _prefill_step(self, ids: Tensor, n_new: Tensor) -> Tensor:
        # ids: [Bk, C] (row b's first n_new[b] are real), n_new: [Bk] -> logits at each row's
        # last new token [Bk, vocab]; rows with n_new == 0 return garbage (masked by caller)
        Bk = ids.shape[0]
        lengths = self.lengths[:Bk]
        streams = self.model.hidden_streams(ids, self._views[Bk], lengths, n_new)  # [Bk, C, N, D]
        last = (n_new.long() - 1).clamp(min=0)
        picked = streams[torch.arange(Bk, device=ids.device), last]  # [Bk, N, D]
        lengths.add_(n_new)
        return self.model.logits(picked[:, None])[:, 0]

    def _decode_step(self, ids: Tensor, n_new: Tensor) -> Tensor:
        # ids: [Bk] one token per row at position lengths[b] -> logits [Bk, vocab]
        Bk = ids.shape[0]
        lengths = self.lengths[:Bk]
        logits = self.model.step(ids[:, None], self._views[Bk], lengths, n_new)
        lengths.add_(n_new)
        return logits[:, 0]

    def _step_fn(self, kind: str, bucket: int):
        key = (kind, bucket)
        if key not in self._steps:
            fn = {"prefill": self._prefill_step, "decode": self._decode_step,
                  "spec_prefill": getattr(self.spec, "prefill_step", None), "spec": getattr(self.spec, "step", None)}[kind]
            if self.compiled:
                mode = "reduce-overhead" if self.cuda_graphs else None
                fn = torch.compile(fn, fullgraph=True, dynamic=False, mode=mode)
            self._steps[key] = fn
        return self._steps[key]

    def _run(self, kind: str, *args: Tensor):
        bucket = args[0].shape[0]
        fn = self._step_fn(kind, bucket)
        counters = torch._dynamo.utils.counters
        graphs_before = counters["stats"]["unique_graphs"]
        breaks_before = sum(counters["graph_break"].values())
        t0 = time.perf_counter()
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad(), trusted_inputs():
            out = fn(*args)
        new_graphs = counters["stats"]["unique_graphs"] - graphs_before
        self._stats["graph_breaks"] += sum(counters["graph_break"].values()) - breaks_before
        if self.compiled and new_graphs:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self._stats["compile_time_s"] += time.perf_counter() - t0
            key = (kind, bucket)
            self._graphs[key] = self._graphs.get(key, 0) + new_graphs
            self._stats["recompiles"] = sum(max(0, g - 1) for g in self._graphs.values())
        elif self.cuda_graphs:
            self._stats["cuda_graph_replays"] += 1
        if self.cuda_graphs:  # graph outputs are overwritten by the next replay
            out = tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()
        return out

    # ------------------------------------------------------------------ public API
    def prefill(self, prompts: Sequence[Sequence[int]]) -> Tensor:
        """Start a new batch: ``prompts`` (ragged token-id lists) -> ``[B, vocab]`` fp32
        logits at each prompt's last position. Long prompts run in chunks."""
        B = len(prompts)
        if B == 0:
            raise ValueError("prefill: prompts is empty; pass at least one prompt")
        if B > self.max_batch_size:
            raise ValueError(f"prefill: {B} prompts > max_batch_size {self.max_batch_size}")
        rows = [self._check_prompt(i, p) for i, p in enumerate(prompts)]
        lens = [len(r) for r in rows]
        bucket = next(b for b in self.buckets if b >= B)
        C = self.prefill_chunk
        n_chunks = -(-max(lens) // C)
        ids = torch.zeros(bucket, n_chunks * C, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = r
        ids = ids.to(self.device)
        lens_t = torch.zeros(bucket, dtype=torch.int32)
        lens_t[:B] = torch.tensor(lens, dtype=torch.int32)
        lens_t = lens_t.to(self.device)

        self.lengths.zero_()  # a new batch: position-addressed state needs no other reset
        self._bucket, self._host_lengths = bucket, lens
        self._decode_n_new = (torch.arange(bucket, device=self.device) < B).to(torch.int32)
        logits = None
        if self.spec is not None:  # the token after each prompt position feeds the MTP window
            next_ids = _chunked(torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1), C)
        ids = _chunked(ids, C)
        for j in range(n_chunks):
            n_new = (lens_t - j * C).clamp(0, C).to(torch.int32)
            chunk = ids[j]
            if self.spec is None:
                out = self._run("prefill", chunk, n_new)
            else:
                n_mtp = (lens_t - 1 - j * C).clamp(0, C).to(torch.int32)  # positions with a known next token
                nxt = next_ids[j]
                out = self._run("spec_prefill", chunk, nxt, n_new, n_mtp)
            logits = out if logits is None else torch.where((n_new > 0)[:, None], out, logits)
            self._stats["prefill_steps"] += 1
        if self.spec is not None:
            self.spec.start(logits.argmax(-1))
        return logits[:B]

    def _check_prompt(self, i: int, p) -> Tensor:
        """``prompts[i]`` -> a 1-D int64 CPU tensor, or a ValueError naming the problem."""
        try:
            row = torch.as_tensor(p if isinstance(p, Tensor) else list(p))
        except (TypeError, ValueError, RuntimeError):
            row = None
        if row is not None and row.shape == (0,):  # before the dtype check: torch.as_tensor([]) is float
            raise ValueError(f"prefill: prompts[{i}] is empty; every prompt needs >= 1 token")
        if row is None or row.dim() != 1 or row.is_floating_point() or row.is_complex() or row.dtype == torch.bool:
            raise ValueError(f"prefill: prompts[{i}] must be a list of int token ids (prompts is a list of "
                             f"such lists), got {type(p).__name__}")
        if len(row) > self.max_seq_len:
            raise ValueError(f"prefill: prompts[{i}] has {len(row)} tokens > max_seq_len {self.max_seq_len}")
        bad = ((row < 0) | (row >= self.config.vocab_size)).nonzero()
        if len(bad):
            raise ValueError(f"prefill: prompts[{i}] has token id {int(row[bad[0, 0]])} at index {int(bad[0, 0])} "
                             f"outside [0, vocab_size={self.config.vocab_size})")
        return row.to("cpu", torch.long)

    def decode(self, next_ids: Tensor) -> Tensor:
        """One token per request (``next_ids [B]``, B = the prefilled batch) -> ``[B, vocab]``."""
        B = len(self._host_lengths)
        if self.spec is not None:
            raise ValueError("decode: this Generator drafts with spec_steps > 0; use generate(), or a "
                             "Generator with spec_steps=0 for token-by-token decode")
        if B == 0:
            raise ValueError("decode: call prefill first")
        next_ids = torch.as_tensor(next_ids)
        if next_ids.is_floating_point() or next_ids.is_complex() or next_ids.dtype == torch.bool:
            raise ValueError(f"decode: next_ids must hold integer token ids, got dtype {next_ids.dtype}")
        if next_ids.shape != (B,):
            raise ValueError(f"decode: next_ids must have shape [{B}] (the prefilled batch), got {tuple(next_ids.shape)}")
        if next_ids.device.type == "cpu" and bool(((next_ids < 0) | (next_ids >= self.config.vocab_size)).any()):
            raise ValueError(f"decode: next_ids has a token id outside [0, vocab_size={self.config.vocab_size})")
        if max(self._host_lengths) + 1 > self.max_seq_len:
            raise ValueError(f"decode: a request would exceed max_seq_len {self.max_seq_len}")
        return self._decode(next_ids.to(self.device, torch.long))[:B]

    def _decode(self, next_ids: Tensor) -> Tensor:
        B, bucket = len(self._host_lengths), self._bucket
        ids = next_ids[:B].contiguous() if B == bucket else torch.nn.functional.pad(next_ids[:B], (0, bucket - B))
        out = self._run("decode", ids, self._decode_n_new)  # one token per real row, 0 for padding
        self._host_lengths = [n + 1 for n in self._host_lengths]
        self._stats["decode_steps"] += 1
        return out

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32) -> list[list[int]]:
        """Greedy decoding: the ``max_new_tokens`` new tokens of every prompt."""
        if max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
        longest = max((len(p) for p in prompts), default=0)
        if longest + max_new_tokens - 1 > self.max_seq_len:
            raise ValueError(f"generate: longest prompt ({longest}) + max_new_tokens ({max_new_tokens}) - 1 "
                             f"> max_seq_len {self.max_seq_len}")
        logits = self.prefill(prompts)
        B = len(prompts)
        if self.spec is not None:
            return self._generate_spec(logits.argmax(-1), max_new_tokens)
        tokens = [logits.argmax(-1)]
        t0, compile_before = time.perf_counter(), self._stats["compile_time_s"]
        for _ in range(max_new_tokens - 1):
            tokens.append(self._decode(tokens[-1])[:B].argmax(-1))
        out = torch.stack(tokens, dim=1).tolist()  # the one host sync of the whole loop
        # throughput excludes time spent compiling inside the loop
        self._stats["decode_time_s"] += time.perf_counter() - t0 - (self._stats["compile_time_s"] - compile_before)
        self._stats["decode_tokens"] += B * (max_new_tokens - 1)
        self._stats["tokens_generated"] += B * max_new_tokens
        return out

    def _generate_spec(self, first: Tensor, max_new_tokens: int) -> list[list[int]]:
        """Speculative steps until every row has ``max_new_tokens``; finished rows sit out
        (their ``active`` flag is 0, so they write nothing and do not advance)."""
        B, bucket, k = first.shape[0], self._bucket, self.spec_steps
        out = [[t] for t in first.tolist()]
        t0, compile_before = time.perf_counter(), self._stats["compile_time_s"]
        while True:
            active = [int(len(o) < max_new_tokens) for o in out] + [0] * (bucket - B)
            if not any(active):
                break
            tokens, counts = self._run("spec", torch.tensor(active, dtype=torch.int32, device=self.device))
            tokens, counts = tokens.tolist(), counts.tolist()  # one small sync per step
            self.spec_history.append(counts[:B])
            for b in range(B):
                out[b] += tokens[b][: counts[b]]
                self._host_lengths[b] += counts[b]
            n_act = sum(active)
            self._stats["spec_steps_run"] += 1
            self._stats["decode_steps"] += 1
            self._stats["accepted_tokens"] += sum(counts) - n_act  # the bonus token is not a draft
            self._stats["drafted_tokens"] += k * n_act
        self._stats["decode_time_s"] += time.perf_counter() - t0 - (self._stats["compile_time_s"] - compile_before)
        self._stats["decode_tokens"] += sum(len(o) - 1 for o in out)
        self._stats["tokens_generated"] += sum(min(len(o), max_new_tokens) for o in out)
        return [o[:max_new_tokens] for o in out]

    @property
    def stats(self) -> dict:
        """graph_breaks, recompiles, cuda_graph_replays, compile_time_s, decode_tokens_per_s,
        and for spec_steps > 0: accepted_tokens (drafts accepted), acceptance_rate (accepted /
        drafted), tokens_per_step (tokens emitted per request per speculative step)."""
        s = dict(self._stats)
        s["decode_tokens_per_s"] = s["decode_tokens"] / s["decode_time_s"] if s["decode_time_s"] else 0.0
        s["acceptance_rate"] = s["accepted_tokens"] / s["drafted_tokens"] if s["drafted_tokens"] else 0.0
        k = self.spec_steps
        s["tokens_per_step"] = (1 + k * s["acceptance_rate"]) if s["drafted_tokens"] else 1.0
        return s


def _chunked(ids: Tensor, C: int) -> Tensor:
    """``[bucket, n * C]`` -> ``[n, bucket, C]`` contiguous, so every chunk ``[bucket, C]`` has
    strides ``(C, 1)`` whatever the prompt length. Dynamo guards on strides: a slice of the long
    tensor has strides that depend on the prompt length, and ``.contiguous()`` leaves such a
    tensor as it is when the bucket is 1 (a size-1 dim is contiguous with any stride), so bucket 1
    recompiled for every new prompt length (seen on the H200: 315 prefill tokens/s). A clone in
    ``contiguous_format`` always gets the standard strides."""
    return ids.view(ids.shape[0], -1, C).transpose(0, 1).clone(memory_format=torch.contiguous_format)


class _BucketView:
    """The first ``bucket`` rows of every cache buffer (views: writes land in the pool)."""

    def __init__(self, cache: StaticCache, bucket: int) -> None:
        self.rings, self.mtp_rings = cache.rings, cache.mtp_rings
        self.states = [self._rows(st, bucket) for st in cache.states]
        self.mtp_states = [self._rows(st, bucket) for st in cache.mtp_states]

    @staticmethod
    def _rows(st, bucket: int):
        rows = {f.name: getattr(st, f.name)[:bucket] for f in dataclasses.fields(st) if getattr(st, f.name) is not None}
        for t in rows.values():
            torch._dynamo.mark_static_address(t)
        return dataclasses.replace(st, **rows)
