"""``AOTIGenerator``: ``Generator``'s prefill / decode / generate / stats over a ``.pt2`` package
written by ``dsv4_ops.export``, built only on ``torch._inductor.package.load_package`` (no
``torch.compile`` at load; the model's Python code is not needed).

On CUDA the decode step (and the speculative step) is captured in a CUDA graph at its first use
in a process (the package's runners are loaded single-threaded, which capture needs) and
replayed afterwards over static input buffers.

Known on the GPU box (torch 2.11 + cu130): loading any ``.pt2`` segfaults inside ``std::regex``
unless the process starts with ``LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6``.
"""
from __future__ import annotations

import os
import time
import zipfile
from typing import Sequence

import torch
from torch import Tensor

from .aoti_export import FORMAT, PROGRAMS, SPEC_PROGRAMS, parse_cache_spec
from .generator import check_next_ids, check_prompts, chunked
from .speculative import start_drafts

__all__ = ["AOTIGenerator"]

_REQUIRED = ("dsv4.format", "dsv4.max_batch_size", "dsv4.max_seq_len", "dsv4.prefill_chunk", "dsv4.vocab_size",
             "dsv4.spec_steps", "dsv4.device", "dsv4.cache")


def _zeros(spec: str, device) -> list[Tensor]:
    return [torch.zeros(shape, dtype=dtype, device=device) for dtype, shape in parse_cache_spec(spec)]


