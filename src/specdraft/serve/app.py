"""The FastAPI application: OpenAI-compatible completions over the batched speculative engine.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both streaming over server-sent events with
``"stream": true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text). Every answer is JSON
with OpenAI's error body when it is an error: 400 for bad input (whatever the request holds), 413 for a body over
the size limit, 429 for a full queue, 503 while shutting down, 500 only for a server bug (logged and counted in
``/metrics``); the server keeps serving in every case.

Limits apply before work: the body size (from ``Content-Length``, else while reading), then every field and the
prompt's characters (:func:`~specdraft.serve.protocol.check`), then tokenising, in a worker thread so that the
event loop keeps answering (``/health`` included) while a long prompt is encoded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest

from specdraft.errors import json_error
from specdraft.hardware import openmp_alone
from specdraft.serve.config import ServeConfig
from specdraft.serve.engine import Engine, Event, QueueFull, Request
from specdraft.serve.protocol import (
    BadRequest,
    ParsedRequest,
    check,
    chunk_body,
    completion_body,
    constrain,
    error_body,
    new_id,
    tokenize,
    usage,
)
from specdraft.serve.shutdown import SHUTDOWN_MESSAGE, Drain
from specdraft.serve.streams import LogprobStream, TextStream
from specdraft.serve.tools import ToolStream, parse_calls

log = logging.getLogger(__name__)

_POLL_S = 0.5  # how often a waiting request checks that its client is still there


class SafeJSON(JSONResponse):
    """JSON with every non-ASCII character escaped: a lone surrogate from a request, echoed in an error message,
    cannot break the encoding of the answer."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def _error(message: str, status: int, param: str | None = None) -> SafeJSON:
    return SafeJSON(error_body(message, status, param), status_code=status)


@dataclass
class _Server:
    """What the request handlers share."""

    engine: Engine
    tokenizer: object
    serve: ServeConfig
    eos: tuple[int, ...]
    drain: Drain
    pool: ThreadPoolExecutor  # one thread: tokenising off the event loop, one prompt at a time
    compiler: object = None  # the GrammarCompiler, made in the pool on the first response_format

    def grammars(self):
        """The server's :class:`~specdraft.grammar.GrammarCompiler` (made on first use, in the pool's thread)."""
        if self.compiler is None:
            from specdraft.grammar import GrammarCompiler

            self.compiler = GrammarCompiler(self.tokenizer, self.engine.vocab_size, self.eos)
        return self.compiler


def build_app(engine: Engine, tokenizer, serve: ServeConfig, eos: tuple[int, ...]) -> FastAPI:
    """The app; its lifespan starts the engine's thread and stops it on shutdown. ``app.state.drain`` is the
    graceful shutdown (:mod:`specdraft.serve.shutdown`) that :func:`~specdraft.serve.run_server` starts on SIGTERM."""
    server = _Server(engine, tokenizer, serve, eos, Drain(serve.shutdown_grace, engine.cancel),
                     ThreadPoolExecutor(1, thread_name_prefix="specdraft-tokenize", initializer=openmp_alone))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.drain.loop = asyncio.get_running_loop()
        engine.start()
        yield
        await asyncio.to_thread(engine.stop, server.drain.reserve)
        server.pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="specdraft", lifespan=lifespan, default_response_class=SafeJSON)
    app.state.drain = server.drain
    _routes(app, server)
    return app


