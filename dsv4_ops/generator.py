"""Generator: ragged-batch prefill, decode and generate (greedy or sampled) — a thin loop over the model.

The model owns the KV pool (``model.setup_caches``); the generator owns each row's length (a
device tensor) and calls the model's cached step, ``torch.compile(model, fullgraph=True)``
when ``compile=True`` (on CUDA replayed as CUDA graphs, Inductor's cudagraph trees). Shapes are
frozen per batch bucket (1, 2, 4, ... max_batch_size) and, for prefill, per chunk bucket (64, 256,
1024 or 2048 tokens a row, at most ``max_prefill_tokens`` a step; or one fixed ``prefill_chunk``);
decode runs one token per row, so new prompts of any length reuse the compiled graphs.
Speculative decoding (``spec_steps > 0``) compiles its own step (``speculative.py``) the same way,
and so is sampling (``sampling.py``): its settings are tensor inputs, so new temperatures or top-p
values reuse the graphs.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch
from torch import Tensor

from . import cudagraph_replays, sampling
from .compiled_steps import CompiledSteps, batch_buckets, compile_step
from .generation_loop import (DEFAULT_MAX_PREFILL_TOKENS, GenerationLoop, PreparedBatch, check_int, chunk_buckets,
                              chunks_within, pad_rows)
from .sampling import SamplingParams
from .speculative import SpecDecoding

__all__ = ["Generator"]


class Generator(GenerationLoop):
    """Generation (greedy, or sampled with stop ids: ``generate``) for a ``DeepseekV4ForCausalLM`` on the dsv4 ops.

    Args:
        model: a ``dsv4_ops.DeepseekV4ForCausalLM``. The generator sets up its KV pool
            (``model.setup_caches``); one generator per model at a time (a generator with other
            limits re-allocates the pool, and the earlier one re-allocates it back on its next
            ``prefill``).
        max_batch_size: most prompts per ``prefill`` call.
        max_seq_len: most tokens (prompt + generated) per request.
        spec_steps: MTP draft tokens per step (0 = plain decode).
        compile: ``torch.compile(fullgraph=True)`` the model's step (a bool). Without it the steps run
            eagerly in ``torch.inference_mode()`` (tensors a forward hook keeps from them are inference
            tensors: use them under ``no_grad``); the returned logits are ordinary tensors.
        cuda_graphs: replay the compiled steps as CUDA graphs (None = on when compiling a CUDA model).
        prefill_chunk: tokens per row per prefill step. None (the default): chunk buckets, the
            chunk sizes ``64, 256, 1024, 2048, 4096`` (each capped at ``max_seq_len``), one
            compiled graph per (batch bucket, chunk bucket) used; every step takes the smallest chunk
            that holds the longest remaining part of any row, capped by ``max_prefill_tokens`` (a
            4096-token prompt runs as one step, 8192 as 4096 + 4096, 100 as one 256-token
            step). An int: that one chunk for every step (long prompts run in several steps; one
            graph per batch bucket).
        max_prefill_tokens: the most tokens (``batch bucket x chunk``, padding included) a prefill
            step of chunk buckets runs: a step of ``b`` rows takes only chunk buckets with
            ``b * chunk <= max_prefill_tokens`` (when even 64 is too large, the one chunk
            ``max_prefill_tokens // b``, at least one token a row). None = 8192 (buckets of 1 to 4
            rows take 2048-token chunks, 8 rows 1024, 16 and 32 rows 256, 64 and 128 rows 64). Only
            with ``prefill_chunk=None``: a fixed chunk runs ``b x prefill_chunk`` tokens a step.
        kv_cache_dtype: what the KV pool stores: ``"auto"`` (the model's dtype), ``"bf16"`` or
            ``"fp8"`` (FlashMLA's FP8 V4 layout; ``model.setup_caches``).
        pdl: programmatic dependent launch between the compiled steps' Inductor kernels
            (``torch._inductor.config.triton.enable_pdl``, used on sm_90+ NVIDIA GPUs; a no-op
            elsewhere): a kernel's launch and its loads of what the kernel before it did not write
            overlap that kernel's end. Off by default: it speeds up the batch-1 step but not large
            batches, and its logits differ from the run without it in the last bits (BENCHMARKS.md).

    >>> gen = Generator(DeepseekV4ForCausalLM(DSV4Config.tiny()), max_batch_size=2, max_seq_len=64, compile=False)
    >>> [len(t) for t in gen.generate([[1, 2, 3], [4]], max_new_tokens=5)]
    [5, 5]
    """

    def __init__(self, model, max_batch_size: int = 4, max_seq_len: int = 4096, spec_steps: int = 0,
                 compile: bool = True, cuda_graphs: bool | None = None, prefill_chunk: int | None = None,
                 kv_cache_dtype: str = "auto", pdl: bool = False, max_prefill_tokens: int | None = None,
                 _draft: str = "mtp", _chunk_buckets: Sequence[int] | None = None) -> None:
        check_int("spec_steps", spec_steps, 0)
        check_int("max_batch_size", max_batch_size, 1)
        check_int("max_seq_len", max_seq_len, 1)
        if prefill_chunk is not None:
            check_int("prefill_chunk", prefill_chunk, 1)
            if max_prefill_tokens is not None:
                raise ValueError(f"max_prefill_tokens={max_prefill_tokens!r} bounds the steps of chunk buckets "
                                 f"(prefill_chunk=None); with prefill_chunk={prefill_chunk} every prefill step "
                                 "runs batch bucket x prefill_chunk tokens: pass one or the other")
        if max_prefill_tokens is not None:
            check_int("max_prefill_tokens", max_prefill_tokens, 1)
        if not isinstance(compile, bool):
            raise ValueError(f"compile must be True or False, got {compile!r}")
        if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be True, False or None (auto), got {cuda_graphs!r}")
        if not isinstance(pdl, bool):
            raise ValueError(f"pdl must be True or False, got {pdl!r}")
        if pdl and not compile:
            raise ValueError("pdl=True needs compile=True (Inductor launches the kernels)")
        self.model = model.eval()
        self.config = model.config
        self.vocab_size = model.config.vocab_size
        self.device = model.device
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.prefill_chunk = prefill_chunk
        if prefill_chunk is None:  # tests pass smaller _chunk_buckets, to span them with short prompts
            self.chunk_buckets = sorted(_chunk_buckets) if _chunk_buckets else chunk_buckets(max_seq_len)
            self.max_prefill_tokens = DEFAULT_MAX_PREFILL_TOKENS if max_prefill_tokens is None else max_prefill_tokens
        else:
            self.chunk_buckets, self.max_prefill_tokens = [prefill_chunk], None
        self.spec_steps = spec_steps
        self.speculative = spec_steps > 0
        # a speculative step may write up to spec_steps + 1 positions past a request's last
        # accepted token (rejected drafts), so the pool has that much slack past max_seq_len
        capacity = max_seq_len + 2 * (spec_steps + 1) if spec_steps else max_seq_len
        self._cache_args = dict(max_batch_size=max_batch_size, max_seq_len=capacity, lookahead=spec_steps,
                                mtp=spec_steps > 0 and len(model.mtp) > 0, kv_cache_dtype=kv_cache_dtype)
        model.setup_caches(**self._cache_args)
        # auto: CUDA graphs whenever the steps are compiled for a CUDA model
        self.cuda_graphs = (self.device.type == "cuda" and compile) if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and not compile:
            raise ValueError("cuda_graphs=True needs compile=True (graphs are captured by Inductor)")
        if self.cuda_graphs:
            cudagraph_replays.install()
        self.compiled = compile
        self.pdl = pdl  # Inductor uses it on sm_90+ NVIDIA GPUs; elsewhere the option is a no-op
        self.buckets = batch_buckets(max_batch_size)
        # the chunk sizes a prefill step of each batch bucket may take
        self._chunks = {b: self.chunk_buckets if prefill_chunk is not None else
                        chunks_within(self.chunk_buckets, self.max_prefill_tokens, b) for b in self.buckets}
        # device-side state: a row's only mutable scalar is its length; one static view per bucket
        self.lengths = torch.zeros(max_batch_size, dtype=torch.int32, device=self.device)
        self._lengths = {b: self.lengths[:b] for b in self.buckets}
        for t in [self.lengths, *self._lengths.values()]:
            torch._dynamo.mark_static_address(t)
        self._bucket = 0
        self._forward = compile_step(model, self.cuda_graphs, self.pdl) if compile else model
        self._steps: dict[str, object] = {}
        self.spec = SpecDecoding(self, spec_steps, _draft) if spec_steps else None
        self._init_loop()
        self._calls = CompiledSteps(self._stats, compile, self.cuda_graphs, self.device)

    # ------------------------------------------------------------------ running a step
    def _compiled(self, kind: str):
        """The step function of ``kind``, compiled once per generator (when ``compile=True``)."""
        if kind not in self._steps:
            fn = self._step_fn(kind)
            self._steps[kind] = compile_step(fn, self.cuda_graphs, self.pdl) if self.compiled else fn
        return self._steps[kind]

    def _step_fn(self, kind: str):
        # sampling settings are tensor inputs; `filtered` (any top-k / top-p: sort the logits) is the
        # one static choice, so it is part of the kind: changing the settings' values adds no graph
        filtered = kind.endswith("_filtered")
        if kind == "spec_prefill":
            return self.spec.prefill_step
        if kind == "spec":
            return self.spec.spec_step
        if kind.startswith("spec_sample"):
            return functools.partial(self.spec.spec_step, filtered=filtered)
        return functools.partial(sampling.sample, filtered=filtered)

    def _run(self, kind: str, bucket: int, fn, *args, chunk: int | None = None, **kwargs):
        """``fn(*args, **kwargs)``, its graphs counted under ``(kind, bucket)``, or ``(kind, bucket,
        chunk)`` for a prefill step of chunk buckets."""
        key = (kind, bucket) if chunk is None else (kind, bucket, chunk)
        return self._calls.run(key, fn, *args, **kwargs)

    @property
    def _graphs(self) -> dict[tuple, int]:
        """Graphs compiled per ``(step kind, batch bucket)``; a prefill step of chunk buckets
        (``prefill_chunk=None``) per ``(step kind, batch bucket, chunk)``."""
        return self._calls.graphs

    def _step(self, kind: str, ids: Tensor, n_new: Tensor, chunk: int | None = None) -> Tensor:
        """One cached model step over ``ids [bucket, S]``; advances the lengths."""
        bucket = ids.shape[0]
        lengths = self._lengths[bucket]
        logits = self._run(kind, bucket, self._forward, ids, lengths, n_new, last_only=True, chunk=chunk)
        lengths.add_(n_new)
        return logits

    # ------------------------------------------------------------------ the steps
    def prefill(self, prompts: Sequence[Sequence[int]]) -> Tensor:
        """Start a new batch: ``prompts`` (ragged token-id lists) -> ``[B, vocab]`` fp32
        logits at each prompt's last position. Long prompts run in chunks."""
        self.model.setup_caches(**self._cache_args)  # a no-op unless another generator changed the pool
        n = len(prompts) if isinstance(prompts, (list, tuple)) else 0
        bucket = next((b for b in self.buckets if b >= n), self.max_batch_size)
        return self._prefill_batch(self._prepare(prompts, bucket))

    def _step_chunks(self, bucket: int) -> list[int]:
        return self._chunks[bucket]

    def _prefill_chunk(self, j: int, batch: PreparedBatch) -> Tensor:
        chunk = None if self.prefill_chunk is not None else batch.chunks[j]  # a fixed chunk keeps its old keys
        if self.spec is None:
            return self._step("prefill", batch.ids[j], batch.n_new(j), chunk=chunk)
        return self._run("spec_prefill", batch.bucket, self._compiled("spec_prefill"), batch.ids[j],
                         batch.next_ids[j], batch.n_new(j), batch.n_mtp(j), chunk=chunk)

    def _decode_step(self, next_ids: Tensor, n_new: Tensor | None = None) -> Tensor:
        B, bucket = len(self._host_lengths), self._bucket
        n_new = self._decode_mask if n_new is None else n_new  # padding rows: 0 new
        return self._step("decode", pad_rows(next_ids[:B], bucket), n_new)[:B]

    def _sample(self, logits: Tensor, params: SamplingParams, pos: Tensor, filtered: bool) -> Tensor:
        kind = "sample_filtered" if filtered else "sample"
        return self._run(kind, logits.shape[0], self._compiled(kind), logits, params, pos)

    def _spec_step(self, active: Tensor, params: SamplingParams | None = None,
                   filtered: bool = False) -> tuple[Tensor, Tensor]:
        if params is None:
            return self._run("spec", self._bucket, self._compiled("spec"), active)
        kind = "spec_sample_filtered" if filtered else "spec_sample"
        return self._run(kind, self._bucket, self._compiled(kind), active, params)

    def _start_drafts(self, first: Tensor, sampling: bool = False) -> None:
        self.spec.start(first, sampling)