class AOTIGenerator:
    """Greedy generation from an exported package.

    Args:
        path: a ``.pt2`` from ``dsv4_ops.export``. Its limits are fixed at export and read from
            it: ``max_batch_size``, ``max_seq_len``, ``prefill_chunk``, ``spec_steps``.
        device: where to run; default the device it was exported for (``cuda:N`` picks the GPU).
        cuda_graphs: replay decode / speculative steps as CUDA graphs (None = on for CUDA packages).
        speculative: use the package's MTP speculative programs in ``generate`` (None = when the
            package has them). ``decode`` needs ``speculative=False``, as with ``Generator``.

    Same API as ``Generator``: ``prefill(prompts) -> [B, vocab]``, ``decode(next_ids) -> [B, vocab]``,
    ``generate(prompts, max_new_tokens) -> list[list[int]]``, ``stats``.
    """

    def __init__(self, path: str | os.PathLike, device: str | torch.device | None = None,
                 cuda_graphs: bool | None = None, speculative: bool | None = None) -> None:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"AOTIGenerator: no package at {path!r} (write one with dsv4_ops.export)")
        if not zipfile.is_zipfile(path):
            raise ValueError(f"AOTIGenerator: {path!r} is not a .pt2 package (not a zip archive: corrupt, "
                             "truncated or another kind of file)")
        self.path = path
        self.metadata = meta = self._metadata(path)
        self.max_batch_size = int(meta["dsv4.max_batch_size"])
        self.max_seq_len = int(meta["dsv4.max_seq_len"])
        self.prefill_chunk = int(meta["dsv4.prefill_chunk"])
        self.vocab_size = int(meta["dsv4.vocab_size"])
        self.spec_steps = int(meta["dsv4.spec_steps"])
        exported_on = meta["dsv4.device"]
        self.device = torch.device(device if device is not None else exported_on)
        if self.device.type != exported_on:
            raise ValueError(f"AOTIGenerator: {path!r} was exported for {exported_on}; it cannot run on "
                             f"{self.device} (export the model on that device)")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError("AOTIGenerator: cuda_graphs=True needs a CUDA package")
        self.speculative = self.spec_steps > 0 if speculative is None else speculative
        if self.speculative and self.spec_steps == 0:
            raise ValueError(f"AOTIGenerator: speculative=True but {path!r} was exported with spec_steps=0")
        names = PROGRAMS + (SPEC_PROGRAMS if self.speculative else ())
        self._runners = {name: self._load(name) for name in names}

        B, dev = self.max_batch_size, self.device
        self.cache = _zeros(meta["dsv4.cache"], dev)  # the KV pool every program reads and writes
        self.lengths = torch.zeros(B, dtype=torch.int32, device=dev)
        self._ids = torch.zeros(B, dtype=torch.long, device=dev)  # decode's static inputs
        self._n_new = torch.zeros(B, dtype=torch.int32, device=dev)
        if self.speculative:
            self.mtp_cache = _zeros(meta["dsv4.mtp_cache"], dev)
            (self.h_last,) = _zeros(meta["dsv4.h_last"], dev)
            self.last_tok = torch.zeros(B, dtype=torch.long, device=dev)
            self.drafts = torch.zeros(B, self.spec_steps, dtype=torch.long, device=dev)
            self._active = torch.zeros(B, dtype=torch.int32, device=dev)
        self._graphs: dict[str, tuple[torch.cuda.CUDAGraph, object]] = {}
        self._host_lengths: list[int] = []
        self._stats = dict(prefill_steps=0, decode_steps=0, tokens_generated=0, decode_tokens=0, decode_time_s=0.0,
                           cuda_graph_replays=0, graph_breaks=0, recompiles=0, compile_time_s=0.0,
                           spec_steps_run=0, accepted_tokens=0, drafted_tokens=0)

    # ------------------------------------------------------------------ loading
    @staticmethod
    def _metadata(path: str) -> dict[str, str]:
        from torch._inductor.package import load_package

        try:
            meta = load_package(path, "decode").get_metadata()
        except Exception as e:  # noqa: BLE001  (the loader raises RuntimeError or c10 errors)
            first = str(e).splitlines()[0] if str(e) else ""
            raise ValueError(f"AOTIGenerator: cannot load {path!r} as an AOTInductor package with a 'decode' "
                             f"program ({type(e).__name__}: {first})") from None
        missing = [k for k in _REQUIRED if k not in meta]
        if missing:
            raise ValueError(f"AOTIGenerator: {path!r} is not a dsv4_ops package (metadata lacks {missing}); "
                             "write it with dsv4_ops.export")
        if meta["dsv4.format"] != FORMAT:
            raise ValueError(f"AOTIGenerator: {path!r} has package format {meta['dsv4.format']}, this dsv4_ops "
                             f"reads format {FORMAT}; re-export it")
        return meta

    def _load(self, name: str):
        from torch._inductor.package import load_package

        index = self.device.index if self.device.type == "cuda" else -1
        try:
            return load_package(self.path, name, run_single_threaded=self.cuda_graphs, device_index=index)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"AOTIGenerator: {self.path!r} has no loadable {name!r} program ({e})") from None

    # ------------------------------------------------------------------ running programs
    def _inputs(self, name: str, *step_inputs: Tensor) -> tuple:
        if name in PROGRAMS:
            return (*step_inputs, self.lengths, self.cache)
        if name == "spec_prefill":
            return (*step_inputs, self.lengths, self.h_last, self.cache, self.mtp_cache)
        return (*step_inputs, self.lengths, self.last_tok, self.drafts, self.h_last, self.cache, self.mtp_cache)

    def _run(self, name: str, *step_inputs: Tensor):
        with torch.no_grad():
            return self._runners[name](*self._inputs(name, *step_inputs))

    def _graphed(self, name: str, *static_inputs: Tensor):
        """Run ``name`` over static input buffers through a CUDA graph. The first call runs the
        step eagerly (the warm-up capture needs) and records the graph (recording executes
        nothing); later calls replay it."""
        if not self.cuda_graphs:
            return self._run(name, *static_inputs)
        if name not in self._graphs:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                out = self._run(name, *static_inputs)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                graph_out = self._run(name, *static_inputs)
            self._graphs[name] = (graph, graph_out)
            return out
        graph, graph_out = self._graphs[name]
        graph.replay()
        self._stats["cuda_graph_replays"] += 1
        return tuple(t.clone() for t in graph_out) if isinstance(graph_out, (tuple, list)) else graph_out.clone()

    # ------------------------------------------------------------------ public API
    def prefill(self, prompts: Sequence[Sequence[int]]) -> Tensor:
        """Start a new batch: ``prompts`` (ragged token-id lists, at most ``max_batch_size``) ->
        ``[B, vocab]`` fp32 logits at each prompt's last position."""
        rows = check_prompts(prompts, self.max_batch_size, self.max_seq_len, self.vocab_size)
        B, lens, C, bucket = len(rows), [len(r) for r in rows], self.prefill_chunk, self.max_batch_size
        n_chunks = -(-max(lens) // C)
        ids = torch.zeros(bucket, n_chunks * C, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = r
        lens_t = torch.zeros(bucket, dtype=torch.int32)
        lens_t[:B] = torch.tensor(lens, dtype=torch.int32)
        lens_t = lens_t.to(self.device)
        if self.speculative:  # the token after each prompt position feeds the MTP window
            next_ids = chunked(torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1), C).to(self.device)
        ids = chunked(ids, C).to(self.device)
        self.lengths.zero_()
        self._host_lengths = lens
        self._n_new.copy_((torch.arange(bucket, device=self.device) < B).to(torch.int32))
        logits = None
        for j in range(n_chunks):
            n_new = (lens_t - j * C).clamp(0, C).to(torch.int32)
            if self.speculative:
                n_mtp = (lens_t - 1 - j * C).clamp(0, C).to(torch.int32)  # positions with a known next token
                out = self._run("spec_prefill", ids[j], next_ids[j], n_new, n_mtp)
            else:
                out = self._run("prefill", ids[j], n_new)
            logits = out if logits is None else torch.where((n_new > 0)[:, None], out, logits)
            self._stats["prefill_steps"] += 1
        if self.speculative:
            start_drafts(self.last_tok, self.drafts, logits.argmax(-1))
        self._stats["tokens_generated"] += B
        return logits[:B]

    def decode(self, next_ids) -> Tensor:
        """One token per request (``next_ids [B]``, B = the prefilled batch) -> ``[B, vocab]``."""
        B = len(self._host_lengths)
        if self.speculative:
            raise ValueError("decode: this AOTIGenerator drafts with the package's speculative programs; use "
                             "generate(), or AOTIGenerator(path, speculative=False) for token-by-token decode")
        if B == 0:
            raise ValueError("decode: call prefill first")
        next_ids = check_next_ids(next_ids, B, self.vocab_size)
        if max(self._host_lengths) + 1 > self.max_seq_len:
            raise ValueError(f"decode: a request would exceed the package's max_seq_len {self.max_seq_len}")
        t0 = time.perf_counter()
        out = self._decode(next_ids.to(self.device, torch.long))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._count_decode(time.perf_counter() - t0, B)
        return out

    def _decode(self, next_ids: Tensor) -> Tensor:
        B = len(self._host_lengths)
        self._ids.zero_()
        self._ids[:B].copy_(next_ids[:B])
        out = self._graphed("decode", self._ids, self._n_new)
        self._host_lengths = [n + 1 for n in self._host_lengths]
        self._stats["decode_steps"] += 1
        return out[:B]

    def _count_decode(self, seconds: float, tokens: int) -> None:
        self._stats["decode_time_s"] += seconds
        self._stats["decode_tokens"] += tokens
        self._stats["tokens_generated"] += tokens

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32) -> list[list[int]]:
        """Greedy decoding: the ``max_new_tokens`` new tokens of every prompt (with the package's
        speculative programs when it has them: the same tokens, fewer steps)."""
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        rows = check_prompts(prompts, self.max_batch_size, self.max_seq_len, self.vocab_size, "generate")
        longest = max(len(r) for r in rows)
        if longest + max_new_tokens - 1 > self.max_seq_len:
            raise ValueError(f"generate: longest prompt ({longest}) + max_new_tokens ({max_new_tokens}) - 1 "
                             f"> the package's max_seq_len {self.max_seq_len}")
        first = self.prefill(rows).argmax(-1)
        if self.speculative:
            return self._generate_spec(first, max_new_tokens)
        tokens = [first]
        t0 = time.perf_counter()
        for _ in range(max_new_tokens - 1):
            tokens.append(self._decode(tokens[-1]).argmax(-1))
        out = torch.stack(tokens, dim=1).tolist()  # the one host sync of the loop
        self._count_decode(time.perf_counter() - t0, len(rows) * (max_new_tokens - 1))
        return out

    def _generate_spec(self, first: Tensor, max_new_tokens: int) -> list[list[int]]:
        """Speculative steps until every row has ``max_new_tokens``; finished rows sit out."""
        B, k = first.shape[0], self.spec_steps
        out = [[t] for t in first.tolist()]
        t0 = time.perf_counter()
        while True:
            active = [int(len(o) < max_new_tokens) for o in out] + [0] * (self.max_batch_size - B)
            if not any(active):
                break
            self._active.copy_(torch.tensor(active, dtype=torch.int32))
            tokens, counts = self._graphed("spec", self._active)
            tokens, counts = tokens.tolist(), counts.tolist()  # one small sync per step
            for b in range(B):
                out[b] += tokens[b][: counts[b]]
            n_act = sum(active)
            self._stats["spec_steps_run"] += 1
            self._stats["decode_steps"] += 1
            self._stats["accepted_tokens"] += sum(counts) - n_act
            self._stats["drafted_tokens"] += k * n_act
        self._count_decode(time.perf_counter() - t0, sum(min(len(o), max_new_tokens) - 1 for o in out))
        return [o[:max_new_tokens] for o in out]

    @property
    def stats(self) -> dict:
        """The ``Generator`` keys: prefill_steps, decode_steps, tokens_generated, decode_tokens,
        decode_time_s, decode_tokens_per_s, cuda_graph_replays, spec_steps_run, accepted_tokens,
        acceptance_rate; graph_breaks, recompiles and compile_time_s are 0 (nothing compiles)."""
        s = dict(self._stats)
        s["decode_tokens_per_s"] = s["decode_tokens"] / s["decode_time_s"] if s["decode_time_s"] else 0.0
        s["acceptance_rate"] = s["accepted_tokens"] / s["drafted_tokens"] if s["drafted_tokens"] else 0.0
        return s
