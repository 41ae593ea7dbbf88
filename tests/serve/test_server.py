"""The OpenAI-compatible server against the engine, through the real ``openai`` client: a server
the test starts on 127.0.0.1 (port 0, bounded waits) and stops."""
import argparse
import asyncio
import json
import socket
import threading
import time
import types

import httpx2 as httpx  # the HTTP client the openai package is built on
import openai
import pytest
import uvicorn

from dsv4_ops.serve import cli
from dsv4_ops.text import Detokenizer, encode_chat_ids

KEY = "test-key"


class Server:
    def __init__(self, **overrides):
        p = argparse.ArgumentParser()
        cli.add_arguments(p)
        args = p.parse_args(["--config", "tiny", "--max-running", "4", "--max-seq-len", "256", "--api-key", KEY,
                             "--page-size", "32", "--no-compile"])
        for k, v in overrides.items():
            setattr(args, k, v)
        self.app, self.worker, self.name = cli.build(args)
        # a compiled server warms up every step shape before it reports ready: one Inductor compile each
        self.start(900 if args.compile else 120)

    def start(self, timeout_s: int):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[sock]), daemon=True)
        self.thread.start()
        deadline = time.time() + timeout_s
        while not (self.server.started and self.worker.ready.is_set()):
            assert self.worker.error is None, self.worker.error
            assert time.time() < deadline, f"the server did not start in {timeout_s} s"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, timeout=120, max_retries=0)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)
        self.worker.stop()


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.stop()


def _tok():
    from dsv4_ops import pretrained
    from dsv4_ops.text import load_tokenizer

    return load_tokenizer(pretrained.tiny())


def _engine_tokens(server, ids, n, **kw):
    """What the server's engine gives for ``ids`` (its own oracle: the engine's tokens)."""
    async def go():
        rid, q = await server.worker.submit(ids, max_new_tokens=n, **kw)
        toks = []
        while True:
            o, _ = await q.get()
            toks += o.new_token_ids
            if o.finished:
                return toks
    return asyncio.run(go())


def _text(tok, ids, eos):
    d = Detokenizer(tok)
    return "".join(d.push(t) for t in ids if t not in eos) + d.flush()


PROMPTS = ["def fibonacci(n):", "import os\n\nclass", "for i in range(10):\n    "]


