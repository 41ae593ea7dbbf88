"""``Engine``: continuous batching over a paged, prefix-cached KV pool.

Requests join and leave at every ``step()``. One iteration (serving_design.md §7.3):

1. admit waiting requests (first come, first served) while a slot is free and their prompt's
   pages fit: match the prefix cache, restore the matched snapshot into the slot, point the
   slot's block-table row at the shared pages;
2. a **prefill** step for up to ``max_prefill_tokens // prefill_chunk`` requests, a chunk each
   (chunks start at multiples of the chunk, a divisor or a multiple of the page size, or, with a
   prefix cache, at the prompt's last page boundary, and prefix snapshots sit where chunks end, so
   a prefix hit and a cold run cut a prompt at the same places);
   a request whose prompt ends samples its first token;
3. a **decode** step for every request that has one, over slots ``0..bucket-1``; with
   ``spec_steps=k`` a speculative step instead (``spec.py``): the MTP block's ``k`` drafts are
   verified in one main-model step and each request advances by its own accepted count, its
   tokens exactly ``Generator(spec_steps=k)``'s;
4. one read of the sampled tokens (the iteration's only wait for the GPU: inputs go to the device
   without one, and the tokens come back through an event that waits for their copy only), then
   stop checks: a stop id (included in the output) or ``max_new_tokens``. A finished request
   publishes its full pages and snapshots to the prefix cache and frees its slot.

**Overlap** (plain decode): while every running request decodes, the next decode step is launched
from the current one's sampled tokens, which are still on the device, before the host reads them;
the GPU then runs it while the host does the stop checks and bookkeeping of the step before. A
request that stops (a stop id) had one step too many computed for it: its row is dropped, and what
that step wrote lies past the request's computed positions, in pages no prefix shares (pages are
published up to the computed positions, and a step that ends a page, whose rings a snapshot saves,
launches none early). Rows that end by length are left out of the early step; admissions wait for
an iteration without one. Tokens are the same either way.

Pages are taken as a request grows. When none is free (after evicting unreferenced cached
prefixes) the newest running request is preempted: its pages are released (published first, so
re-admitting it can hit its own prefix) and it waits to be recomputed, with the tokens it has
made so far as part of its prompt. ``add_request`` rejects a request that no pool state could
ever hold.

Every step's shapes are ``(kind, bucket)``: decode buckets 1, 2, 4, ... ``max_running``, prefill
buckets 1, 2, 4, ... the prefill rows, each at a few widths up to ``prefill_chunk`` (a step runs at
the narrowest that holds its chunks: a short prompt or a tail after a prefix hit pays no full
chunk); sampling settings are tensor inputs, ``filtered`` (any top-k / top-p) the one static
choice (and, speculative, whether any row samples: kind ``decode_sample``). Requests coming and
going add no graphs. A decode step runs over slots ``0..bucket-1``, so when requests leave, the
ones in slots past the smallest bucket that holds them all move down (their device state copied):
a draining batch decodes at small buckets.
"""
from __future__ import annotations

import bisect
import functools
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch

from .. import cudagraph_replays
from ..compiled_steps import CompiledSteps, batch_buckets, compile_step
from ..generate_args import parse_generate_args
from ..generation_loop import check_prompts, chunk_buckets
from ..host_transfer import start_read, to_device
from ..model.kv_cache_dtype import check_kv_cache_dtype
from ..ops.validate import check_int
from ..sampling import SamplingParams
from .pool import PagedKVPool
from .prefix_cache import OutOfPages, PageAllocator, PageEntry, PrefixCache
from .spec import SpecSlots
from .step import pool_step

__all__ = ["Engine", "RequestOutput"]

# the default prefill_chunk, in whole pages: a step of up to 4 such rows reads every expert's weights once for all of
# them; the engine's published numbers use it (a lone long prompt would read them fewer times in longer chunks)
DEFAULT_PREFILL_CHUNK = 2048
# admit_order -> the sort key of the waiting requests (the first one is admitted first)
ADMIT_ORDERS = {"arrival": lambda r: r.arrival,
                "longest_output": lambda r: (len(r.generated) - r.max_new, r.arrival)}


class RequestOutput(NamedTuple):
    request_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None (still running)
    cached_tokens: int  # prompt tokens served from the prefix cache
    accepted_tokens: int = 0  # spec_steps > 0: the request's drafts accepted so far
    drafted_tokens: int = 0  # ... and drafted so far (k per speculative step it took part in)


@dataclass(eq=False)  # identity: `req in batch` must not compare every field of every request
class _Request:
    rid: int
    arrival: int
    prompt: list[int]
    max_new: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    eos: frozenset
    generated: list[int] = field(default_factory=list)
    slot: int | None = None
    shared: list[PageEntry] = field(default_factory=list)  # matched prefix pages
    own: list[int] = field(default_factory=list)  # pages this request took
    computed: int = 0  # positions in the cache
    cached_tokens: int = 0
    snapshots: dict[int, int] = field(default_factory=dict)  # page count -> snapshot id
    decode_snapshot: int | None = None  # depth of the rolling decode-time snapshot
    aborted: bool = False  # reported by the next step, then forgotten
    accepted: int = 0  # speculative decoding: drafts accepted, drafted
    drafted: int = 0
    spec_saved: tuple | None = None  # drafts (and distributions) kept over a preemption

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.generated)

    def token_range(self, start: int, end: int) -> list[int]:
        """``tokens[start:end]`` without building ``tokens`` (a decode step must not copy the history)."""
        P = len(self.prompt)
        return self.prompt[start:end] + self.generated[max(0, start - P):max(0, end - P)]

    @property
    def max_positions(self) -> int:
        """Positions the request computes at most (its last token is never an input)."""
        return len(self.prompt) + self.max_new - 1

    @property
    def prefill_target(self) -> int:
        """Positions to compute before decoding: the prompt, or (resumed after preemption) every
        token but the last, which is the next decode input."""
        return len(self.prompt) if not self.generated else self.num_tokens - 1

    @property
    def num_pages(self) -> int:
        return len(self.shared) + len(self.own)

    @property
    def pages(self) -> list[int]:
        return [e.page for e in self.shared] + self.own


