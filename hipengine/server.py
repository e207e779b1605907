"""OpenAI-compatible HTTP server: a thin shell over ``Engine`` (``hipengine serve``).

Batch 1 by design: one engine worker thread decodes one request at a time; the others wait in a bounded
FIFO (``--max-queue``), and a full queue answers 429 with ``Retry-After``. A client that disconnects sets
its request's ``cancel`` event, which the engine checks between tokens, so an abandoned stream stops
costing decode time within one token; a request abandoned while still queued never reaches the engine.

Endpoints: POST /v1/completions, POST /v1/chat/completions (``stream`` = server-sent events in OpenAI's
chunk format, ending with ``data: [DONE]``), GET /v1/models, GET /health, GET /metrics (Prometheus).
Every error body is OpenAI's ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import asyncio
import collections
import hmac
import json
import logging
import math
import os
import socket
import sys
import threading
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import HipEngineError, RequestError
from .metrics import Metrics
from .sampling import make_params

log = logging.getLogger("hipengine.server")

DEFAULT_MAX_QUEUE = 8
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: ~250K tokens of text, far beyond any context we serve
MAX_STOP_SEQUENCES = 4  # OpenAI's limit


# ---- errors -------------------------------------------------------------------------------------------

class ApiError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _reject_constant(name: str):
    # Python's json accepts NaN and Infinity, which are not JSON; a NaN temperature must not reach sampling.
    raise ValueError(f"{name} is not valid JSON")


def _bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _from_validation(e: ValidationError) -> ApiError:
    """Pydantic's errors -> one OpenAI-style message naming the first offending field."""
    errs = e.errors()
    first = errs[0]
    loc = first.get("loc", ())
    field = str(loc[0]) if loc else None
    if first["type"] == "extra_forbidden":
        path = ".".join(str(p) for p in loc)
        return ApiError(400, f"unrecognized request argument supplied: {path}", param=path,
                        code="unknown_parameter")
    # A union (e.g. prompt: str | list[int]) reports one error per alternative, with the alternative's type
    # name inside ``loc``; the full path would be noise, so name the field and say what it must be.
    same_field = [x for x in errs if x.get("loc", ())[:1] == loc[:1]]
    if len(same_field) > 1:
        return ApiError(400, f"invalid type for '{field}': {_UNION_HINTS.get(field, first['msg'])}",
                        param=field, code="invalid_type")
    path = ".".join(str(p) for p in loc) or None
    kind = "invalid_type" if first["type"].endswith("_type") or first["type"] == "literal_error" else "invalid_value"
    what = "missing required parameter" if first["type"] == "missing" else f"invalid value for '{path}'"
    if first["type"] == "missing":
        return ApiError(400, f"{what}: '{path}'", param=path, code="missing_required_parameter")
    return ApiError(400, f"{what}: {first['msg']}", param=path, code=kind)


_UNION_HINTS = {
    "prompt": "expected a string, an array of strings, an array of token ids or an array of token-id arrays",
    "stop": "expected a string or an array of strings",
    "content": "expected a string or an array of text parts",
}


# ---- request schemas (strict: a string where a number belongs is an error, not a coercion) -------------

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    # Extensions beyond OpenAI (vLLM spells them the same), sent by clients through ``extra_body``.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    # "developer" is OpenAI's newer name for "system"; tool / function messages need tool calling (unsupported).
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


# OpenAI parameters we know and do not implement: rejected by name rather than as "unrecognized", so the
# user learns it is a missing feature and not a typo. Harmless values (null, false, empty) pass.
_UNSUPPORTED_CHAT = ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call",
                     "response_format", "modalities", "audio", "prediction", "store", "metadata",
                     "reasoning_effort", "service_tier", "web_search_options")


# ---- the engine worker ---------------------------------------------------------------------------------

def _new_stats():
    from .engine import GenerationStats

    return GenerationStats()


