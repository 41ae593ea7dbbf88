"""An OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn; the engine on its own thread).

Endpoints: ``/v1/completions`` and ``/v1/chat/completions`` (``stream=true``: server-sent events,
``stream_options.include_usage``), ``/v1/models``, ``/health`` (503 until warm-up is done),
``/metrics`` (Prometheus text). Fields: ``max_tokens``, ``temperature`` (default 1, as OpenAI's),
``top_p``, ``top_k`` (an extension), ``seed``, ``stop`` (a string or up to 4), ``n`` (1 only),
``usage`` with ``prompt_tokens_details.cached_tokens``, ``finish_reason`` (``"stop"`` at an eos
token or stop string, ``"length"`` at ``max_tokens``). Chat requests take ``thinking`` (an
extension: the V4 chat format's thinking mode). Bad requests get a 4xx with an OpenAI-style body
naming the field; a client that disconnects aborts its request; past the waiting queue, 503 with
``Retry-After``.
"""
from __future__ import annotations

import json
import time
import uuid
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..text import Detokenizer, StopStrings, encode_chat_ids
from .engine_thread import EngineThread, Overloaded

__all__ = ["create_app", "ApiError"]

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.headers = status, message, param, type_, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": None}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class _Histogram:
    def __init__(self, name: str, buckets) -> None:
        self.name, self.buckets = name, buckets
        self.counts, self.sum, self.n = [0] * len(buckets), 0.0, 0

    def observe(self, v: float) -> None:
        self.n += 1
        self.sum += v
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1

    def text(self) -> list[str]:
        lines = [f"# TYPE {self.name} histogram"]
        lines += [f'{self.name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return lines + [f'{self.name}_bucket{{le="+Inf"}} {self.n}', f"{self.name}_sum {self.sum}",
                        f"{self.name}_count {self.n}"]


def _number(body: dict, name: str, default, lo=None, hi=None, integer: bool = False, lo_open: bool = False):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not float(v).is_integer()):
        raise ApiError(400, f"'{name}' must be {'an integer' if integer else 'a number'}, got {v!r}", name)
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        rng = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}]"
        raise ApiError(400, f"'{name}' = {v!r} is outside {rng}", name)
    return int(v) if integer else float(v)