def _routes(app: FastAPI, server: _Server) -> None:
    metrics, serve, engine = server.engine.metrics, server.serve, server.engine

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):
        return _error(f"invalid request: {exc.errors()[:1]}", 400)

    @app.exception_handler(HTTPException)
    async def _http(request, exc):
        return _error(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _bug(request, exc):  # anything a route did not turn into an answer is a server bug
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        metrics.count_request(request.url.path, 500)
        return _error(f"internal server error: {type(exc).__name__}", 500)

    @app.get("/health")
    async def health():
        body = {"status": "draining" if server.drain.draining else "ok", "model": serve.model_id,
                "running": engine.running, "waiting": engine.queue_length}
        return SafeJSON(body, status_code=503 if server.drain.draining else 200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": serve.model_id, "object": "model", "created": 0,
                                            "owned_by": "specdraft"}]}

    @app.get("/metrics")
    async def prometheus():
        text = metrics.render(time.monotonic(), engine.queue_length, engine.running)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def complete(http: HTTPRequest, chat: bool, endpoint: str):
        try:
            response = await _complete(http, chat, server, endpoint)
        except Exception as exc:  # a server bug: the client still gets a JSON answer, and /metrics counts it
            log.error("request to %s failed", endpoint, exc_info=exc)
            response = _error(f"internal server error: {type(exc).__name__}", 500)
        metrics.count_request(endpoint, response.status_code)
        return response

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        return await complete(http, True, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await complete(http, False, "/v1/completions")


async def _body(http: HTTPRequest, limit: int) -> bytes:
    """The request body, refused with 413 above ``limit`` bytes: from ``Content-Length`` before reading any of it,
    else as soon as the bytes read pass the limit."""
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"the request body has {declared} bytes, more than this server's limit of {limit}",
                         status=413)
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"the request body exceeds this server's limit of {limit} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


async def _parse(http: HTTPRequest, chat: bool, server: _Server) -> ParsedRequest:
    raw = await _body(http, server.serve.max_body_bytes)
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"malformed JSON in the request body: {json_error(exc)}") from None
    except (ValueError, RecursionError) as exc:  # not UTF-8, an integer of over 4,300 digits, nesting too deep
        raise BadRequest(f"unreadable JSON in the request body: {type(exc).__name__}: {exc}") from None
    parsed = check(body, chat, server.serve, server.eos, server.engine.vocab_size)
    loop = asyncio.get_running_loop()
    parsed = await loop.run_in_executor(server.pool, tokenize, parsed, server.tokenizer, server.serve,
                                        server.engine.context)
    return await loop.run_in_executor(server.pool, constrain, parsed, server.grammars)


async def _complete(http: HTTPRequest, chat: bool, server: _Server, endpoint: str):
    if server.drain.draining:
        return _error(SHUTDOWN_MESSAGE, 503)
    try:
        parsed = await _parse(http, chat, server)
    except BadRequest as exc:
        return _error(exc.message, exc.status, exc.param)
    if server.drain.draining:
        return _error(SHUTDOWN_MESSAGE, 503)
    request = Request(parsed.prompt_ids, parsed.config, parsed.n, parsed.seed, asyncio.get_running_loop(),
                      asyncio.Queue(), logprobs=parsed.logprobs)
    try:
        server.engine.submit(request)
    except QueueFull as exc:
        return _error(str(exc), 429)
    server.drain.live.add(request)
    request_id = new_id(chat)
    if parsed.stream:
        events = _stream(http, request, parsed, server, request_id, endpoint)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await _collect(http, request, parsed, server, request_id)


async def _next_event(http: HTTPRequest, request: Request) -> Event | None:
    """The next engine event, or None when the client has gone away."""
    while True:
        try:
            return await asyncio.wait_for(request.events.get(), _POLL_S)
        except TimeoutError:
            if await http.is_disconnected():
                return None


def _finish(server: _Server, request: Request) -> None:
    server.engine.cancel(request)
    server.drain.live.discard(request)


