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
import zipfile
from typing import Sequence

import torch
from torch import Tensor

from . import native
from .aoti_export import FORMAT, PROGRAMS, SPEC_PROGRAMS, parse_cache_spec, prefill_chunks, prefill_program
from .generation_loop import GenerationLoop, PreparedBatch
from .speculative import start_drafts

__all__ = ["AOTIGenerator"]

_REQUIRED = ("dsv4.format", "dsv4.max_batch_size", "dsv4.max_seq_len", "dsv4.prefill_chunk", "dsv4.vocab_size",
             "dsv4.spec_steps", "dsv4.device", "dsv4.cache")


def _native_hint(message: str) -> str:
    """What to add to a load error that names a ``dsv4::`` op: the package calls an op of dsv4_ops'
    native library (the CUDA top-k), which this process has not loaded."""
    if "dsv4::" not in message or native.library_path() is not None:
        return ""
    return (f"; the package calls a C++ op of dsv4_ops' native library, which is not loaded: "
            f"{native.unavailable_reason()}")


def _zeros(spec: str, device) -> list[Tensor]:
    return [torch.zeros(shape, dtype=dtype, device=device) for dtype, shape in parse_cache_spec(spec)]


class AOTIGenerator(GenerationLoop):
    """Generation from an exported package (greedy, or sampled with stop ids: ``generate``;
    sampling runs ``sampling.py`` eagerly on the programs' logits).

    Args:
        path: a ``.pt2`` from ``dsv4_ops.export``. Its limits are fixed at export and read from
            it: ``max_batch_size``, ``max_seq_len``, ``prefill_chunks`` (``prefill_chunk``: the
            largest), ``spec_steps``,
            ``kv_cache_dtype`` (``export(..., kv_cache_dtype="fp8")`` packages an FP8 pool).
        device: where to run; default the device it was exported for (``cuda:N`` picks the GPU).
        cuda_graphs: replay decode / speculative steps as CUDA graphs (None = on for CUDA packages).
        speculative: use the package's MTP speculative programs in ``generate`` (None = when the
            package has them). ``decode`` needs ``speculative=False``, as with ``Generator``.

    Same API as ``Generator``: ``prefill(prompts) -> [B, vocab]``, ``decode(next_ids) -> [B, vocab]``,
    ``generate(prompts, max_new_tokens, temperature=..., top_k=..., top_p=..., seed=..., eos_token_id=...)
    -> list[list[int]]``, ``stats``. Sampling with the speculative programs is not supported (a
    ValueError): they verify greedily.
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
        self.prefill_chunks = prefill_chunks(meta)  # a step runs the smallest that holds its rows' tokens
        self.prefill_chunk = self.prefill_chunks[-1]
        self.vocab_size = int(meta["dsv4.vocab_size"])
        self.spec_steps = int(meta["dsv4.spec_steps"])
        self.kv_cache_dtype = meta.get("dsv4.kv_cache_dtype", "auto")  # fixed at export (its pool layout)
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
        names += tuple(prefill_program(p, C, self.prefill_chunks) for C in self.prefill_chunks[:-1]
                       for p in ("prefill", "spec_prefill") if p in names)
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
        self._bucket = B  # a package runs one static batch: every call pads to it
        self._init_loop()

    # ------------------------------------------------------------------ loading
    @staticmethod
    def _metadata(path: str) -> dict[str, str]:
        from torch._inductor.package import load_package

        try:
            meta = load_package(path, "decode").get_metadata()
        except Exception as e:  # noqa: BLE001  (the loader raises RuntimeError or c10 errors)
            first = str(e).splitlines()[0] if str(e) else ""
            raise ValueError(f"AOTIGenerator: cannot load {path!r} as an AOTInductor package with a 'decode' "
                             f"program ({type(e).__name__}: {first}{_native_hint(str(e))})") from None
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
            raise ValueError(f"AOTIGenerator: {self.path!r} has no loadable {name!r} program "
                             f"({e}{_native_hint(str(e))})") from None

    # ------------------------------------------------------------------ running programs
    def _inputs(self, name: str, *step_inputs: Tensor) -> tuple:
        if name == "decode" or name.startswith("prefill"):
            return (*step_inputs, self.lengths, self.cache)
        if name.startswith("spec_prefill"):
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

    # ------------------------------------------------------------------ the steps
    def prefill(self, prompts: Sequence[Sequence[int]]) -> Tensor:
        """Start a new batch: ``prompts`` (ragged token-id lists, at most ``max_batch_size``) ->
        ``[B, vocab]`` fp32 logits at each prompt's last position."""
        return self._prefill_batch(self._prepare(prompts, self.max_batch_size))

    def _step_chunks(self, bucket: int) -> list[int]:
        return self.prefill_chunks

    def _prefill_chunk(self, j: int, batch: PreparedBatch) -> Tensor:
        if self.speculative:
            name = prefill_program("spec_prefill", batch.chunks[j], self.prefill_chunks)
            return self._run(name, batch.ids[j], batch.next_ids[j], batch.n_new(j), batch.n_mtp(j))
        return self._run(prefill_program("prefill", batch.chunks[j], self.prefill_chunks), batch.ids[j],
                         batch.n_new(j))

    def _decode_step(self, next_ids: Tensor, n_new: Tensor | None = None) -> Tensor:
        B = len(self._host_lengths)
        self._ids.zero_()
        self._ids[:B].copy_(next_ids[:B])
        self._n_new.copy_(self._decode_mask if n_new is None else n_new)  # finished rows: 0 new
        return self._graphed("decode", self._ids, self._n_new)[:B]

    def _check_generate_args(self, args) -> None:
        # the exported speculative program verifies greedily; sampling would need the drafts'
        # distributions as program state (a new package format)
        if self.speculative and args.sampling:
            raise ValueError("generate: temperature > 0 with speculative decoding is not supported by "
                             "AOTIGenerator (the exported spec program is greedy); load the package with "
                             "speculative=False to sample, or use Generator")

    def _spec_step(self, active: Tensor, params=None, filtered: bool = False) -> tuple[Tensor, Tensor]:
        self._active.copy_(active)
        return self._graphed("spec", self._active)

    def _start_drafts(self, first: Tensor, sampling: bool = False) -> None:
        start_drafts(self.last_tok, self.drafts, first)