class Job:
    """One request's trip through the engine. Events go from the worker thread to the request's event loop."""

    def __init__(self, request_id: str, kind: str, prompt, sampling: dict, loop: asyncio.AbstractEventLoop, stats):
        self.id = request_id
        self.kind, self.prompt, self.sampling, self.stats = kind, prompt, sampling, stats
        self.cancel = threading.Event()
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.t_arrival = time.perf_counter()
        self.created = int(time.time())
        self.t_start: float | None = None  # left the queue
        self.t_first: float | None = None  # first text piece
        self.error: BaseException | None = None
        self.stream = False
        self.include_usage = False

    def post(self, event: tuple) -> None:
        """Called from the worker thread; the loop may be gone if the server is shutting down."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            self.cancel.set()


class QueueFull(Exception):
    pass


class EngineWorker:
    """One thread owns the engine; jobs wait in a bounded FIFO. ``depth`` counts waiting jobs only."""

    def __init__(self, engine, max_queue: int, metrics: Metrics):
        self.engine, self.max_queue, self.metrics = engine, max_queue, metrics
        self._waiting: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._running: Job | None = None
        self._stopping = False
        self._service_s = collections.deque(maxlen=16)  # recent engine times, for Retry-After
        self._thread = threading.Thread(target=self._loop, name="hipengine-engine", daemon=True)

    # event-loop side
    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def depth(self) -> int:
        return len(self._waiting)

    def running(self) -> int:
        return int(self._running is not None)

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stopping:
                raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")
            # An idle engine takes the next job at once, so it holds one more than --max-queue
            # (--max-queue 0 then means: serve one request, refuse any other while it runs).
            if len(self._waiting) >= self.max_queue + (self._running is None):
                raise QueueFull()
            self._waiting.append(job)
            self._cv.notify()

    def abandon(self, job: Job) -> None:
        """The client is gone: stop its generation at the next token, or drop it from the queue."""
        job.cancel.set()
        with self._cv:
            try:
                self._waiting.remove(job)
            except ValueError:
                return  # already running (the cancel event stops it) or finished
        job.post(("end", None))

    def retry_after_s(self) -> int:
        """Seconds until a queue slot is likely free: one recent service time, at least 1."""
        recent = list(self._service_s)
        est = sum(recent) / len(recent) if recent else 1.0
        return max(1, min(60, math.ceil(est)))

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            pending = list(self._waiting)
            self._waiting.clear()
            running = self._running
            self._cv.notify_all()
        for job in pending:
            job.cancel.set()
            job.post(("error", ApiError(503, "the server is shutting down", type="server_error",
                                        code="shutting_down")))
        if running is not None:
            running.cancel.set()
        self._thread.join(timeout)

    # worker-thread side
    def _take(self) -> Job | None:
        with self._cv:
            while not self._waiting and not self._stopping:
                self._cv.wait()
            if self._stopping:
                return None
            job = self._waiting.popleft()
            self._running = job
            return job

    def _loop(self) -> None:
        while True:
            job = self._take()
            if job is None:
                return
            try:
                self._run(job)
            finally:
                with self._cv:
                    self._running = None

    def _run(self, job: Job) -> None:
        job.t_start = time.perf_counter()
        self.metrics.queue_wait.observe(job.t_start - job.t_arrival)
        last = None
        try:
            if not job.cancel.is_set():
                for piece in self.engine.stream(job.prompt, cancel=job.cancel, stats=job.stats, **job.sampling):
                    if not piece:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        job.t_first = now
                    else:
                        self.metrics.itl.observe(now - last)
                    last = now
                    job.post(("piece", piece))
            job.post(("end", None))
        except HipEngineError as e:
            job.post(("error", e))
        except Exception as e:  # a bug in the engine: the request fails, the server keeps serving
            log.exception("engine failed on request %s", job.id)
            job.post(("error", e))
        finally:
            self._service_s.append(time.perf_counter() - job.t_start)


# ---- the app -------------------------------------------------------------------------------------------

class Server:
    """State shared by the routes: engine, worker, metrics, limits. ``create_app`` wires it into FastAPI."""

    def __init__(self, engine, *, model_name: str | None = None, api_key: str | None = None,
                 max_queue: int = DEFAULT_MAX_QUEUE, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        if max_queue < 0:
            raise RequestError(f"--max-queue must be >= 0, got {max_queue}")
        self.engine = engine
        self.model_name = model_name or getattr(engine, "model_name", None) or "hipengine"
        self.api_key = api_key or None
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self.metrics = Metrics(queue_depth=lambda: self.worker.depth(), running=lambda: self.worker.running())
        self.worker = EngineWorker(engine, max_queue, self.metrics)

    @property
    def max_context(self) -> int | None:
        backend = getattr(self.engine, "backend", None)
        return getattr(backend, "max_context", None) or getattr(self.engine, "max_context", None)

    # -- request plumbing --
    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        # compare_digest: the time taken must not reveal how much of the key matched
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key")

    async def read_json(self, request: Request) -> dict:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {self.max_body_bytes}",
                           code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():  # chunked uploads carry no length: count as they arrive
            body += chunk
            if len(body) > self.max_body_bytes:
                raise ApiError(413, f"request body exceeds the limit of {self.max_body_bytes} bytes",
                               code="request_too_large")
        try:
            data = json.loads(body, parse_constant=_reject_constant)
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
            raise ApiError(400, f"could not parse the request body as JSON: {e}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        return data

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def prompt_ids(self, prompt, param: str) -> list[int]:
        """The exact ids the engine will prefill (so the context check and ``usage`` agree with it)."""
        try:
            if param == "messages":
                return self.engine.chat_ids(prompt)
            return self.engine.encode_prompt(prompt)
        except RequestError as e:
            code = "context_length_exceeded" if "context" in str(e) else "invalid_value"
            raise _bad(str(e), param, code) from None
        except HipEngineError as e:  # e.g. a broken chat template in the model file
            raise _bad(f"cannot tokenize the {param}: {e}", param) from None

    def sampling(self, req: _Sampling, ids: list[int], *, default_max_tokens: int | None) -> dict:
        """OpenAI parameters -> engine sampling kwargs, rejecting what we do not implement by name."""
        if req.n not in (None, 1):
            raise _bad("only n=1 is supported (hipengine decodes one sequence per request)", "n", "unsupported_value")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(req, name)
            if v not in (None, 0, 0.0):
                raise _bad(f"{name} is not supported (only 0); use repetition_penalty instead", name,
                           "unsupported_value")
        if req.logit_bias:
            raise _bad("logit_bias is not supported", "logit_bias", "unsupported_parameter")
        if req.temperature is not None and not (0.0 <= req.temperature <= 2.0):  # OpenAI's range
            raise _bad(f"temperature must be between 0 and 2, got {req.temperature}", "temperature")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > MAX_STOP_SEQUENCES:
            raise _bad(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stop)}", "stop")
        if any(s == "" for s in stop):
            raise _bad("stop sequences must not be empty strings", "stop")

        newer = getattr(req, "max_completion_tokens", None)  # chat's newer spelling wins when both are given
        max_tokens, param = (newer, "max_completion_tokens") if newer is not None else (req.max_tokens, "max_tokens")
        if max_tokens is not None and max_tokens < 1:
            raise _bad(f"{param} must be at least 1, got {max_tokens}", param)
        ctx, n_prompt = self.max_context, len(ids)
        if ctx is not None:
            if max_tokens is not None and max_tokens > ctx:
                raise _bad(f"{param}={max_tokens} exceeds the model's context of {ctx} tokens", param,
                           "context_length_exceeded")
            if n_prompt >= ctx:
                raise _bad(f"the prompt has {n_prompt} tokens and fills the context of {ctx}: no room to "
                           "generate", "messages" if isinstance(req, ChatRequest) else "prompt",
                           "context_length_exceeded")
            if max_tokens is not None and n_prompt + max_tokens > ctx:
                raise _bad(f"prompt ({n_prompt} tokens) + {param} ({max_tokens}) exceeds the context of "
                           f"{ctx} tokens; lower {param}", param, "context_length_exceeded")
            if max_tokens is None and default_max_tokens is None:
                max_tokens = ctx - n_prompt  # OpenAI chat default: as much as the context allows
        if max_tokens is None:
            max_tokens = default_max_tokens
        kw: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": 1.0 if req.temperature is None else float(req.temperature),  # OpenAI's default
            "top_p": req.top_p, "seed": req.seed, "top_k": req.top_k, "min_p": req.min_p,
            "repetition_penalty": req.repetition_penalty, "ignore_eos": req.ignore_eos,
            "stop": tuple(stop) if stop else None,
        }
        kw = {k: v for k, v in kw.items() if v is not None}
        # The engine's own range checks, run now so a bad value is a 400 before queueing; its messages
        # begin with the field's name, which becomes ``param``.
        try:
            make_params(**kw)
        except RequestError as e:
            field = str(e).split(" ", 1)[0]
            raise _bad(str(e), field if field in kw else None) from None
        return kw

    # -- lifecycle of one generation request --
    def record(self, endpoint: str, job: Job | None, status: int, request_id: str | None = None,
               reason: str | None = None) -> None:
        """The one structured log line per request, and the metrics of its outcome."""
        self.metrics.requests.inc(endpoint=endpoint, status=str(status))
        line: dict[str, Any] = {"event": "request", "id": request_id or (job.id if job else None),
                                "endpoint": endpoint, "status": status}
        if job is not None:
            st = job.stats
            reason = reason or getattr(st, "finish_reason", None) or ("error" if job.error else None)
            pt, ot = getattr(st, "prompt_tokens", None), getattr(st, "output_tokens", None)
            ttft = (job.t_first - job.t_arrival) if job.t_first else None
            toks = getattr(st, "decode_tok_s", None)
            line.update({"prompt_tokens": pt, "output_tokens": ot,
                         "ttft_ms": round(ttft * 1e3, 2) if ttft is not None else None,
                         "tok_s": round(toks, 2) if toks else None,
                         "queue_ms": round((job.t_start - job.t_arrival) * 1e3, 2) if job.t_start else None,
                         "total_ms": round((time.perf_counter() - job.t_arrival) * 1e3, 2),
                         "finish_reason": reason})
            if job.t_start is not None:  # it reached the engine
                self.metrics.finished.inc(reason=reason or "error")
                if ttft is not None:
                    self.metrics.ttft.observe(ttft)
                if toks:
                    self.metrics.decode_tok_s.observe(toks)
                if pt:
                    self.metrics.prompt_tokens.inc(pt)
                if ot:
                    self.metrics.output_tokens.inc(ot)
        elif reason:
            line["error"] = reason
        log.info(json.dumps(line))

    def submit(self, job: Job) -> None:
        try:
            self.worker.submit(job)
        except QueueFull:
            wait = self.worker.retry_after_s()
            raise ApiError(429, f"the server is busy: one request is decoding and the queue is full "
                                f"(--max-queue {self.worker.max_queue}); retry in about {wait} s",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": str(wait)}) from None


def _error_for(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestError):
        return ApiError(400, str(exc), code="invalid_value")
    if isinstance(exc, HipEngineError):
        return ApiError(500, str(exc), type="server_error", code=type(exc).__name__)
    return ApiError(500, "internal error in the engine; see the server log", type="server_error",
                    code="internal_error")


async def _watch_disconnect(request: Request, server: Server, job: Job) -> None:
    """Until cancelled: wait for the client to go away, then abandon its job. The body has been read, so
    the next ASGI message can only be ``http.disconnect``."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            server.worker.abandon(job)
            return


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _usage(stats) -> dict:
    pt, ot = int(stats.prompt_tokens or 0), int(stats.output_tokens or 0)
    return {"prompt_tokens": pt, "completion_tokens": ot, "total_tokens": pt + ot}