async def _collect(http, request: Request, parsed: ParsedRequest, server: _Server, request_id: str):
    """Wait for every choice, then answer with the whole completion."""
    streams = [TextStream(server.tokenizer, parsed.stop) for _ in range(parsed.n)]
    logprobs = [LogprobStream(server.tokenizer, parsed.chat) for _ in range(parsed.n)]
    reasons: list[str | None] = [None] * parsed.n
    texts = [""] * parsed.n
    try:
        while any(reason is None for reason in reasons):
            event = await _next_event(http, request)
            if event is None:
                return _error("client disconnected", 499)
            if event.error is not None:
                return _error(event.error, event.status)
            texts[event.index] += streams[event.index].push(event.tokens, event.finish_reason is not None)
            logprobs[event.index].push(event.tokens, event.logprobs)
            reasons[event.index] = event.finish_reason
    finally:
        _finish(server, request)
    wholes = [stream.whole for stream in logprobs] if parsed.logprobs is not None else None
    calls: list[list[dict]] = [[] for _ in texts]
    if parsed.tools is not None and parsed.tools.active:
        for i, (text, reason) in enumerate(zip(texts, reasons, strict=True)):
            texts[i], calls[i] = parse_calls(text, parsed.tools, reason)
            reasons[i] = "tool_calls" if calls[i] and reason != "length" else reason
    body = completion_body(request_id, server.serve.model_id, parsed.chat, texts, reasons,
                           usage(len(parsed.prompt_ids), request.completion_tokens, request.speculation.to_dict(),
                                 request.closed_at_budget, request.prompt_tokens_cached),
                           wholes, calls)
    return SafeJSON(body)


def _sse(payload: dict | str) -> str:
    text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=True, allow_nan=False)
    return f"data: {text}\n\n"


async def _stream(http, request: Request, parsed: ParsedRequest, server: _Server, request_id: str,
                  endpoint: str) -> AsyncIterator[str]:
    """Server-sent events: one chunk per step and choice with new text, a last chunk with the finish reason, an
    optional usage chunk, then ``[DONE]``. An error (bad input found while decoding, shutdown, a server bug) is
    an error event, then ``[DONE]``. A client that goes away cancels the request (its rows leave the batch)."""
    try:
        async for piece in _events(http, request, parsed, server, request_id, endpoint):
            yield piece
    except Exception as exc:  # a server bug mid-stream: the client still gets an error event and [DONE]
        log.error("stream of %s failed", endpoint, exc_info=exc)
        server.engine.metrics.count_stream_error(endpoint, 500)
        yield _sse(error_body(f"internal server error: {type(exc).__name__}", 500))
        yield _sse("[DONE]")
    finally:
        _finish(server, request)


async def _events(http, request: Request, parsed: ParsedRequest, server: _Server, request_id: str, endpoint: str):
    model, chat = server.serve.model_id, parsed.chat
    streams = [TextStream(server.tokenizer, parsed.stop) for _ in range(parsed.n)]
    logprobs = [LogprobStream(server.tokenizer, chat) for _ in range(parsed.n)]
    tools = [ToolStream(parsed.tools) for _ in range(parsed.n)] if parsed.tools and parsed.tools.active else None
    done = 0
    if chat:
        for index in range(parsed.n):
            yield _sse(chunk_body(request_id, model, True, index, "", None, first=True))
    while done < parsed.n:
        event = await _next_event(http, request)
        if event is None:
            return
        if event.error is not None:
            server.engine.metrics.count_stream_error(endpoint, event.status)
            yield _sse(error_body(event.error, event.status))
            yield _sse("[DONE]")
            return
        finished, reason = event.finish_reason is not None, event.finish_reason
        piece = streams[event.index].push(event.tokens, finished)
        if tools is not None:
            piece = tools[event.index].push(piece, finished, reason)
        part = logprobs[event.index].push(event.tokens, event.logprobs)
        if piece or part:
            yield _sse(chunk_body(request_id, model, chat, event.index, piece, None, logprobs=part))
        for delta in tools[event.index].deltas if tools is not None else ():
            chunk = chunk_body(request_id, model, chat, event.index, None, None)
            chunk["choices"][0]["delta"] = {"tool_calls": [delta]}
            yield _sse(chunk)
        if finished and tools is not None and tools[event.index].calls and reason != "length":
            reason = "tool_calls"
        if finished:
            done += 1
            yield _sse(chunk_body(request_id, model, chat, event.index, None, reason))
    if parsed.include_usage:
        chunk = chunk_body(request_id, model, chat, 0, None, None)
        chunk["choices"], chunk["usage"] = [], usage(len(parsed.prompt_ids), request.completion_tokens,
                                                    request.speculation.to_dict(), request.closed_at_budget,
                                                    request.prompt_tokens_cached)
        yield _sse(chunk)
    yield _sse("[DONE]")