class Engine:
    """Continuous batching for a ``DeepseekV4ForCausalLM`` over a paged, prefix-cached KV pool.

    Args:
        model: a ``dsv4_ops.DeepseekV4ForCausalLM`` (its own ``setup_caches`` pool is not used).
        max_running: most requests decoding at once (request slots).
        max_seq_len: most tokens (prompt + generated) per request.
        num_pages / kv_memory_gb: the paged pool's size, in pages (page 0 is a dummy) or from a
            memory budget for the pages (default: room for ``max_running`` full-length requests).
        page_size: token positions per page, a multiple of every compression rate (so a page
            boundary never splits a compressed block).
        prefix_cache: share full pages of identical prefixes between requests.
        num_snapshots: ring snapshots the prefix cache may hold (default ``2 * max_running``).
        snapshot_interval: also snapshot every this many pages in long prompts (default 16).
        spec_steps: MTP draft tokens per decode step (0 = plain decode; needs the model's MTP
            block). Greedy requests get exactly the ``spec_steps=0`` tokens, and every request
            (greedy or seeded) exactly what ``Generator(spec_steps=k)`` gives it alone; a prefix
            snapshot then also holds the MTP block's window ring and the streams it starts from.
        compile / cuda_graphs: as ``Generator``.
        kv_cache_dtype: ``"auto"``, ``"bf16"`` or ``"fp8"``.
        prefill_chunk: tokens per prefill row per step: a divisor of ``page_size``, or (``spec_steps=0``)
            a multiple of it, which takes a long prompt in fewer, larger steps; chunks then also end at
            each prompt's last page boundary (with ``prefix_cache``), and prefix hits land on chunk ends
            only. A step whose chunks are all short runs at a narrower width. Default: the whole pages
            that fit in 2048 tokens and ``max_seq_len`` (else, and speculative, ``min(page_size, 256)``).
        max_prefill_tokens: prefill tokens per iteration (default ``4 * prefill_chunk``).
        admit_wait: while requests decode, a freed slot waits up to this many iterations for more slots to
            free (as many as one prefill step takes, as there are waiting requests, or an eighth of
            ``max_running``, whichever is least), so that their prompts share one prefill step: every step
            reads the weights of every expert its tokens pick, nearly all of them at a few hundred tokens.
            0 (the default): admit at once (lowest latency).
        admit_order: which waiting request takes a free slot first: ``"arrival"`` (the default: first come,
            first served) or ``"longest_output"`` (the most new tokens still to generate first, arrival
            breaking ties; SGLang's "lof"). With many requests queued at once (``generate``, offline batches)
            it ends the run with short requests instead of one long request decoding in an emptying batch,
            where each step costs nearly what a full one does; a long request may wait behind later ones.
        overlap: launch the next plain decode step before reading the current one's tokens, so the
            host's work of an iteration runs while the GPU computes (``spec_steps=0`` only).

    >>> eng = Engine(DeepseekV4ForCausalLM(DSV4Config.tiny()), max_running=4, max_seq_len=128, page_size=32,
    ...              compile=False)
    >>> [len(t) for t in eng.generate([[1, 2, 3], [4]], max_new_tokens=5)]
    [5, 5]
    """

    def __init__(self, model, max_running: int = 8, max_seq_len: int = 4096, num_pages: int | None = None,
                 kv_memory_gb: float | None = None, page_size: int = 256, prefix_cache: bool = True,
                 spec_steps: int = 0, compile: bool = True, cuda_graphs: bool | None = None,
                 kv_cache_dtype: str = "auto", prefill_chunk: int | None = None,
                 max_prefill_tokens: int | None = None, num_snapshots: int | None = None,
                 snapshot_interval: int = 16, overlap: bool = True, admit_wait: int = 0,
                 admit_order: str = "arrival") -> None:
        cfg = model.config
        check_int("max_running", max_running, 1)
        check_int("max_seq_len", max_seq_len, 1)
        check_int("page_size", page_size, 1)
        check_int("snapshot_interval", snapshot_interval, 1)
        check_int("admit_wait", admit_wait, 0)
        check_int("spec_steps", spec_steps, 0)
        if spec_steps and len(model.mtp) == 0:
            raise ValueError(f"Engine: spec_steps={spec_steps} needs the model's MTP block, and this model has none "
                             "(config.num_nextn_predict_layers = 0); use spec_steps=0")
        rates = [r for r in (cfg.csa_ratio, cfg.hca_ratio) if r]
        for r in rates:
            if page_size % r:
                raise ValueError(f"Engine: page_size={page_size} must be a multiple of every compression rate "
                                 f"{rates} (a page boundary may not split a compressed block)")
        if prefill_chunk is None:  # whole pages up to DEFAULT_PREFILL_CHUNK tokens
            pages = 0 if spec_steps else min(DEFAULT_PREFILL_CHUNK, max_seq_len) // page_size
            prefill_chunk = pages * page_size if pages else min(page_size, 256)
        check_int("prefill_chunk", prefill_chunk, 1)
        if page_size % prefill_chunk and (prefill_chunk % page_size or spec_steps):
            multiple = "" if spec_steps else " or be a multiple of it"
            raise ValueError(f"Engine: prefill_chunk={prefill_chunk} must divide page_size={page_size}{multiple} "
                             "(chunks end on page boundaries, where prefix snapshots are taken)")
        max_prefill_tokens = max_prefill_tokens or 4 * prefill_chunk
        check_int("max_prefill_tokens", max_prefill_tokens, prefill_chunk)
        if not isinstance(compile, bool):
            raise ValueError(f"compile must be True or False, got {compile!r}")
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap must be True or False, got {overlap!r}")
        if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be True, False or None (auto), got {cuda_graphs!r}")
        kv_cache_dtype = check_kv_cache_dtype("Engine: kv_cache_dtype", kv_cache_dtype, cfg, model.device)
        self.model = model.eval()
        self.config, self.vocab_size, self.device = cfg, cfg.vocab_size, model.device
        self.max_running, self.max_seq_len, self.page_size = max_running, max_seq_len, page_size
        self.prefill_chunk = prefill_chunk
        self.prefill_rows = max(1, min(max_running, max_prefill_tokens // prefill_chunk))
        self.admit_wait, self._deferred = admit_wait, 0  # iterations admission has waited for more free slots
        self._waiting: list[_Request] = []
        self.admit_order = admit_order  # admit_wait and admit_order may change between runs (bench_engine.py)
        self.snapshot_interval = snapshot_interval
        # snapshots only where a cold run's chunk ends: a hit resumes where the cold run cuts the prompt
        self._snap_pages = max(1, prefill_chunk // page_size)
        # chunks of several pages end at the prompt's last page boundary too, for prefix hits there; without
        # a prefix cache that cut only costs a step (a warm-up's disabled cache keeps the serving cuts)
        self._cut_last_page = bool(prefix_cache) and self._snap_pages > 1
        if num_pages is not None and kv_memory_gb is not None:
            raise ValueError("Engine: give num_pages or kv_memory_gb, not both")
        if kv_memory_gb is not None:
            if not isinstance(kv_memory_gb, (int, float)) or kv_memory_gb <= 0:
                raise ValueError(f"Engine: kv_memory_gb must be a positive number, got {kv_memory_gb!r}")
            num_pages = int(kv_memory_gb * 2**30 // PagedKVPool.page_bytes(model, page_size, kv_cache_dtype))
        pages_per_request = -(-max_seq_len // page_size)
        if num_pages is None:
            num_pages = max_running * pages_per_request + 1
        check_int("num_pages", num_pages, 2)
        # as Generator: a speculative step runs up to k positions past a request's next token (drafts it
        # may reject) and the MTP draft steps k further; the block table and RoPE tables reach that far
        capacity = max_seq_len + 2 * (spec_steps + 1) if spec_steps else max_seq_len
        if capacity > model.max_positions:
            model.set_max_positions(capacity)
        self.spec_steps = spec_steps
        # slot max_running is the dummy that prefill's padding rows read and write
        self.pool = PagedKVPool(model, max_running + 1, capacity, num_pages, page_size, kv_cache_dtype,
                                lookahead=spec_steps)
        self.spec = SpecSlots(model, self.pool, spec_steps, page_size) if spec_steps else None
        # a request's device state, indexed by its slot (what moving it to another slot copies)
        self._per_slot = [self.pool.slot_len, *self.pool.ring_tensors(), *(self.spec.buffers() if self.spec else [])]
        self.allocator = PageAllocator(num_pages)
        num_snapshots = 2 * max_running if num_snapshots is None else num_snapshots
        check_int("num_snapshots", num_snapshots, 0)
        self.cache = PrefixCache(self.allocator, page_size, num_snapshots if prefix_cache else 0,
                                 extra_key=kv_cache_dtype.encode(), enabled=bool(prefix_cache))
        # ring snapshots at page boundaries: one row of every per-slot ring (and MTP state), per snapshot
        self._snapshots = [torch.zeros((len(self.cache.free_snapshots), *t.shape[1:]), dtype=t.dtype,
                                       device=t.device) for t in self._slot_state(restore=False)]
        self._block_table = torch.zeros_like(self.pool.block_table, device="cpu")
        self._table_dirty = False
        self.compiled = compile
        self.cuda_graphs = (self.device.type == "cuda" and compile) if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and not compile:
            raise ValueError("cuda_graphs=True needs compile=True (graphs are captured by Inductor)")
        if self.cuda_graphs:
            cudagraph_replays.install()
        self.decode_buckets, self.prefill_buckets = batch_buckets(max_running), batch_buckets(self.prefill_rows)
        # a step's chunks may all be short (a prompt's tail after a prefix hit, short prompts): it runs at
        # the narrowest width that holds them, one of a few, so that it does not pay for a full chunk
        self.prefill_widths = [w for w in chunk_buckets(prefill_chunk) if w < prefill_chunk] + [prefill_chunk]
        self._fns: dict[tuple[str, bool], object] = {}
        self.overlap = overlap and not spec_steps
        self._ahead: tuple[list[_Request], torch.Tensor] | None = None  # a decode step launched, not read
        self._params_made: dict[tuple, tuple] = {}  # rows' request ids -> what _params made for them
        self._requests: dict[int, _Request] = {}
        self._slots: list[_Request | None] = [None] * max_running
        self._next_id = 0
        self._stats = dict(steps=0, prefill_steps=0, decode_steps=0, prompt_tokens=0, prefix_hit_tokens=0,
                           generated_tokens=0, preemptions=0, recompiles=0, graph_breaks=0, cuda_graph_replays=0,
                           cuda_graph_recordings=0, compile_time_s=0.0, busy_time_s=0.0, finished=0, aborted=0,
                           accepted_tokens=0, drafted_tokens=0, early_steps=0, early_rows_dropped=0, slot_moves=0,
                           admissions_deferred=0)
        self._calls = CompiledSteps(self._stats, compile, self.cuda_graphs, self.device)

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_ids: Sequence[int], max_new_tokens: int = 32, *, temperature=None, top_k=None,
                    top_p=None, seed=None, eos_token_id=None) -> int:
        """Queue a request; returns its id. Checks everything now (a ValueError names the argument)."""
        row = check_prompts([prompt_ids], 1, self.max_seq_len, self.vocab_size, "add_request")[0]
        args = parse_generate_args(1, self.vocab_size, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id)
        n, total = len(row), len(row) + args.max_new[0] - 1
        if total > self.max_seq_len:
            raise ValueError(f"add_request: prompt_ids ({n} tokens) + max_new_tokens ({args.max_new[0]}) - 1 = "
                             f"{total} > max_seq_len {self.max_seq_len}")
        need = -(-total // self.page_size)
        if need > self.allocator.num_pages - 1:
            raise ValueError(f"add_request: prompt_ids ({n} tokens) + max_new_tokens ({args.max_new[0]}) need "
                             f"{need} pages of {self.page_size} positions; the pool has "
                             f"{self.allocator.num_pages - 1} (num_pages - 1 dummy)")
        rid = self._next_id
        self._next_id += 1
        req = _Request(rid, rid, row.tolist(), args.max_new[0], args.temperature[0], args.top_k[0], args.top_p[0],
                       args.seed[0], frozenset(args.eos[0]))
        self._requests[rid] = req
        self._queue(req)
        return rid

    def abort(self, request_id: int) -> None:
        """Stop a waiting or running request; its pages are freed. ``step`` reports it once, with
        ``finish_reason="abort"``."""
        req = self._requests.get(request_id) if isinstance(request_id, int) else None
        if req is None or req.aborted:
            raise ValueError(f"abort: request_id={request_id!r} is not a waiting or running request")
        if req in self._waiting:
            self._waiting.remove(req)
        else:
            self._release(req)
        req.aborted = True
        self._stats["aborted"] += 1

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # ------------------------------------------------------------------ the iteration
    def step(self) -> list[RequestOutput]:
        """One scheduler iteration (admit, prefill, decode, stop checks) -> what each request got."""
        t0 = time.perf_counter()
        outputs = [RequestOutput(r.rid, [], True, "abort", r.cached_tokens, r.accepted, r.drafted)
                   for r in list(self._requests.values()) if r.aborted]
        for o in outputs:
            del self._requests[o.request_id]
        ahead, self._ahead = self._ahead, None
        live = [r for r in ahead[0] if r.slot is not None] if ahead else []
        if ahead:  # rows of requests that stopped (or were aborted) before their early step was read
            self._stats["early_rows_dropped"] += len(ahead[0]) - len(live)
        if live:  # the decode step launched early by the last iteration is this one's
            results = [("decode", live, ahead[1], [r.slot for r in live])]
        else:
            results = self._schedule()  # (kind, items, each step's tokens [bucket, width], each item's row)
        if results:  # queued before an early step, so that reading them does not wait for it
            read = start_read(torch.cat([tokens.flatten() for _, _, tokens, _ in results]))
        if self.overlap and len(results) == 1 and results[0][0] == "decode":
            self._ahead = self._launch_early(results[0][1], results[0][2])
        if results:
            picked = read()  # the iteration's one wait for the GPU
            offset = 0
            for kind, items, tokens, rows in results:
                width = tokens.shape[1]
                for item, row in zip(items, rows):
                    req = item[0] if kind == "prefill" else item
                    got = picked[offset + row * width: offset + (row + 1) * width]
                    out = self._advance(req, kind, item, [t for t in got if t >= 0])
                    if out is not None:
                        outputs.append(out)
                offset += tokens.numel()
            self._stats["steps"] += 1
        self._stats["busy_time_s"] += time.perf_counter() - t0
        return outputs

    def _schedule(self) -> list[tuple]:
        """Admit, plan and launch this iteration's prefill and decode steps -> their results to read."""
        self._admit()
        self._compact()
        prefill = self._plan_prefill()
        decode = [r for r in self._slots if r is not None and r.generated and r.computed == r.num_tokens - 1]
        # a speculative step writes k positions past the next token: pages for them too (not past the
        # request's last position: what lies beyond goes to the dummy page and is never kept)
        decode = self._reserve(decode, lambda r: min(r.computed + 1 + self.spec_steps, r.max_positions))
        prefill = [(r, n) for r, n in prefill if r.slot is not None]
        results = []
        if prefill:
            results.append(("prefill", prefill, self._run_prefill(prefill)[:, None], range(len(prefill))))
        decode = [r for r in decode if r.slot is not None]
        if decode:
            results.append(("decode", decode, self._run_decode(decode), [r.slot for r in decode]))
        return results

    def _launch_early(self, batch: list[_Request], tokens: torch.Tensor) -> tuple | None:
        """The next decode step of ``batch``, launched from its unread ``tokens [bucket, 1]``, when the
        next iteration would run exactly that (every running request decodes, no admission is due)
        and its pages are free without preempting -> ``(its requests, its tokens)``, else None."""
        if sum(r is not None for r in self._slots) != len(batch):
            return None  # a request still in prefill: the next iteration runs its chunk
        early = [r for r in batch if len(r.generated) + 1 < r.max_new]  # the rest end by length now
        due = self._admission_due(ending=len(batch) - len(early))
        if not early or due:
            return None
        if self.cache.enabled and any((r.computed + 1) % self.page_size == 0 for r in batch):
            return None  # this step ends a page: its snapshot is of the rings before another step runs
        try:
            for r in early:  # this step writes position computed; the next one computed + 1
                self._ensure_pages(r, r.computed + 2)
        except OutOfPages:
            return None
        moves = self._compact()
        if moves:  # the step's input tokens follow their requests to the new slots
            tokens = tokens.clone()
            for src, dst in moves:
                tokens[dst] = tokens[src]
        self._stats["early_steps"] += 1
        self._defer(due)  # the next iteration reads this step and admits no one
        return early, self._run_decode(early, ids=tokens)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens=32, *, temperature=None, top_k=None,
                 top_p=None, seed=None, eos_token_id=None) -> list[list[int]]:
        """``Generator.generate``'s contract over the engine: the new tokens of every prompt. Each
        keyword is one value or one per prompt; an int ``seed`` ``s`` seeds prompt ``i`` with
        ``s + i`` (as ``Generator``)."""
        check_prompts(prompts, len(prompts) if isinstance(prompts, (list, tuple)) else 1, self.max_seq_len,
                      self.vocab_size, "generate")
        args = parse_generate_args(len(prompts), self.vocab_size, max_new_tokens, temperature, top_k, top_p, seed,
                                   eos_token_id)
        ids = [self.add_request(p, args.max_new[i], temperature=args.temperature[i], top_k=args.top_k[i],
                                top_p=args.top_p[i], seed=args.seed[i], eos_token_id=args.eos[i] or None)
               for i, p in enumerate(prompts)]
        got = {rid: [] for rid in ids}
        while any(rid in self._requests for rid in ids):
            for out in self.step():
                if out.request_id in got:
                    got[out.request_id] += out.new_token_ids
        return [got[rid] for rid in ids]

    def warm_up(self, filtered: bool = True) -> dict:
        """Run every step shape the engine can take (twice with CUDA graphs), so that no request later
        waits for a compile or a CUDA-graph recording: for each decode bucket ``b``, ``b`` short
        requests at once (slots ``0..b-1``; their prefill covers the prefill buckets at the narrowest
        width), then for each wider prefill width each prefill bucket's rows of prompts that reach it;
        greedy, sampled, and (``filtered``) sampled with top-p: without it, a load that never asks for
        top-k / top-p compiles half as many graphs. Returns ``{"keys": step shapes run,
        "compile_time_s": ..., "seconds": ...}``. A server calls it before it reports ready; the
        requests leave no pages, slots or cached prefixes behind."""
        t0, compile_before = time.perf_counter(), self._stats["compile_time_s"]
        sampling = [dict(), dict(temperature=1.0, seed=0)] + ([dict(temperature=1.0, top_p=0.9, seed=0)]
                                                             if filtered else [])
        # with CUDA graphs each twice: a graph is recorded on its step's second call, the first warms up
        sampling *= 2 if self.cuda_graphs else 1
        short = min(2, self.max_seq_len)
        runs = [[[(2 * i + j) % self.vocab_size for j in range(short)] for i in range(b)] for b in self.decode_buckets]
        for narrower in self.prefill_widths[:-1]:  # the shortest prompts whose first chunk is wider
            n = next((n for n in range(narrower + 1, self.max_seq_len + 1) if self._chunk_len(n) > narrower), None)
            if n is not None and -(-n // self.page_size) < self.allocator.num_pages:  # else no prompt gets there
                runs += [[[(i + j) % self.vocab_size for j in range(n)] for i in range(b)]
                         for b in self.prefill_buckets]
        enabled, self.cache.enabled = self.cache.enabled, False  # its long prompts are not worth caching
        try:
            for prompts in runs:
                # b requests decode at once (bucket b; compaction moves late ones down) only if the first
                # ones still decode when the last one's prefill step has run
                new = -(-len(prompts) // self.prefill_rows) + 1
                for kw in sampling:
                    self.generate(prompts, max_new_tokens=min(new, self.max_seq_len + 1 - len(prompts[0])), **kw)
        finally:
            self.cache.enabled = enabled
        return dict(keys=len(self._calls.keys), compile_time_s=self._stats["compile_time_s"] - compile_before,
                    seconds=time.perf_counter() - t0)

    # ------------------------------------------------------------------ admission and pages
    def _admit(self) -> None:
        if not self._defer(self._admission_due()):
            return
        while self._waiting and None in self._slots:
            req = self._waiting[0]
            shared, snap = self.cache.match(req.tokens[: req.prefill_target + 1],
                                            lambda depth: self._cuts_at(req, depth))
            hit = len(shared) * self.page_size
            # its prompt and the next token's position, unless the prompt's token is its last
            need = -(-min(req.prefill_target + 1, req.max_positions) // self.page_size) - len(shared)
            evictable = sum(1 for e in self.cache.entries.values() if e.users == 0)
            if need > self.allocator.num_free + evictable:
                self.cache.release(shared)
                return
            self._waiting.pop(0)
            slot = self._slots.index(None)
            self._slots[slot] = req
            req.slot, req.shared, req.own, req.computed, req.snapshots = slot, shared, [], hit, {}
            req.decode_snapshot = None
            if not req.generated:
                req.cached_tokens = hit
                self._stats["prompt_tokens"] += len(req.prompt)
                self._stats["prefix_hit_tokens"] += hit
            self._block_table[slot].zero_()
            for i, e in enumerate(shared):
                self._block_table[slot, i] = e.page
            self._table_dirty = True
            self.pool.slot_len[slot].fill_(hit)  # `t[i] = int` would copy from the host and wait for the GPU
            if snap is not None:
                for store, t in zip(self._snapshots, self._slot_state(restore=True)):
                    t[slot].copy_(store[snap])
            if self.spec is not None and req.generated:  # resumed: its next token is known
                self.spec.resume(slot, req.generated[-1], req.spec_saved)

    @property
    def admit_order(self) -> str:
        return self._waiting_order

    @admit_order.setter
    def admit_order(self, order: str) -> None:
        """Checked, and the requests already waiting re-sorted in the new order."""
        if order not in ADMIT_ORDERS:
            raise ValueError(f"Engine: admit_order must be one of {tuple(ADMIT_ORDERS)}, got {order!r}")
        self._waiting_order = order
        self._waiting.sort(key=ADMIT_ORDERS[order])

    def _queue(self, req: _Request) -> None:
        """Put ``req`` among the waiting requests, in ``admit_order``."""
        bisect.insort(self._waiting, req, key=ADMIT_ORDERS[self.admit_order])

    def _admission_due(self, ending: int = 0) -> bool | None:
        """Whether waiting requests take free slots this iteration (``ending``: of the next one, after that
        many running requests end): at once when nothing decodes, when a request is still in prefill (its
        step runs anyway), or when enough slots are free; else after ``admit_wait`` iterations. None: no
        request waits for a free slot."""
        free = self._slots.count(None) + ending if self._waiting else 0  # nothing waits: no count a step
        if not free:
            return None
        running = [r for r in self._slots if r is not None]
        # a prefill step's worth of slots, but at most an eighth of them idle: the rest keep decoding
        enough = min(self.prefill_rows, len(self._waiting), max(1, self.max_running // 8))
        return (self._deferred >= self.admit_wait or free >= enough
                or any(r.computed < r.prefill_target for r in running) or len(running) == ending)

    def _defer(self, due: bool | None) -> bool:
        """Count an iteration that leaves slots free for more to join them; whether admission is due."""
        self._deferred = 0 if due is not False else self._deferred + 1
        self._stats["admissions_deferred"] += due is False
        return bool(due)

    def _compact(self) -> list[tuple[int, int]]:
        """Move requests from slots at or past the smallest decode bucket that holds them all into
        free slots below it: a decode step runs over slots ``0..bucket-1``, so one request left in a
        high slot would keep every step at a large bucket (every padding row's attention and dense
        layers computed; padding routes to no expert). A move copies the slot's device state (rings,
        length; speculative: the drafting state) and its block-table row; the tokens are unchanged.
        Returns the moves ``(from, to)``."""
        running = sum(r is not None for r in self._slots)
        bucket = next((b for b in self.decode_buckets if b >= running), 0)
        high = [s for s in range(bucket, self.max_running) if self._slots[s] is not None]
        free = (i for i in range(bucket) if self._slots[i] is None)  # as many as `high` (running <= bucket)
        moves = list(zip(high, free))
        for src, dst in moves:
            req = self._slots[src]
            for t in self._per_slot:
                t[dst].copy_(t[src])
            self._block_table[dst] = self._block_table[src]
            self._block_table[src].zero_()
            self._slots[dst], self._slots[src], req.slot = req, None, dst
            self._table_dirty = True
        self._stats["slot_moves"] += len(moves)
        return moves

    def _ensure_pages(self, req: _Request, end: int) -> None:
        """Pages for positions ``< end`` (raises OutOfPages)."""
        while req.num_pages * self.page_size < end:
            page = self.cache.take_page()
            self._block_table[req.slot, req.num_pages] = page
            req.own.append(page)
            self._table_dirty = True

    def _reserve(self, batch, end_of):
        """Give every request of ``batch`` its pages, preempting the newest running request while
        none is free; returns the requests still running."""
        for req in sorted(batch, key=lambda r: r.arrival):
            while req.slot is not None:
                try:
                    self._ensure_pages(req, end_of(req))
                    break
                except OutOfPages:
                    victim = max((r for r in self._slots if r is not None), key=lambda r: r.arrival)
                    self._preempt(victim)
        return [r for r in batch if r.slot is not None]

    def _preempt(self, req: _Request) -> None:
        if self.spec is not None and req.generated and req.computed == req.num_tokens - 1:
            req.spec_saved = self.spec.save(req.slot)  # decoding: resume with these drafts
        self._release(req)
        self._stats["preemptions"] += 1
        self._queue(req)

    def _release(self, req: _Request) -> None:
        """Free ``req``'s slot: publish its full computed pages and snapshots, drop its references."""
        if req.slot is None:
            return
        rejected = self.cache.publish(req.tokens[: req.computed], req.pages, req.snapshots)
        for snap in rejected:
            self.cache.give_back_snapshot(snap)
        for page in req.own:
            if self.allocator.unref(page):
                self.allocator.give_back(page)
        self.cache.release(req.shared)
        self._slots[req.slot] = None
        self._block_table[req.slot].zero_()
        self._table_dirty = True
        req.slot, req.shared, req.own, req.snapshots = None, [], [], {}

    # ------------------------------------------------------------------ steps
    def _plan_prefill(self) -> list[tuple[_Request, int]]:
        todo = sorted((r for r in self._slots if r is not None and r.computed < r.prefill_target),
                      key=lambda r: r.arrival)[: self.prefill_rows]
        batch = [(r, self._chunk_len(r.prefill_target, r.computed)) for r in todo]
        ends = {r.rid: r.computed + n for r, n in batch}
        kept = self._reserve([r for r, _ in batch], lambda r: ends[r.rid])
        return [(r, n) for r, n in batch if r in kept]

    def _chunk_len(self, target: int, computed: int = 0) -> int:
        """Tokens of the next prefill chunk of a request at ``computed`` of ``target`` positions:
        ``prefill_chunk``, up to the end; with a prefix cache, a chunk of several pages also ends at
        the prompt's last page boundary, so that a later request with the same prompt hits it there,
        as with chunks of one page."""
        n = min(self.prefill_chunk, target - computed)
        last = (target - 1) // self.page_size * self.page_size
        return last - computed if self._cut_last_page and computed < last < computed + n else n

    def _cuts_at(self, req: _Request, depth: int) -> bool:
        """Whether a cold run of ``req``'s prompt ends a chunk ``depth`` pages in (a chunk multiple
        or the prompt's last page boundary): where a prefix hit may resume it exactly."""
        return depth % self._snap_pages == 0 or depth == (req.prefill_target - 1) // self.page_size

    def _sync_table(self) -> None:
        if self._table_dirty:
            self.pool.block_table.copy_(self._block_table, non_blocking=True)
            self._table_dirty = False

    def _params(self, rows: list[_Request | None]) -> tuple[SamplingParams, bool, torch.Tensor]:
        """The sampling settings of each row (``None``: a greedy padding row), ``filtered``, and
        which rows hold a request (``[rows] int32``, a decode step's ``n_new``); the same rows as
        a recent step's reuse its tensors (a steady decode batch copies none)."""
        key = tuple(r.rid if r else -1 for r in rows)
        if key in self._params_made:
            return self._params_made[key]
        reqs = [r for r in rows if r is not None]
        cols = (([r.temperature if r else 0.0 for r in rows], torch.float32),
                ([r.top_k if r else 0 for r in rows], torch.int64),
                ([r.top_p if r else 1.0 for r in rows], torch.float32),
                ([r.seed if r else 0 for r in rows], torch.int64),
                ([int(r is not None) for r in rows], torch.int32))
        *params, held = (to_device(torch.tensor(v, dtype=d), self.device) for v, d in cols)
        filtered = any(r.temperature > 0 and (r.top_k > 0 or r.top_p < 1) for r in reqs)
        if len(self._params_made) >= 8:  # the row sets of the last few steps (prefill, decode)
            self._params_made.clear()
        self._params_made[key] = made = SamplingParams(*params), filtered, held
        return made

    def _run_prefill(self, batch: list[tuple[_Request, int]]) -> torch.Tensor:
        bucket = next(b for b in self.prefill_buckets if b >= len(batch))
        C = next(w for w in self.prefill_widths if w >= max(n for _, n in batch))
        ids = torch.zeros(bucket, C, dtype=torch.long)
        rows = torch.full((bucket,), self.max_running, dtype=torch.long)  # padding: the dummy slot
        n_new = torch.zeros(bucket, dtype=torch.int32)
        starts = torch.zeros(bucket, dtype=torch.bool)  # speculative: the prompt ends, drafting starts
        for i, (r, n) in enumerate(batch):
            ids[i, :n] = torch.tensor(r.token_range(r.computed, r.computed + n))
            rows[i], n_new[i] = r.slot, n
            starts[i] = not r.generated and r.computed + n == r.prefill_target
        params, filtered, _ = self._params([r for r, _ in batch] + [None] * (bucket - len(batch)))
        self._sync_table()
        args = [to_device(t, self.device) for t in (ids, rows, n_new, *([starts] if self.spec is not None else []))]
        tokens, _ = self._run("prefill", (bucket, C), filtered, *args, params)
        self._stats["prefill_steps"] += 1
        return tokens

    def _run_decode(self, batch: list[_Request], ids: torch.Tensor | None = None) -> torch.Tensor:
        """The decode step over slots ``0..bucket-1`` -> tokens ``[bucket, 1]`` (speculative:
        ``[bucket, k+1]``, ``-1`` after each row's emitted ones); row = slot. ``ids``: the input
        tokens on the device (a wider step's sampled tokens, row = slot), else each request's last."""
        top = max(r.slot for r in batch) + 1
        bucket = next(b for b in self.decode_buckets if b >= top)
        by_slot: list[_Request | None] = [None] * bucket
        for r in batch:
            by_slot[r.slot] = r
        params, filtered, n_new = self._params(by_slot)
        self._sync_table()
        self._stats["decode_steps"] += 1
        if self.spec is not None:  # the next tokens are on the device already (spec.last_tok)
            if any(r.temperature > 0 for r in batch):
                return self._run("decode_sample", bucket, filtered, n_new, params)[0]
            # greedy rows only: no distributions to compute (the tokens are the same either way)
            return self._run("decode", bucket, False, n_new)[0]
        if ids is None:
            ids = torch.zeros(bucket, 1, dtype=torch.long)
            for r in batch:
                ids[r.slot, 0] = r.generated[-1] if r.generated else r.prompt[-1]
            ids = to_device(ids, self.device)
        else:
            ids = ids[:bucket]
        tokens, _ = self._run("decode", bucket, filtered, ids, None, n_new, params)
        return tokens[:, None]

    def _fn(self, kind: str, filtered: bool):
        key = (kind, filtered)
        if key not in self._fns:
            if self.spec is None:
                fn = functools.partial(pool_step, self.model, self.pool, filtered=filtered)
            elif kind == "prefill":
                fn = functools.partial(self.spec.prefill_chunk, filtered=filtered)
            elif kind == "decode_sample":
                fn = functools.partial(self.spec.decode, filtered=filtered)
            else:  # greedy speculative decode: no sampling settings
                fn = self.spec.decode
            self._fns[key] = compile_step(fn, self.cuda_graphs) if self.compiled else fn
        return self._fns[key]

    def _run(self, kind: str, bucket: int | tuple[int, int], filtered: bool, *args):
        return self._calls.run((kind, bucket, filtered), self._fn(kind, filtered), *args)

    @property
    def _graphs(self) -> dict[tuple, int]:
        """Graphs compiled per ``(step kind, bucket, filtered)``; a prefill bucket is ``(rows, width)``."""
        return self._calls.graphs

    # ------------------------------------------------------------------ after a step
    def _advance(self, req: _Request, kind: str, item, tokens: list[int]) -> RequestOutput | None:
        """Take a step's ``tokens`` for ``req`` (a prefill row: one; a decode row: one, or the 1 to
        k+1 a speculative step emitted): append them up to a stop, advance, snapshot."""
        before = req.computed
        if kind == "prefill":
            req.computed += item[1]
            self._maybe_snapshot(req, True, before, req.computed)
            if req.computed < req.prefill_target or req.generated:
                return None  # more prompt to go, or a resumed request whose next token is known
        elif self.spec is not None:
            req.accepted += len(tokens) - 1  # the last one is verify's own token, not a draft
            req.drafted += self.spec_steps
            self._stats["accepted_tokens"] += len(tokens) - 1
            self._stats["drafted_tokens"] += self.spec_steps
        new, reason = [], None
        for tok in tokens:
            new.append(tok)
            reason = "stop" if tok in req.eos else "length" if len(req.generated) + len(new) >= req.max_new else None
            if reason is not None:
                break
        req.generated += new
        self._stats["generated_tokens"] += len(new)
        if kind == "decode":
            req.computed = req.num_tokens - 1  # every emitted token but the last was a verified input
            self._maybe_snapshot(req, False, before, before + len(tokens))
        if reason is not None:
            self._release(req)
            del self._requests[req.rid]
            self._stats["finished"] += 1
        return RequestOutput(req.rid, new, reason is not None, reason, req.cached_tokens, req.accepted, req.drafted)

    def _maybe_snapshot(self, req: _Request, prefill: bool, before: int, reached: int) -> None:
        """After a step took ``req`` from ``before`` to ``computed`` positions (``reached``: where
        the device state is, past ``computed`` when a stop cut a speculative step's tokens): if that
        passed a page boundary, save the slot's rings there when a later request may resume at it
        (in a prompt: every ``snapshot_interval`` pages and the prompt's last boundary; while
        decoding: the latest boundary only). With chunks of several pages, only boundaries where
        chunks end: multiples of ``prefill_chunk`` and the prompt's last boundary."""
        if not self.cache.enabled:
            return
        depth = req.computed // self.page_size
        H = depth * self.page_size
        if H <= before or depth in req.snapshots or depth <= len(req.shared):
            return
        if prefill:
            if H != req.computed:
                return  # a chunk of several pages ended past H: the rings hold more than H's state
            # where a chunk ends: the prompt's last boundary, for the same prompt again; the last chunk
            # multiple below it, for a longer one (a next turn); every interval
            last = (req.prefill_target - 1) // self.page_size
            kept = depth in (last, last // self._snap_pages * self._snap_pages) or depth % self.snapshot_interval == 0
            if not (kept and self._cuts_at(req, depth)):
                return
        elif depth % self._snap_pages:
            return  # a longer prompt's cold run cuts there only if it is a chunk multiple
        else:
            # speculative: h_page holds the streams at the last boundary the device state reached; the
            # MTP ring (W + k + 1 slots) still holds the window below H while the step wrote no further
            # than H + k (its draft steps reach reached + k - 2), i.e. reached <= H + 2
            if self.spec is not None and (reached // self.page_size != depth or reached > H + 2):
                return
            if req.decode_snapshot is not None:
                self.cache.give_back_snapshot(req.snapshots.pop(req.decode_snapshot))
        snap = self.cache.take_snapshot_slot()
        if snap is None:
            return
        for store, t in zip(self._snapshots, self._slot_state(restore=False)):
            store[snap].copy_(t[req.slot])
        req.snapshots[depth] = snap
        if not prefill:
            req.decode_snapshot = depth

    def _slot_state(self, restore: bool) -> list[torch.Tensor]:
        """The per-slot tensors a prefix snapshot holds, saved from (``restore=False``) or restored
        into (``restore=True``): every ring, and speculative, the MTP block's (``SpecSlots``)."""
        extra = self.spec.snapshot_tensors(restore) if self.spec is not None else []
        return self.pool.ring_tensors() + extra

    # ------------------------------------------------------------------ stats
    @property
    def stats(self) -> dict:
        """running, waiting, pages_used (held by requests or the cache) / pages_free / pages_cached,
        prefix_evictions, prefix_hit_tokens and
        prefix_hit_rate (hit tokens / prompt tokens admitted), preemptions, recompiles, graph_breaks,
        cuda_graph_replays, cuda_graph_recordings, generated_tokens, tokens_per_s (generated tokens over
        the time spent in ``step``, compiling excluded), the step counts, and with ``spec_steps > 0``
        accepted_tokens / drafted_tokens (drafts accepted / made, over every request) and their
        ratio acceptance_rate (``RequestOutput`` carries each request's own counts); early_steps (decode
        steps launched before the last one's tokens were read, ``overlap``), early_rows_dropped
        (their rows whose request had stopped: the overlap's wasted work), slot_moves (requests
        moved to a lower slot so that decode steps run at a smaller bucket) and admissions_deferred
        (iterations that left a slot free for more to join it, ``admit_wait``)."""
        s = dict(self._stats)
        s["running"] = sum(r is not None for r in self._slots)
        s["waiting"] = len(self._waiting)
        s["pages_free"] = self.allocator.num_free
        s["pages_cached"] = self.cache.cached_pages
        s["prefix_evictions"] = self.cache.evictions
        s["pages_used"] = self.allocator.num_pages - 1 - self.allocator.num_free
        s["prefix_hit_rate"] = s["prefix_hit_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else 0.0
        busy = s["busy_time_s"] - s["compile_time_s"]
        s["tokens_per_s"] = s["generated_tokens"] / busy if busy > 0 else 0.0
        s["acceptance_rate"] = s["accepted_tokens"] / s["drafted_tokens"] if s["drafted_tokens"] else 0.0
        return s