def test_greedy_completions_streamed_and_not_equal_the_engines_tokens(server):
    tok = _tok()
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    for p in PROMPTS:
        ids = tok.encode(p)
        want = _engine_tokens(server, ids, 20, temperature=0.0, eos_token_id=eos or None)
        r = server.client.completions.create(model=server.name, prompt=p, max_tokens=20, temperature=0)
        assert r.choices[0].text == _text(tok, want, eos)
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want)
        assert r.choices[0].finish_reason == ("stop" if want[-1] in eos else "length")
        chunks = list(server.client.completions.create(model=server.name, prompt=p, max_tokens=20, temperature=0,
                                                       stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
        assert chunks[-1].usage.completion_tokens == len(want)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason


def test_chat_completions_use_the_v4_chat_encoding(server):
    tok = _tok()
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
    ids = encode_chat_ids(tok, messages)
    want = _engine_tokens(server, ids, 16, temperature=0.0, eos_token_id=eos or None)
    r = server.client.chat.completions.create(model=server.name, messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == _text(tok, want, eos)
    assert r.usage.prompt_tokens == len(ids)
    stream = server.client.chat.completions.create(model=server.name, messages=messages, max_tokens=16,
                                                   temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content


def _concurrent_streams_give_what_they_give_alone(server, n: int) -> None:
    prompts = [f"def f{i}(x):\n    return x" + " +" * (i % 5) for i in range(n)]
    alone = [server.client.completions.create(model=server.name, prompt=p, max_tokens=12, temperature=0.8,
                                              seed=i).choices[0].text for i, p in enumerate(prompts)]

    async def one(client, i, p):
        stream = await client.completions.create(model=server.name, prompt=p, max_tokens=12, temperature=0.8,
                                                 seed=i, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=120, max_retries=0)
        return await asyncio.gather(*(one(client, i, p) for i, p in enumerate(prompts)))

    assert asyncio.run(all_()) == alone


def test_16_concurrent_streams_each_give_what_they_give_alone(server):
    _concurrent_streams_give_what_they_give_alone(server, 16)


def test_the_engine_thread_owns_its_cuda_graph_trees_state(monkeypatch):
    """torch before 2.13 set up the CUDA-graph trees' per-thread state only on the importing thread and asserted on
    any other (pytorch#123177): the server's engine thread, which records every graph, sets up its own. Checked
    with torch 2.11's lookup, which has no lazy set-up of its own."""
    import torch
    from torch._inductor import cudagraph_trees as trees

    from dsv4_ops.serve.engine_thread import EngineThread

    def lookup_of_torch_2_11(local, attr_name):
        if hasattr(local, attr_name):
            return getattr(local, attr_name)
        assert torch._C._is_key_in_tls(attr_name)
        return torch._C._get_obj_in_tls(attr_name)

    monkeypatch.setattr(trees, "get_obj", lookup_of_torch_2_11)
    seen, idle = {}, types.SimpleNamespace(has_unfinished=lambda: False, max_running=1)
    worker = EngineThread(idle).start(lambda eng: seen.update(container=trees.get_container(0)))
    deadline = time.time() + 30
    while not (worker.ready.is_set() or worker.error is not None) and time.time() < deadline:
        time.sleep(0.01)
    worker.stop()
    assert worker.error is None and isinstance(seen["container"], trees.TreeManagerContainer)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_compiled_graphed_server_gives_concurrent_streams_what_they_give_alone():
    # one prefill width (64, two pages) for the prompts here: the warm-up compiles the step shapes of 3 decode and 3
    # prefill buckets, not those of a 256-token width no request reaches (the default doubles the prefill shapes)
    s = Server(device="cuda", compile=True, prefill_chunk=64)
    try:
        _concurrent_streams_give_what_they_give_alone(s, 8)
        stats = s.worker.engine.stats
        assert s.worker.error is None and stats["cuda_graph_replays"] > 0 and stats["recompiles"] == 0
    finally:
        s.stop()


def test_stop_strings_cut_the_text_and_finish_with_stop(server):
    r = server.client.completions.create(model=server.name, prompt="def fibonacci(n):", max_tokens=40, temperature=0)
    full = r.choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert stop.strip(), full
    cut = server.client.completions.create(model=server.name, prompt="def fibonacci(n):", max_tokens=40,
                                           temperature=0, stop=stop)
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_a_repeated_prompt_reports_cached_tokens(server):
    prompt = "# a module of helpers\n" * 8
    first = server.client.completions.create(model=server.name, prompt=prompt, max_tokens=4, temperature=0)
    again = server.client.completions.create(model=server.name, prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens > 32
    assert again.usage.prompt_tokens_details.cached_tokens >= 32
    assert again.choices[0].text == first.choices[0].text


def test_models_health_and_metrics_answer(server):
    assert [m.id for m in server.client.models.list().data] == [server.name]
    h = httpx.get(server.url + "/health", timeout=10)
    assert h.status_code == 200 and h.text == "ok"
    m = httpx.get(server.url + "/metrics", timeout=10).text
    for name in ("dsv4_requests_running", "dsv4_requests_waiting", "dsv4_tokens_per_second", "dsv4_prefix_hit_rate",
                 "dsv4_kv_pages_used", "dsv4_time_to_first_token_seconds_count", "dsv4_time_per_output_token_seconds_sum"):
        assert f"\n{name} " in "\n" + m, name


def test_a_disconnect_mid_stream_frees_the_requests_pages(server):
    eng = server.worker.engine
    with httpx.stream("POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": server.name, "prompt": "x" * 100, "max_tokens": 150, "temperature": 0,
                            "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # one chunk, then hang up
    deadline = time.time() + 60
    while server.worker.open_requests or eng.stats["running"]:
        assert time.time() < deadline, "the aborted request still holds its slot"
        time.sleep(0.05)
    eng_pages_held = eng.allocator.num_pages - 1 - eng.allocator.num_free - eng.cache.cached_pages
    assert eng_pages_held == 0 and eng.stats["aborted"] >= 1


def _post(server, path, body, key=KEY, raw=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = raw if raw is not None else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={**headers, "Content-Type": "application/json"},
                      timeout=30)


@pytest.mark.parametrize("body, raw, key, status, param", [
    (None, "{not json", KEY, 400, None),
    ({"model": "gpt-4", "prompt": "hi"}, None, KEY, 404, "model"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 0}, None, KEY, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 300}, None, KEY, 400, "max_tokens"),
    ({"model": "tiny", "prompt": list(range(10, 250)) * 2}, None, KEY, 400, "prompt"),
    ({"model": "tiny", "prompt": "hi", "temperature": -1}, None, KEY, 400, "temperature"),
    ({"model": "tiny", "prompt": "hi", "top_p": 0}, None, KEY, 400, "top_p"),
    ({"model": "tiny", "prompt": "hi", "n": 2}, None, KEY, 400, "n"),
    ({"model": "tiny", "prompt": [1, 99999]}, None, KEY, 400, "prompt"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, None, KEY, 400, "messages"),
    ({"model": "tiny", "prompt": "hi"}, None, "wrong-key", 401, None),
    ({"model": "tiny", "prompt": "hi"}, None, None, 401, None),
])
def test_bad_requests_get_a_4xx_naming_the_field_and_the_server_keeps_serving(server, body, raw, key, status, param):
    path = "/v1/chat/completions" if body and "messages" in body else "/v1/completions"
    r = _post(server, path, body, key, raw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]
    ok = server.client.completions.create(model=server.name, prompt="def f():", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_a_flood_past_the_queue_gets_503_and_nothing_crashes():
    s = Server(max_waiting=2, max_running=1)
    try:
        async def flood():
            async with httpx.AsyncClient(timeout=120) as c:
                async def one(i):
                    return await c.post(s.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                                        json={"model": s.name, "prompt": f"x{i}", "max_tokens": 30, "temperature": 0})
                return await asyncio.gather(*(one(i) for i in range(12)))

        codes = [r.status_code for r in asyncio.run(flood())]
        assert codes.count(200) >= 3 and codes.count(503) >= 1 and set(codes) <= {200, 503}
        r = s.client.completions.create(model=s.name, prompt="def f():", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens >= 1
    finally:
        s.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the injected failure, re-raised
def test_an_engine_failure_ends_open_streams_with_an_error_event_and_health_says_so():
    """The engine thread dying mid-stream (a CUDA error, say): each open stream ends with an OpenAI-style error event
    and ``[DONE]`` (its status line is sent already), not a dropped connection; /health says why; the server answers
    new requests with 503 and stays up."""
    s = Server()
    try:
        step, calls = s.worker.engine.step, []

        def failing_step():
            calls.append(1)
            if len(calls) > 3:
                raise RuntimeError("injected engine failure")
            return step()

        s.worker.engine.step = failing_step
        body = {"model": s.name, "prompt": "def f(x):", "max_tokens": 40, "temperature": 0, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=60) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "injected engine failure" in error["message"] and error["type"] == "server_error"
        health = httpx.get(s.url + "/health", timeout=10)
        assert health.status_code == 503 and "injected engine failure" in health.text
        again = httpx.post(s.url + "/v1/completions", json=dict(body, stream=False),
                           headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        assert again.status_code == 503 and again.json()["error"]["type"] == "server_error"
    finally:
        s.stop()


def _benchmarks():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` is a package at the repo root
    import benchmarks

    return benchmarks


def test_bench_serve_measures_a_random_and_a_shared_prefix_load(server, tmp_path):
    import math

    _benchmarks()
    from benchmarks import bench_serve

    common = ["--url", server.url, "--model", server.name, "--api-key", KEY, "--num-requests", "8", "--vocab", "200",
              "--input-len", "4", "20", "--output-len", "2", "6", "--concurrency", "1", "4"]
    for workload in ("random", "shared-prefix"):
        out = tmp_path / f"{workload}.json"
        assert bench_serve.main(common + ["--workload", workload, "--prefix-len", "70", "--out", str(out)]) == 0
        rows = json.loads(out.read_text())["rows"]
        assert [r["concurrency"] for r in rows] == [1, 4]
        for r in rows:
            assert r["failed"] == 0 and r["output_throughput"] > 0
            assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p99_ms"))
            assert r["ttft_p99_ms"] >= r["ttft_p50_ms"]
        if workload == "shared-prefix":  # 70 shared tokens: at concurrency 1, all but the first of the level's
            assert rows[0]["mean_cached_tokens"] >= 64 * 7 / 8  # requests take two full 32-position pages cached


def test_serve_random_serves_a_random_weight_model_to_bench_serve(tmp_path):
    """``benchmarks/serve_random.py`` (the GPU serving benchmark's server, random weights and an id tokenizer): its
    engine's timed batch-1 step is written, and bench_serve's requests all complete with exact output lengths."""
    _benchmarks()
    from benchmarks import bench_serve, serve_random

    step = tmp_path / "step.json"
    s = Server.__new__(Server)
    s.app, s.worker, s.name = serve_random.build(serve_random.parse_args(
        ["--smoke", "--device", "cpu", "--max-running", "2", "--step-out", str(step)]))
    try:
        s.start(120)
        data = json.loads(step.read_text())
        assert data["engine_step_ms"] > 0 and data["stats"]["recompiles"] == 0 and data["context"] == 32
        out = tmp_path / "serve.json"
        assert bench_serve.main(["--url", s.url, "--model", s.name, "--num-requests", "4", "--vocab", "200",
                                 "--input-len", "4", "20", "--output-len", "3", "3", "--concurrency", "2",
                                 "--out", str(out)]) == 0
        row = json.loads(out.read_text())["rows"][0]
        assert row["failed"] == 0 and row["output_throughput"] == pytest.approx(4 * 3 / row["duration_s"])
    finally:
        s.stop()


def test_a_bad_engine_setting_stops_the_server_before_it_starts_naming_the_setting():
    from dsv4_ops.text.generate_cli import UsageError

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(["--config", "tiny", "--page-size", "32", "--prefill-chunk", "48", "--no-compile"])
    with pytest.raises(UsageError, match=r"prefill_chunk=48 must divide page_size=32 or be a multiple of it"):
        cli.build(args)