def create_app(engine, *, model_name: str | None = None, api_key: str | None = None,
               max_queue: int = DEFAULT_MAX_QUEUE, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app serving ``engine``. The engine worker thread lives for the app's lifespan."""
    server = Server(engine, model_name=model_name, api_key=api_key, max_queue=max_queue,
                    max_body_bytes=max_body_bytes)

    @asynccontextmanager
    async def lifespan(app):
        server.worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.worker.stop)

    app = FastAPI(title="hipengine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                        code=kind).response()

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return ApiError(500, "internal server error; see the server log", type="server_error",
                        code="internal_error").response()

    @app.get("/health")
    async def health():
        ok = server.worker.alive()
        body = {"status": "ok" if ok else "unavailable", "model": server.model_name,
                "queue_depth": server.worker.depth(), "running": server.worker.running()}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=Metrics.CONTENT_TYPE)

    def model_card() -> dict:
        return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "hipengine",
                "max_model_len": server.max_context}

    @app.get("/v1/models")
    async def list_models(request: Request):
        server.check_auth(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request):
        server.check_auth(request)
        server.check_model(model_id)
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, "chat")

    async def _generate(request: Request, kind: str):
        endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        # The id names the request in the log line and every answer, rejected ones included.
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        try:
            server.check_auth(request)
            data = await server.read_json(request)
            job = _prepare(request_id, data, kind, asyncio.get_running_loop())
            server.submit(job)
        except ApiError as e:
            server.record(endpoint, None, e.status, request_id=request_id, reason=e.code)
            e.headers = {**(e.headers or {}), "X-Request-Id": request_id}
            raise
        watcher = asyncio.create_task(_watch_disconnect(request, server, job))
        try:
            # Wait for the first event before answering: an engine-side rejection (RequestError) can still
            # become a proper 400 rather than an error in the middle of a 200 event stream.
            first = await job.events.get()
        except BaseException:
            watcher.cancel()
            server.worker.abandon(job)
            raise
        if first[0] == "error":
            watcher.cancel()
            return _fail(endpoint, job, first[1])
        if job.cancel.is_set():  # the client left while queued or during prefill
            watcher.cancel()
            server.record(endpoint, job, 499, reason="cancelled")  # nginx's "client closed request"
            return Response(status_code=499)
        if job.stream:
            # The watcher keeps running while we stream: it cancels the generation the moment the client
            # goes, even when the body iterator is parked in a send; the iterator stops it when done.
            return StreamingResponse(_stream_body(endpoint, job, first, watcher), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": job.id})
        try:
            return await _collect(endpoint, job, first)
        finally:
            watcher.cancel()

    def _prepare(request_id: str, data: dict, kind: str, loop) -> Job:
        if kind == "chat":
            for name in _UNSUPPORTED_CHAT:
                if name in data:
                    if data[name] not in (None, False, [], {}):
                        raise _bad(f"{name} is not supported by this server", name, "unsupported_parameter")
                    data = {k: v for k, v in data.items() if k != name}  # harmless: drop before the schema
            try:
                req = ChatRequest.model_validate(data)
            except ValidationError as e:
                raise _from_validation(e) from None
            server.check_model(req.model)
            if not req.messages:
                raise _bad("messages must contain at least one message", "messages")
            if req.logprobs or req.top_logprobs is not None:
                raise _bad("logprobs are not supported", "logprobs", "unsupported_parameter")
            messages = [{"role": "system" if m.role == "developer" else m.role,
                         "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)}
                        for m in req.messages]
            ids = server.prompt_ids(messages, "messages")
            sampling = server.sampling(req, ids, default_max_tokens=None)
        else:
            try:
                req = CompletionRequest.model_validate(data)
            except ValidationError as e:
                raise _from_validation(e) from None
            server.check_model(req.model)
            prompt = req.prompt
            if isinstance(prompt, list):
                if prompt and not isinstance(prompt[0], int):  # list[str] or list[list[int]]: a batch
                    if len(prompt) != 1:
                        raise _bad(f"only one prompt per request is supported (batch 1), got {len(prompt)}",
                                   "prompt", "unsupported_value")
                    prompt = prompt[0]
            if len(prompt) == 0:
                raise _bad("prompt must not be empty", "prompt")
            if req.logprobs is not None:
                raise _bad("logprobs are not supported", "logprobs", "unsupported_parameter")
            if req.echo:
                raise _bad("echo is not supported", "echo", "unsupported_parameter")
            if req.best_of not in (None, 1):
                raise _bad("only best_of=1 is supported", "best_of", "unsupported_value")
            if req.suffix:
                raise _bad("suffix is not supported", "suffix", "unsupported_parameter")
            ids = server.prompt_ids(prompt, "prompt")
            sampling = server.sampling(req, ids, default_max_tokens=16)  # OpenAI's completions default
        job = Job(request_id, kind, ids, sampling, loop, _new_stats())
        job.stats.prompt_tokens = len(ids)  # known now; the engine sets it again when it starts
        job.stream = bool(req.stream)
        job.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return job

    def _fail(endpoint: str, job: Job, exc: BaseException) -> JSONResponse:
        job.error = exc
        err = _error_for(exc)
        server.record(endpoint, job, err.status, reason="error")
        resp = err.response()
        resp.headers["X-Request-Id"] = job.id
        return resp

    def _finish_reason(job: Job) -> str:
        r = getattr(job.stats, "finish_reason", None)
        return r if r in ("stop", "length") else "stop"

    async def _collect(endpoint: str, job: Job, first: tuple):
        pieces: list[str] = []
        event = first
        while True:
            if event[0] == "piece":
                pieces.append(event[1])
            elif event[0] == "error":
                return _fail(endpoint, job, event[1])
            else:  # "end": finished, or abandoned by a client that left (nobody reads this answer)
                break
            event = await job.events.get()
        if job.cancel.is_set():
            server.record(endpoint, job, 499, reason="cancelled")
            return Response(status_code=499)
        text = "".join(pieces)
        if job.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": _finish_reason(job)}
            body = {"id": job.id, "object": "chat.completion", "created": job.created, "model": server.model_name,
                    "choices": [choice], "usage": _usage(job.stats), "system_fingerprint": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": _finish_reason(job)}
            body = {"id": job.id, "object": "text_completion", "created": job.created, "model": server.model_name,
                    "choices": [choice], "usage": _usage(job.stats), "system_fingerprint": None}
        server.record(endpoint, job, 200)
        return JSONResponse(body, headers={"X-Request-Id": job.id})

    async def _stream_body(endpoint: str, job: Job, first: tuple, watcher: asyncio.Task):
        chat = job.kind == "chat"
        base = {"id": job.id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": job.created, "model": server.model_name, "system_fingerprint": None}

        def chunk(text: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            out = dict(base, choices=[choice])
            if job.include_usage:
                out["usage"] = None  # OpenAI: null on every chunk but the last
            return _sse(out)

        finished = False
        try:
            if chat:
                yield chunk(None, None, role=True)
            event = first
            while True:
                if event[0] == "piece":
                    yield chunk(event[1], None)
                elif event[0] == "error":
                    # Headers are gone: report in-band the way OpenAI does, then end the stream.
                    job.error = event[1]
                    err = _error_for(event[1])
                    yield _sse({"error": {"message": err.message, "type": err.type, "param": err.param,
                                          "code": err.code}})
                    finished = True  # recorded before the last write, so a client that sees [DONE] sees it counted
                    server.record(endpoint, job, err.status, reason="error")
                    yield "data: [DONE]\n\n"
                    return
                else:
                    break
                event = await job.events.get()
            yield chunk(None, _finish_reason(job))
            if job.include_usage:
                yield _sse(dict(base, choices=[], usage=_usage(job.stats)))
            finished = True
            server.record(endpoint, job, 200)
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            if not finished:  # the client went away (Starlette cancelled us) or the send failed
                server.worker.abandon(job)
                server.record(endpoint, job, 499, reason="cancelled")

    return app


# ---- `hipengine serve` ---------------------------------------------------------------------------------

def _configure_logging() -> None:
    """Our request lines go to stderr as they are (each is one JSON object)."""
    if log.handlers:
        return
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(h)
    log.setLevel(logging.INFO)
    log.propagate = False


def run(args) -> int:
    """Entry point of ``hipengine serve``: load the engine, then serve until interrupted."""
    import uvicorn

    host = getattr(args, "host", None) or "127.0.0.1"
    port = int(getattr(args, "port", None) or 8000)
    api_key = getattr(args, "api_key", None) or os.environ.get("HIPENGINE_API_KEY") or None
    max_queue = getattr(args, "max_queue", None)
    max_queue = DEFAULT_MAX_QUEUE if max_queue is None else int(max_queue)
    if max_queue < 0:
        print(f"error: --max-queue must be >= 0, got {max_queue}", file=sys.stderr)
        return 2
    # Bind before the (slow) model load: a taken port fails at once, and uvicorn serves this very socket,
    # so no other process can take the port in between.
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        print(f"error: cannot listen on {host}:{port}: {e.strerror}; pick another --port or --host",
              file=sys.stderr)
        return 2
    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {host} without --api-key: anyone who can reach it can use it", file=sys.stderr)

    from .engine import Engine

    try:
        load_kw = {"device": getattr(args, "device", None) or "auto", "tp": int(getattr(args, "tp", None) or 1),
                   "monokernel": getattr(args, "monokernel", None),
                   "allreduce": getattr(args, "allreduce", None) or "custom"}
        for name in ("shape", "max_context", "seed"):
            if getattr(args, name, None) is not None:
                load_kw[name] = getattr(args, name)
        engine = Engine.load(getattr(args, "model", None), **load_kw)
    except HipEngineError as e:
        sock.close()
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    _configure_logging()
    app = create_app(engine, api_key=api_key, max_queue=max_queue,
                     max_body_bytes=int(getattr(args, "max_body_bytes", None) or DEFAULT_MAX_BODY_BYTES))
    print(f"hipengine: serving {app.state.server.model_name} on http://{host}:{port}/v1 "
          f"(max queue {max_queue}{', API key required' if api_key else ''})", file=sys.stderr)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # uvicorn re-raises the Ctrl-C it already handled by shutting down gracefully: a clean stop
    finally:
        sock.close()
        engine.close()
    return 0
