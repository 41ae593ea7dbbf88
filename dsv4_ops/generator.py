"""Generator: ragged-batch prefill, decode and greedy generate — a thin loop over the model.

The model owns the KV pool (``model.setup_caches``); the generator owns each row's length (a
device tensor) and calls the model's cached step, ``torch.compile(model, fullgraph=True)``
when ``compile=True`` (on CUDA replayed as CUDA graphs, Inductor's cudagraph trees). Shapes are
frozen per batch bucket (1, 2, 4, ... max_batch_size): prefill runs chunks of
``prefill_chunk`` tokens, decode one token per row, so new prompts of any length reuse the
compiled graphs. Speculative decoding (``spec_steps > 0``) compiles its own step
(``speculative.py``) the same way.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch
from torch import Tensor

from .speculative import SpecDecoding

__all__ = ["Generator"]


def _buckets(max_batch_size: int) -> list[int]:
    out, b = [], 1
    while b < max_batch_size:
        out.append(b)
        b *= 2
    return out + [max_batch_size]


def _check_int(name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _compile(fn, cuda_graphs: bool):
    return torch.compile(fn, fullgraph=True, dynamic=False, mode="reduce-overhead" if cuda_graphs else None)


def check_prompts(prompts, max_batch_size: int, max_seq_len: int, vocab_size: int, where: str = "prefill"
                  ) -> list[Tensor]:
    """``prompts`` (ragged token-id lists) -> 1-D int64 CPU tensors, or a ValueError naming the
    problem (shared by ``Generator`` and ``AOTIGenerator``)."""
    if isinstance(prompts, Tensor) and prompts.dim() == 2:
        prompts = list(prompts)
    if not isinstance(prompts, (list, tuple)) and not isinstance(prompts, Tensor):
        raise ValueError(f"{where}: prompts must be a list of token-id lists, got {type(prompts).__name__}")
    if len(prompts) and all(isinstance(p, int) for p in prompts):
        raise ValueError(f"{where}: prompts must be a list of token-id lists, got a flat list of ints; "
                         "for one prompt pass a list holding it: [prompt]")
    B = len(prompts)
    if B == 0:
        raise ValueError(f"{where}: prompts is empty; pass at least one prompt")
    if B > max_batch_size:
        raise ValueError(f"{where}: {B} prompts > max_batch_size {max_batch_size}")
    rows = []
    for i, p in enumerate(prompts):
        try:
            row = torch.as_tensor(p if isinstance(p, Tensor) else list(p))
        except (TypeError, ValueError, RuntimeError):
            row = None
        if row is not None and row.shape == (0,):  # before the dtype check: torch.as_tensor([]) is float
            raise ValueError(f"{where}: prompts[{i}] is empty; every prompt needs >= 1 token")
        if row is None or row.dim() != 1 or row.is_floating_point() or row.is_complex() or row.dtype == torch.bool:
            raise ValueError(f"{where}: prompts[{i}] must be a list of int token ids (prompts is a list of "
                             f"such lists), got {type(p).__name__}")
        if len(row) > max_seq_len:
            raise ValueError(f"{where}: prompts[{i}] has {len(row)} tokens > max_seq_len {max_seq_len}")
        bad = ((row < 0) | (row >= vocab_size)).nonzero()
        if len(bad):
            raise ValueError(f"{where}: prompts[{i}] has token id {int(row[bad[0, 0]])} at index {int(bad[0, 0])} "
                             f"outside [0, vocab_size={vocab_size})")
        rows.append(row.to("cpu", torch.long))
    return rows


def check_next_ids(next_ids, B: int, vocab_size: int) -> Tensor:
    """``decode``'s argument -> a 1-D integer tensor of B ids in ``[0, vocab)`` (reads the values:
    one host sync for a device tensor; an out-of-range id would otherwise index out of bounds)."""
    next_ids = torch.as_tensor(next_ids)
    if next_ids.is_floating_point() or next_ids.is_complex() or next_ids.dtype == torch.bool:
        raise ValueError(f"decode: next_ids must hold integer token ids, got dtype {next_ids.dtype}")
    if next_ids.shape != (B,):
        raise ValueError(f"decode: next_ids must have shape [{B}] (the prefilled batch), got {tuple(next_ids.shape)}")
    bad = (next_ids < 0) | (next_ids >= vocab_size)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"decode: next_ids[{i}] = {int(next_ids[i])} is outside [0, vocab_size={vocab_size})")
    return next_ids


def pad_rows(ids: Tensor, rows: int) -> Tensor:
    """``[B]`` ids -> a fresh ``[rows, 1]`` int64 tensor (zeros past B) with standard strides:
    dynamo guards on strides, and a column view's stride would differ from step to step."""
    out = torch.zeros(rows, 1, dtype=torch.long, device=ids.device)
    out[: ids.shape[0], 0] = ids
    return out


