"""What ``Generator`` (compiled model) and ``AOTIGenerator`` (exported package) share: the
boundary checks, the ragged batch laid out in prefill chunks, the greedy and speculative loops
over their own step calls, and the stats. Each subclass supplies the steps:

    _prefill_chunk(j, batch) -> logits [bucket, vocab]   # chunk j of a prepared batch
    _decode_step(ids [B]) -> logits [B, vocab]          # one token per row (trusted ids)
    _spec_step(active [bucket] int32) -> (tokens [bucket, k+1], counts [bucket])
    _start_drafts(first [B])                            # speculative state after prefill
"""
from __future__ import annotations

import time
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from .ops._validate import check_int

__all__ = ["GenerationLoop", "PreparedBatch", "check_prompts", "check_next_ids", "pad_rows", "chunked",
           "check_int"]


def check_prompts(prompts, max_batch_size: int, max_seq_len: int, vocab_size: int, where: str = "prefill"
                  ) -> list[Tensor]:
    """``prompts`` (ragged token-id lists) -> 1-D int64 CPU tensors, or a ValueError naming the problem."""
    if isinstance(prompts, Tensor) and prompts.dim() == 2:
        prompts = list(prompts)
    if not isinstance(prompts, (list, tuple)):
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


class PreparedBatch(NamedTuple):
    """A ragged batch laid out for prefill: chunk ``j`` is ``ids[j]`` with ``n_new(j)`` real tokens per row."""

    B: int
    bucket: int
    lengths: list[int]  # prompt lengths
    ids: Tensor  # [n_chunks, bucket, C] on the device
    next_ids: Tensor | None  # the same layout, shifted by one token (speculative prefill's MTP inputs)
    lens: Tensor  # [bucket] int32 on the device, 0 for padding rows
    C: int

    @property
    def n_chunks(self) -> int:
        return self.ids.shape[0]

    def n_new(self, j: int) -> Tensor:
        return (self.lens - j * self.C).clamp(0, self.C).to(torch.int32)

    def n_mtp(self, j: int) -> Tensor:
        """Tokens of chunk ``j`` whose NEXT token is known (not a prompt's last)."""
        return (self.lens - 1 - j * self.C).clamp(0, self.C).to(torch.int32)


