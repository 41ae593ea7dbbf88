"""What ``Generator`` (compiled model) and ``AOTIGenerator`` (exported package) share: the
boundary checks, the ragged batch laid out in prefill chunks (one fixed chunk, or the smallest of a
few chunk sizes that holds what is left: ``chunk_schedule``), the decode and speculative loops
(greedy or sampled, with per-request stop ids and lengths) over their own step calls, and the
stats. Each subclass supplies the steps:

    _prefill_chunk(j, batch) -> logits [bucket, vocab]   # chunk j ([bucket, batch.chunks[j]]) of a prepared batch
    _decode_step(ids [B], n_new) -> logits [B, vocab]   # one token per row (trusted ids); n_new [bucket]
                                                        # int32 (None = every request takes one)
    _step_chunks(bucket) -> list[int]                  # the chunk sizes a prefill step of `bucket` rows may take
    _spec_step(active [bucket] int32, params, filtered) -> (tokens [bucket, k+1], counts [bucket])
                                                        # params: SamplingParams or None (greedy)
    _start_drafts(first [B], sampling=False)            # speculative state after prefill
"""
from __future__ import annotations

import time
from typing import Iterator, NamedTuple, Sequence

import torch
from torch import Tensor

from . import sampling
from .generate_args import GenerateArgs, parse_generate_args
from .host_transfer import start_read, to_device
from .ops.validate import check_int
from .sampling import SamplingParams

__all__ = ["GenerationLoop", "PreparedBatch", "check_prompts", "check_next_ids", "pad_rows", "chunked",
           "check_int", "chunk_buckets", "chunks_within", "chunk_schedule"]


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


def check_next_ids(next_ids, B: int) -> Tensor:
    """``decode``'s argument -> a 1-D integer tensor of B ids (dtype and shape; the values are
    checked by ``decode`` while its step runs)."""
    next_ids = torch.as_tensor(next_ids)
    if next_ids.is_floating_point() or next_ids.is_complex() or next_ids.dtype == torch.bool:
        raise ValueError(f"decode: next_ids must hold integer token ids, got dtype {next_ids.dtype}")
    if next_ids.shape != (B,):
        raise ValueError(f"decode: next_ids must have shape [{B}] (the prefilled batch), got {tuple(next_ids.shape)}")
    return next_ids


def pad_rows(ids: Tensor, rows: int) -> Tensor:
    """``[B]`` ids -> a ``[rows, 1]`` int64 tensor (zeros past B) with standard strides: dynamo
    guards on strides, and a column view's stride would differ from step to step. A full
    contiguous int64 batch is viewed as it is (two launches and an allocation less per decode
    call; the compiled step copies its inputs into the CUDA graph's buffers anyway)."""
    # stride (1,), not is_contiguous(): a [1] column is contiguous whatever its stride, which dynamo guards on
    if ids.shape[0] == rows and ids.dtype == torch.long and ids.stride() == (1,):
        return ids.view(rows, 1)
    out = torch.zeros(rows, 1, dtype=torch.long, device=ids.device)
    out[: ids.shape[0], 0] = ids
    return out


def chunked(ids: Tensor, chunks: Sequence[int], device: torch.device) -> list[Tensor]:
    """``[bucket, sum(chunks)]`` -> one contiguous ``[bucket, chunks[j]]`` tensor per step on ``device``
    (views of one buffer, copied once), so every chunk ``[bucket, C]`` has strides ``(C, 1)`` whatever
    the prompt length (dynamo guards on strides; a slice of the long id tensor would keep its row
    stride, and ``.contiguous()`` would keep a size-1 bucket's long row stride)."""
    rows = ids.shape[0]
    flat = torch.cat([part.reshape(-1) for part in ids.split(list(chunks), dim=1)]).to(device)
    out, at = [], 0
    for C in chunks:
        out.append(flat[at : at + rows * C].view(rows, C))
        at += rows * C
    return out