def create_app(worker: EngineThread, tokenizer, model_name: str, eos_ids: list[int], api_key: str | None = None
               ) -> FastAPI:
    """The FastAPI app over a started :class:`EngineThread`."""
    app = FastAPI(title="dsv4_ops", docs_url=None, redoc_url=None)
    eng = worker.engine
    ttft, tpot = _Histogram("dsv4_time_to_first_token_seconds", TTFT_BUCKETS_S), _Histogram(
        "dsv4_time_per_output_token_seconds", TPOT_BUCKETS_S)
    totals = {"requests": 0, "completion_tokens": 0, "prompt_tokens": 0}

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return e.response()

    def check_auth(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)", None, "authentication_error")

    async def body_of(request: Request) -> dict:
        check_auth(request)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model != model_name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {model_name!r}", "model",
                           "not_found_error")
        if not worker.ready.is_set():
            raise ApiError(503, "the engine is not ready", None, "server_error", {"Retry-After": "1"})
        return body

    def sampling(body: dict, n_prompt: int) -> tuple[dict, list[str], bool, bool]:
        if _number(body, "n", 1, 1, 1, integer=True) != 1:
            raise ApiError(400, "'n' must be 1", "n")
        room = eng.max_seq_len - n_prompt + 1
        if room < 1:
            raise ApiError(400, f"the prompt has {n_prompt} tokens; this server's max_seq_len is {eng.max_seq_len}",
                           "messages" if "messages" in body else "prompt")
        max_tokens = _number(body, "max_tokens", min(16, room), 1, None, integer=True)
        max_tokens = _number(body, "max_completion_tokens", max_tokens, 1, None, integer=True)
        if max_tokens > room:
            raise ApiError(400, f"'max_tokens' = {max_tokens}: prompt ({n_prompt} tokens) + max_tokens - 1 exceeds "
                           f"max_seq_len {eng.max_seq_len} (at most {room})", "max_tokens")
        kw = dict(max_new_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, 0, 2),
                  top_p=_number(body, "top_p", 1.0, 0, 1, lo_open=True), top_k=_number(body, "top_k", 0, 0, None, True),
                  seed=_number(body, "seed", None, 0, 2**63 - 1, integer=True), eos_token_id=eos_ids or None)
        if kw["top_k"] == -1:
            kw["top_k"] = 0
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise ApiError(400, "'stop' must be a non-empty string or a list of up to 4 of them", "stop")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be true or false", "stream")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise ApiError(400, "'stream_options' must be an object", "stream_options")
        return kw, stop, stream, bool(opts.get("include_usage", False))

    async def run(request: Request, ids: list[int], body: dict, chat: bool):
        kw, stop, stream, include_usage = sampling(body, len(ids))
        try:
            rid, outputs = await worker.submit(ids, **kw)
        except Overloaded as e:
            raise ApiError(503, f"the server is overloaded ({e}); retry later", None, "server_error",
                           {"Retry-After": "1"}) from None
        except ValueError as e:
            raise ApiError(400, str(e), "messages" if chat else "prompt") from None
        totals["requests"] += 1
        totals["prompt_tokens"] += len(ids)
        oid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        state = dict(tokens=0, cached=0, finish=None)
        detok, stops = Detokenizer(tokenizer), StopStrings(stop) if stop else None
        t0 = time.perf_counter()

        def text_of(o) -> str:
            """The text of ``o``'s new tokens (eos not shown), cut at a stop string."""
            text = ""
            for tok in o.new_token_ids:
                state["tokens"] += 1
                if tok in eos_ids:
                    continue
                delta = detok.push(tok)
                if stops is not None:
                    delta, hit = stops.push(delta)
                    if hit:
                        state["finish"] = "stop"
                        worker.abort(rid)
                        return text + delta
                text += delta
            if o.finished:
                state["finish"] = "stop" if o.finish_reason == "stop" else "length"
                tail = detok.flush()
                if stops is not None:
                    tail, hit = stops.push(tail)
                    tail += "" if hit else stops.flush()
                text += tail
            return text

        async def deltas():
            last = None
            while state["finish"] is None:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise ApiError(500, f"the engine failed: {item}", None, "server_error")
                o, t = item
                state["cached"] = o.cached_tokens
                if last is None and o.new_token_ids:
                    ttft.observe(t - t0)
                elif o.new_token_ids:
                    tpot.observe((t - last) / len(o.new_token_ids))
                last = t if o.new_token_ids else last
                text = text_of(o)
                if o.finish_reason == "abort" and state["finish"] is None:
                    state["finish"] = "stop"
                if text or state["finish"]:
                    yield text

        def usage() -> dict:
            return {"prompt_tokens": len(ids), "completion_tokens": state["tokens"],
                    "total_tokens": len(ids) + state["tokens"],
                    "prompt_tokens_details": {"cached_tokens": state["cached"]}}

        def choice(text: str, final: bool, streaming: bool) -> dict:
            finish = state["finish"] if final else None
            if not chat:
                return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            key = "delta" if streaming else "message"
            return {"index": 0, key: {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}

        def obj(choices, usage_=None) -> dict:
            out = {"id": oid, "object": ("chat.completion" if chat else "text_completion") + (
                ".chunk" if stream and chat else ""), "created": created, "model": model_name, "choices": choices}
            if usage_ is not None or not stream:
                out["usage"] = usage_
            return out

        if not stream:
            try:
                text = "".join([t async for t in deltas()])
            finally:
                if state["finish"] is None:
                    worker.abort(rid)
            totals["completion_tokens"] += state["tokens"]
            return JSONResponse(obj([choice(text, True, False)], usage()))

        async def events():
            try:
                try:
                    async for text in deltas():
                        yield f"data: {json.dumps(obj([choice(text, state['finish'] is not None, True)]))}\n\n"
                    if include_usage:
                        yield f"data: {json.dumps(obj([], usage()))}\n\n"
                except ApiError as e:  # the status line is sent already: the error is the stream's last event
                    yield f"data: {json.dumps(e.body())}\n\n"
                yield "data: [DONE]\n\n"
            finally:  # a client that went away: its request stops and frees its pages
                if state["finish"] is None:
                    worker.abort(rid)
                totals["completion_tokens"] += state["tokens"]

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = prompt
        else:
            raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids (one prompt)", "prompt")
        if not ids:
            raise ApiError(400, "'prompt' encodes to no tokens", "prompt")
        return await run(request, ids, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await body_of(request)
        thinking = body.get("thinking", False)
        if not isinstance(thinking, bool):
            raise ApiError(400, "'thinking' must be true or false", "thinking")
        try:
            ids = encode_chat_ids(tokenizer, body.get("messages"), thinking=thinking)
        except (ValueError, TypeError) as e:
            raise ApiError(400, f"'messages': {e}", "messages") from None
        return await run(request, ids, body, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "dsv4_ops",
                                            "max_model_len": eng.max_seq_len}]}

    @app.get("/health")
    async def health():
        if worker.error is not None:
            return PlainTextResponse(f"engine failed: {worker.error}", status_code=503)
        return PlainTextResponse("ok" if worker.ready.is_set() else "warming up",
                                 status_code=200 if worker.ready.is_set() else 503)

    @app.get("/metrics")
    async def metrics():
        s = eng.stats
        lines = []
        for name, value, kind in (
                ("dsv4_requests_running", s["running"], "gauge"), ("dsv4_requests_waiting", s["waiting"], "gauge"),
                ("dsv4_requests_open", worker.open_requests, "gauge"),
                ("dsv4_requests_total", totals["requests"], "counter"),
                ("dsv4_prompt_tokens_total", totals["prompt_tokens"], "counter"),
                ("dsv4_generated_tokens_total", s["generated_tokens"], "counter"),
                ("dsv4_tokens_per_second", s["tokens_per_s"], "gauge"),
                ("dsv4_prefix_hit_rate", s["prefix_hit_rate"], "gauge"),
                ("dsv4_prefix_hit_tokens_total", s["prefix_hit_tokens"], "counter"),
                ("dsv4_kv_pages_used", s["pages_used"], "gauge"), ("dsv4_kv_pages_free", s["pages_free"], "gauge"),
                ("dsv4_preemptions_total", s["preemptions"], "counter"),
                ("dsv4_spec_acceptance_rate", s["acceptance_rate"], "gauge"),
                ("dsv4_recompiles", s["recompiles"], "gauge")):
            lines += [f"# TYPE {name} {kind}", f"{name} {value}"]
        lines += ttft.text() + tpot.text()
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    return app


def serve_forever(app, host: str, port: int) -> None:
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="warning")