class GenerationLoop:
    """The shared loop; subclasses set ``max_batch_size``, ``max_seq_len``, ``prefill_chunk``,
    ``vocab_size``, ``spec_steps``, ``speculative``, ``device`` and implement the steps."""

    speculative: bool = False

    def _init_loop(self) -> None:
        self._host_lengths: list[int] = []  # mirror for boundary checks (no device sync)
        self.spec_history: list[list[int]] = []  # tokens emitted per row, per speculative step
        self._stats = dict(prefill_steps=0, decode_steps=0, compile_time_s=0.0, recompiles=0, graph_breaks=0,
                           cuda_graph_replays=0, tokens_generated=0, decode_tokens=0, decode_time_s=0.0,
                           spec_steps_run=0, accepted_tokens=0, drafted_tokens=0)

    # ------------------------------------------------------------------ prefill
    def _prepare(self, prompts, bucket: int, rows: list[Tensor] | None = None) -> PreparedBatch:
        rows = rows if rows is not None else check_prompts(prompts, self.max_batch_size, self.max_seq_len,
                                                           self.vocab_size)
        B, lens, C = len(rows), [len(r) for r in rows], self.prefill_chunk
        n_chunks = -(-max(lens) // C)
        ids = torch.zeros(bucket, n_chunks * C, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = r
        lens_t = torch.zeros(bucket, dtype=torch.int32)
        lens_t[:B] = torch.tensor(lens, dtype=torch.int32)
        next_ids = None
        if self.speculative:  # the token after each prompt position feeds the MTP window
            next_ids = chunked(torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1), C).to(self.device)
        return PreparedBatch(B, bucket, lens, chunked(ids, C).to(self.device), next_ids, lens_t.to(self.device), C)

    def _prefill_batch(self, batch: PreparedBatch) -> Tensor:
        """Run every chunk; each row's logits come from the last chunk it had tokens in."""
        self._host_lengths = list(batch.lengths)
        logits = None
        for j in range(batch.n_chunks):
            out = self._prefill_chunk(j, batch)
            logits = out if logits is None else torch.where((batch.n_new(j) > 0)[:, None], out, logits)
            self._stats["prefill_steps"] += 1
        if self.speculative:
            self._start_drafts(logits.argmax(-1))
        self._stats["tokens_generated"] += batch.B
        return logits[: batch.B]

    # ------------------------------------------------------------------ decode
    def decode(self, next_ids) -> Tensor:
        """One token per request (``next_ids [B]``, B = the prefilled batch) -> ``[B, vocab]``.
        Checks the ids' values (one host sync on GPU) and times the step (``stats``)."""
        B = len(self._host_lengths)
        if self.speculative:
            raise ValueError(f"decode: this {type(self).__name__} drafts with spec_steps > 0; use generate(), or "
                             "one without speculative decoding for token-by-token decode")
        if B == 0:
            raise ValueError("decode: call prefill first")
        next_ids = check_next_ids(next_ids, B, self.vocab_size)
        if max(self._host_lengths) + 1 > self.max_seq_len:
            raise ValueError(f"decode: a request would exceed max_seq_len {self.max_seq_len}")
        t0, compile_before = time.perf_counter(), self._stats["compile_time_s"]
        out = self._decode(next_ids.to(self.device, torch.long))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._count_decode(time.perf_counter() - t0 - (self._stats["compile_time_s"] - compile_before), B)
        return out

    def _decode(self, next_ids: Tensor) -> Tensor:
        out = self._decode_step(next_ids)
        self._host_lengths = [n + 1 for n in self._host_lengths]
        self._stats["decode_steps"] += 1
        return out

    def _count_decode(self, seconds: float, tokens: int) -> None:
        self._stats["decode_time_s"] += seconds
        self._stats["decode_tokens"] += tokens
        self._stats["tokens_generated"] += tokens

    # ------------------------------------------------------------------ generate
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32) -> list[list[int]]:
        """Greedy decoding: the ``max_new_tokens`` new tokens of every prompt (with speculative
        decoding when ``spec_steps > 0``: the same tokens, fewer steps)."""
        check_int("generate: max_new_tokens", max_new_tokens, 1)
        rows = check_prompts(prompts, self.max_batch_size, self.max_seq_len, self.vocab_size, "generate")
        longest = max(len(r) for r in rows)
        if longest + max_new_tokens - 1 > self.max_seq_len:
            raise ValueError(f"generate: longest prompt ({longest}) + max_new_tokens ({max_new_tokens}) - 1 "
                             f"> max_seq_len {self.max_seq_len}")
        first = self.prefill(rows).argmax(-1)
        t0, compile_before = time.perf_counter(), self._stats["compile_time_s"]
        if self.speculative:
            out = self._generate_spec(first, max_new_tokens)
            emitted = sum(len(o) - 1 for o in out)
        else:
            tokens = [first]
            for _ in range(max_new_tokens - 1):
                tokens.append(self._decode(tokens[-1]).argmax(-1))
            out = torch.stack(tokens, dim=1).tolist()  # the one host sync of the whole loop
            emitted = len(rows) * (max_new_tokens - 1)
        # throughput excludes time spent compiling inside the loop
        self._count_decode(time.perf_counter() - t0 - (self._stats["compile_time_s"] - compile_before), emitted)
        return out

    def _generate_spec(self, first: Tensor, max_new_tokens: int) -> list[list[int]]:
        """Speculative steps until every row has ``max_new_tokens``; finished rows sit out
        (their ``active`` flag is 0, so they write nothing and do not advance)."""
        B, k = first.shape[0], self.spec_steps
        out = [[t] for t in first.tolist()]
        while True:
            active = [int(len(o) < max_new_tokens) for o in out] + [0] * (self._bucket - B)
            if not any(active):
                break
            tokens, counts = self._spec_step(torch.tensor(active, dtype=torch.int32, device=self.device))
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