def chunked(ids: Tensor, C: int) -> Tensor:
    """``[bucket, n * C]`` -> ``[n, bucket, C]`` contiguous, so every chunk ``[bucket, C]`` has
    strides ``(C, 1)`` whatever the prompt length (dynamo guards on strides; ``.contiguous()``
    would keep a size-1 bucket's long row stride)."""
    return ids.view(ids.shape[0], -1, C).transpose(0, 1).clone(memory_format=torch.contiguous_format)


class Generator:
    """Greedy generation for a ``DeepseekV4ForCausalLM`` on the dsv4 ops.

    Args:
        model: a ``dsv4_ops.DeepseekV4ForCausalLM``. The generator sets up its KV pool
            (``model.setup_caches``); one generator per model at a time (a generator with other
            limits re-allocates the pool, and the earlier one re-allocates it back on its next
            ``prefill``).
        max_batch_size: most prompts per ``prefill`` call.
        max_seq_len: most tokens (prompt + generated) per request.
        spec_steps: MTP draft tokens per step (0 = plain decode).
        compile: ``torch.compile(fullgraph=True)`` the model's step (a bool).
        cuda_graphs: replay the compiled steps as CUDA graphs (None = on when compiling a CUDA model).
        prefill_chunk: tokens per prefill step (long prompts run in several steps).

    >>> gen = Generator(DeepseekV4ForCausalLM(DSV4Config.tiny()), max_batch_size=2, max_seq_len=64, compile=False)
    >>> [len(t) for t in gen.generate([[1, 2, 3], [4]], max_new_tokens=5)]
    [5, 5]
    """

    def __init__(self, model, max_batch_size: int = 4, max_seq_len: int = 4096, spec_steps: int = 0,
                 compile: bool = True, cuda_graphs: bool | None = None, prefill_chunk: int = 64,
                 _draft: str = "mtp") -> None:
        _check_int("spec_steps", spec_steps, 0)
        _check_int("max_batch_size", max_batch_size, 1)
        _check_int("max_seq_len", max_seq_len, 1)
        _check_int("prefill_chunk", prefill_chunk, 1)
        if not isinstance(compile, bool):
            raise ValueError(f"compile must be True or False, got {compile!r}")
        if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be True, False or None (auto), got {cuda_graphs!r}")
        self.model = model.eval()
        self.config = model.config
        self.device = model.device
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.prefill_chunk = prefill_chunk
        self.spec_steps = spec_steps
        # a speculative step may write up to spec_steps + 1 positions past a request's last
        # accepted token (rejected drafts), so the pool has that much slack past max_seq_len
        capacity = max_seq_len + 2 * (spec_steps + 1) if spec_steps else max_seq_len
        self._cache_args = dict(max_batch_size=max_batch_size, max_seq_len=capacity, lookahead=spec_steps,
                                mtp=spec_steps > 0 and len(model.mtp) > 0)
        model.setup_caches(**self._cache_args)
        # auto: CUDA graphs whenever the steps are compiled for a CUDA model
        self.cuda_graphs = (self.device.type == "cuda" and compile) if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and not compile:
            raise ValueError("cuda_graphs=True needs compile=True (graphs are captured by Inductor)")
        self.compiled = compile
        self.buckets = _buckets(max_batch_size)
        if compile:
            # every (step kind, bucket) is its own graph of the same code (the model's forward), and
            # dynamo falls back to eager past `recompile_limit` graphs per code object (default 8)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # device-side state: a row's only mutable scalar is its length; one static view per bucket
        self.lengths = torch.zeros(max_batch_size, dtype=torch.int32, device=self.device)
        self._lengths = {b: self.lengths[:b] for b in self.buckets}
        for t in [self.lengths, *self._lengths.values()]:
            torch._dynamo.mark_static_address(t)
        self._host_lengths: list[int] = []  # mirror for boundary checks (no device sync)
        self._bucket = 0
        self._forward = _compile(model, self.cuda_graphs) if compile else model
        self._steps: dict[str, object] = {}
        self._graphs: dict[tuple[str, int], int] = {}  # graphs compiled per (step kind, bucket)
        self.spec = SpecDecoding(self, spec_steps, _draft) if spec_steps else None
        self.spec_history: list[list[int]] = []  # tokens emitted per row, per speculative step
        self._stats = dict(prefill_steps=0, decode_steps=0, compile_time_s=0.0, recompiles=0, graph_breaks=0,
                           cuda_graph_replays=0, tokens_generated=0, decode_tokens=0, decode_time_s=0.0,
                           spec_steps_run=0, accepted_tokens=0, drafted_tokens=0)

    # ------------------------------------------------------------------ running a step
    def _spec_fn(self, kind: str):
        if kind not in self._steps:
            fn = {"spec_prefill": self.spec.prefill_step, "spec": self.spec.spec_step}[kind]
            self._steps[kind] = _compile(fn, self.cuda_graphs) if self.compiled else fn
        return self._steps[kind]

    def _run(self, kind: str, bucket: int, fn, *args, **kwargs):
        counters = torch._dynamo.utils.counters
        graphs_before = counters["stats"]["unique_graphs"]
        breaks_before = sum(counters["graph_break"].values())
        t0 = time.perf_counter()
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            out = fn(*args, **kwargs)
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

    def _step(self, kind: str, ids: Tensor, n_new: Tensor) -> Tensor:
        """One cached model step over ``ids [bucket, S]``; advances the lengths."""
        bucket = ids.shape[0]
        lengths = self._lengths[bucket]
        logits = self._run(kind, bucket, self._forward, ids, lengths, n_new, last_only=True)
        lengths.add_(n_new)
        return logits

    # ------------------------------------------------------------------ public API
    def prefill(self, prompts: Sequence[Sequence[int]]) -> Tensor:
        """Start a new batch: ``prompts`` (ragged token-id lists) -> ``[B, vocab]`` fp32
        logits at each prompt's last position. Long prompts run in chunks."""
        rows = check_prompts(prompts, self.max_batch_size, self.max_seq_len, self.config.vocab_size)
        self.model.setup_caches(**self._cache_args)  # a no-op unless another generator changed the pool
        B, lens = len(rows), [len(r) for r in rows]
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
            next_ids = chunked(torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1), C)
        ids = chunked(ids, C)
        for j in range(n_chunks):
            n_new = (lens_t - j * C).clamp(0, C).to(torch.int32)
            if self.spec is None:
                out = self._step("prefill", ids[j], n_new)
            else:
                n_mtp = (lens_t - 1 - j * C).clamp(0, C).to(torch.int32)  # positions with a known next token
                out = self._run("spec_prefill", bucket, self._spec_fn("spec_prefill"), ids[j], next_ids[j], n_new,
                                n_mtp)
            logits = out if logits is None else torch.where((n_new > 0)[:, None], out, logits)
            self._stats["prefill_steps"] += 1
        if self.spec is not None:
            self.spec.start(logits.argmax(-1))
        self._stats["tokens_generated"] += B
        return logits[:B]

    def decode(self, next_ids: Tensor) -> Tensor:
        """One token per request (``next_ids [B]``, B = the prefilled batch) -> ``[B, vocab]``.
        Checks the ids' values (one host sync on GPU) and times the step (``stats``)."""
        B = len(self._host_lengths)
        if self.spec is not None:
            raise ValueError("decode: this Generator drafts with spec_steps > 0; use generate(), or a "
                             "Generator with spec_steps=0 for token-by-token decode")
        if B == 0:
            raise ValueError("decode: call prefill first")
        next_ids = check_next_ids(next_ids, B, self.config.vocab_size)
        if max(self._host_lengths) + 1 > self.max_seq_len:
            raise ValueError(f"decode: a request would exceed max_seq_len {self.max_seq_len}")
        t0, compile_before = time.perf_counter(), self._stats["compile_time_s"]
        out = self._decode(next_ids.to(self.device, torch.long))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self._count_decode(time.perf_counter() - t0 - (self._stats["compile_time_s"] - compile_before), B)
        return out

    def _decode(self, next_ids: Tensor) -> Tensor:
        B, bucket = len(self._host_lengths), self._bucket
        out = self._step("decode", pad_rows(next_ids[:B], bucket), self._decode_n_new)  # 0 new tokens for padding
        self._host_lengths = [n + 1 for n in self._host_lengths]
        self._stats["decode_steps"] += 1
        return out[:B]

    def _count_decode(self, seconds: float, tokens: int) -> None:
        self._stats["decode_time_s"] += seconds
        self._stats["decode_tokens"] += tokens
        self._stats["tokens_generated"] += tokens

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32) -> list[list[int]]:
        """Greedy decoding: the ``max_new_tokens`` new tokens of every prompt."""
        _check_int("generate: max_new_tokens", max_new_tokens, 1)
        rows = check_prompts(prompts, self.max_batch_size, self.max_seq_len, self.config.vocab_size, "generate")
        longest = max(len(r) for r in rows)
        if longest + max_new_tokens - 1 > self.max_seq_len:
            raise ValueError(f"generate: longest prompt ({longest}) + max_new_tokens ({max_new_tokens}) - 1 "
                             f"> max_seq_len {self.max_seq_len}")
        logits = self.prefill(rows)
        B = len(rows)
        if self.spec is not None:
            return self._generate_spec(logits.argmax(-1), max_new_tokens)
        tokens = [logits.argmax(-1)]
        t0, compile_before = time.perf_counter(), self._stats["compile_time_s"]
        for _ in range(max_new_tokens - 1):
            tokens.append(self._decode(tokens[-1]).argmax(-1))
        out = torch.stack(tokens, dim=1).tolist()  # the one host sync of the whole loop
        # throughput excludes time spent compiling inside the loop
        self._count_decode(time.perf_counter() - t0 - (self._stats["compile_time_s"] - compile_before),
                           B * (max_new_tokens - 1))
        return out

    def _generate_spec(self, first: Tensor, max_new_tokens: int) -> list[list[int]]:
        """Speculative steps until every row has ``max_new_tokens``; finished rows sit out
        (their ``active`` flag is 0, so they write nothing and do not advance)."""
        B, bucket, k = first.shape[0], self._bucket, self.spec_steps
        out = [[t] for t in first.tolist()]
        t0, compile_before = time.perf_counter(), self._stats["compile_time_s"]
        step = self._spec_fn("spec")
        while True:
            active = [int(len(o) < max_new_tokens) for o in out] + [0] * (bucket - B)
            if not any(active):
                break
            tokens, counts = self._run("spec", bucket, step, torch.tensor(active, dtype=torch.int32,
                                                                          device=self.device))
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
        emitted = sum(min(len(o), max_new_tokens) - 1 for o in out)
        self._count_decode(time.perf_counter() - t0 - (self._stats["compile_time_s"] - compile_before), emitted)
        return [o[:max_new_tokens] for o in out]

    @property
    def stats(self) -> dict:
        """prefill_steps, decode_steps, tokens_generated (tokens whose logits were returned:
        ``B`` per prefill and per decode), decode_tokens, decode_time_s, decode_tokens_per_s,
        graph_breaks, recompiles, cuda_graph_replays, compile_time_s, and for spec_steps > 0:
        accepted_tokens (drafts accepted), acceptance_rate (accepted / drafted), tokens_per_step
        (tokens emitted per request per speculative step)."""
        s = dict(self._stats)
        s["decode_tokens_per_s"] = s["decode_tokens"] / s["decode_time_s"] if s["decode_time_s"] else 0.0
        s["acceptance_rate"] = s["accepted_tokens"] / s["drafted_tokens"] if s["drafted_tokens"] else 0.0
        k = self.spec_steps
        s["tokens_per_step"] = (1 + k * s["acceptance_rate"]) if s["drafted_tokens"] else 1.0
        return s