# ---- chunk buckets: the prefill chunk sizes a Generator with prefill_chunk=None compiles
# A short prompt is one short step; from about 1K tokens on a step reads nearly every expert's weights, so a longer
# chunk reads them fewer times a prompt (BENCHMARKS.md, "Prefill"). 4096 is the longest measured. Only a batch's last
# step pads, to less than 4x its rest.
CHUNK_BUCKETS = (64, 256, 1024, 2048, 4096)
DEFAULT_MAX_PREFILL_TOKENS = 8192  # batch buckets 1 and 2 take 4096-token chunks, 4 takes 2048, 8 1024


def chunk_buckets(max_seq_len: int) -> list[int]:
    """The chunk sizes (tokens per row per prefill step) compiled for ``prefill_chunk=None``:
    ``CHUNK_BUCKETS``, each capped at ``max_seq_len`` (a longer chunk would only pad):
    ``[64, 256, 1024, 2048, 4096]`` for ``max_seq_len >= 4096``, ``[64, 200]`` for 200, ``[48]`` for 48."""
    return sorted({min(C, max_seq_len) for C in CHUNK_BUCKETS})


def chunks_within(buckets: Sequence[int], max_prefill_tokens: int, rows: int) -> list[int]:
    """The chunk buckets a prefill step of ``rows`` rows (a batch bucket) may take: those with
    ``rows * chunk <= max_prefill_tokens``; when even the smallest is too large, the one chunk
    ``max_prefill_tokens // rows`` (at least one token a row)."""
    return [C for C in buckets if rows * C <= max_prefill_tokens] or [max(1, max_prefill_tokens // rows)]


def chunk_schedule(longest: int, chunks: Sequence[int]) -> list[int]:
    """The chunk of each prefill step of a batch whose longest prompt has ``longest`` tokens: the
    smallest of ``chunks`` that holds the longest remaining part of any row, capped at the largest
    (every row takes ``min(chunk, its remaining tokens)`` a step). With ``chunks = [64, 256, 1024,
    2048, 4096]``: 8192 -> ``[4096, 4096]``, 3000 -> ``[4096]``, 100 -> ``[256]``; one fixed chunk
    ``[C]`` gives ``ceil(longest / C)`` steps of ``C``."""
    top, left, out = max(chunks), longest, []
    while left > top:
        out.append(top)
        left -= top
    out.append(min(C for C in chunks if C >= left))
    return out


class PreparedBatch(NamedTuple):
    """A ragged batch laid out for prefill: step ``j`` is ``ids[j]`` (``[bucket, chunks[j]]``) with
    ``n_new(j)`` real tokens per row."""

    B: int
    bucket: int
    lengths: list[int]  # prompt lengths
    ids: list[Tensor]  # per step: [bucket, chunks[j]] on the device
    next_ids: list[Tensor] | None  # the same layout, shifted by one token (speculative prefill's MTP inputs)
    lens: Tensor  # [bucket] int32 on the device, 0 for padding rows
    chunks: tuple[int, ...]  # tokens per row of each step

    @property
    def n_chunks(self) -> int:
        return len(self.chunks)

    def start(self, j: int) -> int:
        """The prompt position step ``j`` starts at."""
        return sum(self.chunks[:j])

    def n_new(self, j: int) -> Tensor:
        return (self.lens - self.start(j)).clamp(0, self.chunks[j]).to(torch.int32)

    def n_mtp(self, j: int) -> Tensor:
        """Tokens of chunk ``j`` whose NEXT token is known (not a prompt's last)."""
        return (self.lens - 1 - self.start(j)).clamp(0, self.chunks[j]).to(torch.int32)


class GenerationLoop:
    """The shared loop; subclasses set ``max_batch_size``, ``max_seq_len``, ``prefill_chunk``,
    ``vocab_size``, ``spec_steps``, ``speculative``, ``device``, ``lengths`` (the rows' device-side
    lengths) and implement the steps."""

    speculative: bool = False

    def _init_loop(self) -> None:
        self._host_lengths: list[int] = []  # mirror for boundary checks (no device sync)
        self.spec_history: list[list[int]] = []  # tokens emitted per row, per speculative step
        self._stats = dict(prefill_steps=0, decode_steps=0, compile_time_s=0.0, recompiles=0, graph_breaks=0,
                           cuda_graph_replays=0, cuda_graph_recordings=0, tokens_generated=0, decode_tokens=0,
                           decode_time_s=0.0, spec_steps_run=0, accepted_tokens=0, drafted_tokens=0)

    # ------------------------------------------------------------------ prefill
    def _prepare(self, prompts, bucket: int, rows: list[Tensor] | None = None) -> PreparedBatch:
        rows = rows if rows is not None else check_prompts(prompts, self.max_batch_size, self.max_seq_len,
                                                           self.vocab_size)
        B, lens = len(rows), [len(r) for r in rows]
        chunks = chunk_schedule(max(lens), self._step_chunks(bucket))
        ids = torch.zeros(bucket, sum(chunks), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = r
        lens_t = torch.zeros(bucket, dtype=torch.int32)
        lens_t[:B] = torch.tensor(lens, dtype=torch.int32)
        next_ids = None
        if self.speculative:  # the token after each prompt position feeds the MTP window
            next_ids = chunked(torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1), chunks, self.device)
        return PreparedBatch(B, bucket, lens, chunked(ids, chunks, self.device), next_ids, lens_t.to(self.device),
                             tuple(chunks))

    def _prefill_batch(self, batch: PreparedBatch) -> Tensor:
        """Start a new batch (position-addressed state needs no reset but the lengths) and run every
        chunk; each row's logits come from the last chunk it had tokens in."""
        self.lengths.zero_()
        self._bucket = batch.bucket
        self._decode_mask = (torch.arange(batch.bucket, device=self.device) < batch.B).to(torch.int32)  # 1: a request
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

        Waits for the GPU only after launching its step, so that a loop of ``decode`` calls keeps the
        GPU busy: the ids' range is read back while the step runs, which ran on the ids clamped into
        the vocabulary and advanced no request unless every id was in it; a bad id then raises
        ``ValueError`` naming it, and the state is what it was. ``stats["decode_time_s"]`` counts the
        calls' wall time (in a loop, the step's period)."""
        B = len(self._host_lengths)
        if self.speculative:
            raise ValueError(f"decode: this {type(self).__name__} drafts with spec_steps > 0; use generate(), or "
                             "one without speculative decoding for token-by-token decode")
        if B == 0:
            raise ValueError("decode: call prefill first")
        next_ids = check_next_ids(next_ids, B)
        if max(self._host_lengths) + 1 > self.max_seq_len:
            raise ValueError(f"decode: a request would exceed max_seq_len {self.max_seq_len}")
        t0, compile_before = time.perf_counter(), self._stats["compile_time_s"]
        ids, V = to_device(next_ids.to(torch.long), self.device), self.vocab_size
        clamped = ids.clamp(0, V - 1)
        in_vocab = (clamped == ids).all()
        read = start_read(in_vocab)
        out = self._decode(clamped, self._decode_mask * in_vocab)  # every request advances, or none
        if not read():  # the step wrote nothing: undo the host's count of it
            self._host_lengths = [n - 1 for n in self._host_lengths]
            self._stats["decode_steps"] -= 1
            i = int(((next_ids < 0) | (next_ids >= V)).nonzero()[0, 0])
            raise ValueError(f"decode: next_ids[{i}] = {int(next_ids[i])} is outside [0, vocab_size={V})")
        self._count_decode(t0, compile_before, B)
        return out

    def _decode(self, next_ids: Tensor, n_new: Tensor | None = None) -> Tensor:
        """``n_new [bucket] int32``: 1 for rows that take a token this step (None = every request)."""
        out = self._decode_step(next_ids, n_new)
        self._host_lengths = [n + 1 for n in self._host_lengths]
        self._stats["decode_steps"] += 1
        return out

    def _count_decode(self, t0: float, compile_before: float, tokens: int) -> None:
        # throughput excludes the time spent compiling since t0
        self._stats["decode_time_s"] += time.perf_counter() - t0 - (self._stats["compile_time_s"] - compile_before)
        self._stats["decode_tokens"] += tokens
        self._stats["tokens_generated"] += tokens

    # ------------------------------------------------------------------ generate
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int] = 32, *,
                 temperature=None, top_k=None, top_p=None, seed=None, eos_token_id=None) -> list[list[int]]:
        """The new tokens of every prompt (``list[list[int]]``). Greedy by default; with speculative
        decoding (``spec_steps > 0``) the same tokens in fewer steps (sampled: the same distribution).

        Each keyword is one value for all prompts or a list with one per prompt:
        ``max_new_tokens`` (>= 1); ``temperature`` (0 or None = greedy); ``top_k`` (0 or None = off);
        ``top_p`` in (0, 1] (1 or None = off); ``seed`` (an int ``s`` seeds prompt ``i`` with ``s + i``;
        None = from torch's global generator); ``eos_token_id`` (an int or a list of stop ids for every
        row, or one list per prompt): a row stops after its first stop id, which is included in its
        output, and after it writes nothing more to the cache. Sampling is reproducible: the same
        seeds give the same tokens in eager, compiled and CUDA-graph runs (``sampling.py``).

        Syncs: greedy and sampled decoding read the tokens back once at the end; with stop ids the
        loop also reads a device-side "all rows done" flag every ``DONE_POLL_STEPS`` steps (and
        stops early when it is set). Speculative decoding reads each step's tokens."""
        rows, args = self._check_generate(prompts, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id,
                                          "generate")
        first, params, pos0 = self._begin(rows, args)
        t0, compile_before = time.perf_counter(), self._stats["compile_time_s"]
        if self.speculative:
            *_, out = self._spec_rounds(first, args, params)  # the last round's: every row's tokens
        else:
            out = self._generate_plain(first, args, params, pos0)
        self._count_decode(t0, compile_before, sum(len(o) - 1 for o in out))
        return out

    def stream(self, prompt: Sequence[int], max_new_tokens: int = 32, *, temperature=None, top_k=None, top_p=None,
               seed=None, eos_token_id=None) -> Iterator[list[int]]:
        """One prompt's new tokens as they are made: an iterator over each step's tokens (one per
        decode step; with ``spec_steps > 0`` the 1 to k+1 tokens a speculative step emits).
        Joined, they are ``generate([prompt], max_new_tokens, ...)[0]``, for greedy and seeded
        sampling alike. The keywords are ``generate``'s, for one prompt, and are checked now,
        before the first step runs.

        Syncs once per step, to hand the step's tokens over. Leaving the loop early (or closing
        the iterator) is fine: the next ``prefill`` or ``generate`` starts afresh."""
        rows, args = self._check_generate([prompt], max_new_tokens, temperature, top_k, top_p, seed, eos_token_id,
                                          "stream")
        return self._stream(rows, args)

    def _stream(self, rows: list[Tensor], args: GenerateArgs) -> Iterator[list[int]]:
        first, params, pos0 = self._begin(rows, args)
        t0, compile_before = time.perf_counter(), self._stats["compile_time_s"]
        n, stops = 0, args.eos[0]
        try:
            if self.speculative:
                for out in self._spec_rounds(first, args, params):
                    new, n = out[0][n:], len(out[0])
                    if new:
                        yield new
                return
            tok = first
            for t in range(args.max_new[0]):
                if t:
                    tok = self._pick(self._decode(tok), params, pos0 + t, args.filtered)
                token = tok.tolist()[0]  # the step's one sync
                n += 1
                yield [token]
                if token in stops:
                    return
        finally:
            self._count_decode(t0, compile_before, max(n - 1, 0))

    def _check_generate(self, prompts, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id,
                        where: str) -> tuple[list[Tensor], GenerateArgs]:
        rows = check_prompts(prompts, self.max_batch_size, self.max_seq_len, self.vocab_size, where)
        args = parse_generate_args(len(rows), self.vocab_size, max_new_tokens, temperature, top_k, top_p, seed,
                                   eos_token_id)
        for i, (r, n) in enumerate(zip(rows, args.max_new)):
            if len(r) + n - 1 > self.max_seq_len:
                raise ValueError(f"{where}: prompts[{i}] ({len(r)} tokens) + max_new_tokens ({n}) - 1 "
                                 f"> max_seq_len {self.max_seq_len}")
        self._check_generate_args(args)
        return rows, args

    def _begin(self, rows: list[Tensor], args: GenerateArgs) -> tuple[Tensor, SamplingParams | None, Tensor]:
        """Prefill the prompts and pick each row's first token -> ``(first [B], params, pos0 [bucket])``;
        ``pos0`` is the position of each row's first new token."""
        logits = self.prefill(rows)
        B, bucket = len(rows), self._bucket
        params = args.params(bucket, self.device) if args.sampling else None
        pos0 = torch.zeros(bucket, dtype=torch.long)
        pos0[:B] = torch.tensor([len(r) for r in rows])
        pos0 = pos0.to(self.device)
        return self._pick(logits, params, pos0, args.filtered), params, pos0

    def _check_generate_args(self, args: GenerateArgs) -> None:
        """A subclass hook: reject settings it cannot run."""

    def _pick(self, logits: Tensor, params: SamplingParams | None, pos: Tensor, filtered: bool) -> Tensor:
        """Each row's next token from ``[B, vocab]`` logits: the argmax when every row is greedy,
        otherwise ``sampling.sample`` over the whole bucket (static shapes)."""
        if params is None:
            return logits.argmax(-1)
        B, bucket = logits.shape[0], pos.shape[0]
        if B < bucket:
            logits = torch.cat([logits, logits.new_zeros(bucket - B, logits.shape[1])])
        return self._sample(logits, params, pos, filtered)[:B]

    def _sample(self, logits: Tensor, params: SamplingParams, pos: Tensor, filtered: bool) -> Tensor:
        return sampling.sample(logits, params, pos, filtered)  # eager; Generator compiles it

    def _generate_plain(self, first: Tensor, args: GenerateArgs, params: SamplingParams | None,
                        pos0: Tensor) -> list[list[int]]:
        """One decode step per token. When rows can stop at different times, a device-side
        ``done`` flag per row turns a finished row's ``n_new`` to 0 (it writes nothing and its
        length stops); its later tokens are cut on the host after the one sync at the end."""
        B, bucket = first.shape[0], self._bucket
        prompt_lens = list(self._host_lengths)
        tokens, n_new, done = [first], None, None
        if args.stops_early:
            eos = args.eos_table(B, self.device)
            last = torch.tensor(args.max_new, device=self.device) - 1  # index of each row's last token
            done = _stopped(first, 0, eos, last)
        poll = any(args.eos)
        for t in range(1, max(args.max_new)):
            if done is not None:
                n_new = torch.zeros(bucket, dtype=torch.int32, device=self.device)
                n_new[:B] = (~done).to(torch.int32)
            tok = self._pick(self._decode(tokens[-1], n_new), params, pos0 + t, args.filtered)
            tokens.append(tok)
            if done is not None:
                done = done | _stopped(tok, t, eos, last)
                if poll and t % DONE_POLL_STEPS == 0 and bool(done.all()):  # the only sync inside the loop
                    break
        out = [_cut(row, n, stops) for row, n, stops in
               zip(torch.stack(tokens, dim=1).tolist(), args.max_new, args.eos)]  # the one sync at the end
        if done is not None:  # rows stopped early processed fewer tokens than the decode count
            self._host_lengths = [p + len(o) - 1 for p, o in zip(prompt_lens, out)]
        return out

    def _spec_rounds(self, first: Tensor, args: GenerateArgs, params: SamplingParams | None
                     ) -> Iterator[list[list[int]]]:
        """Speculative steps until every row has its tokens, yielding every row's tokens so far: after
        the first token, then after each step. Finished rows sit out (their ``active`` flag is 0, so
        they write nothing and do not advance)."""
        B, k = first.shape[0], self.spec_steps
        if params is not None:
            self._start_drafts(first, sampling=True)  # prefill started them from the argmax
        out = [_cut([t], n, stops) for t, n, stops in zip(first.tolist(), args.max_new, args.eos)]
        finished = [len(o) >= n or o[-1] in stops for o, n, stops in zip(out, args.max_new, args.eos)]
        self._spec_history_start = len(self.spec_history)
        yield out
        while True:
            active = [int(not f) for f in finished] + [0] * (self._bucket - B)
            if not any(active):
                break
            tokens, counts = self._spec_step(torch.tensor(active, dtype=torch.int32, device=self.device), params,
                                             args.filtered)
            tokens, counts = tokens.tolist(), counts.tolist()  # one small sync per step
            self.spec_history.append(counts[:B])
            for b in range(B):
                if counts[b]:
                    out[b] = _cut(out[b] + tokens[b][: counts[b]], args.max_new[b], args.eos[b])
                    finished[b] = len(out[b]) >= args.max_new[b] or out[b][-1] in args.eos[b]
                self._host_lengths[b] += counts[b]
            n_act = sum(active)
            self._stats["spec_steps_run"] += 1
            self._stats["decode_steps"] += 1
            self._stats["accepted_tokens"] += sum(counts) - n_act  # the bonus token is not a draft
            self._stats["drafted_tokens"] += k * n_act
            yield out

    @property
    def stats(self) -> dict:
        """prefill_steps, decode_steps, tokens_generated (tokens whose logits were returned:
        ``B`` per prefill and per decode), decode_tokens, decode_time_s, decode_tokens_per_s,
        graph_breaks, recompiles, cuda_graph_replays, compile_time_s, and for spec_steps > 0:
        accepted_tokens (drafts accepted), acceptance_rate (accepted / drafted), tokens_per_step
        (tokens emitted per request per speculative step), tokens_per_step_per_row (that mean per row
        of the latest speculative ``generate``, over the steps the row took part in).
        cuda_graph_replays counts CUDA graphs actually replayed, cuda_graph_recordings those recorded
        (0 without CUDA graphs)."""
        s = dict(self._stats)
        s["decode_tokens_per_s"] = s["decode_tokens"] / s["decode_time_s"] if s["decode_time_s"] else 0.0
        s["acceptance_rate"] = s["accepted_tokens"] / s["drafted_tokens"] if s["drafted_tokens"] else 0.0
        k = self.spec_steps
        s["tokens_per_step"] = (1 + k * s["acceptance_rate"]) if s["drafted_tokens"] else 1.0
        # per row of the latest speculative generate: mean tokens emitted over the steps it was active
        steps = self.spec_history[getattr(self, "_spec_history_start", len(self.spec_history)):]
        s["tokens_per_step_per_row"] = [
            sum(c) / len(c) if c else 0.0
            for c in ([row[b] for row in steps if row[b] > 0] for b in range(len(steps[0]) if steps else 0))]
        return s


DONE_POLL_STEPS = 8  # with stop ids: steps between reads of the device-side "all rows done" flag


def _stopped(tok: Tensor, t: int, eos: Tensor, last: Tensor) -> Tensor:
    """Rows whose token ``t`` (0-based) ``tok [B]`` ends them: a stop id or their last token."""
    return (tok[:, None] == eos).any(dim=-1) | (last <= t)


def _cut(row: list[int], max_new: int, stops: list[int]) -> list[int]:
    """``row`` up to and including its first stop id, at most ``max_new`` tokens."""
    row = row[:max_new]
    for i, tok in enumerate(row):
        if tok in stops:
            return row[: i + 1]
    return row
