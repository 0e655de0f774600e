"""The FastAPI application: OpenAI-compatible completions over the batched speculative engine.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both streaming over server-sent events with
``"stream": true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text). Bad input answers 400,
a full queue 429, each with OpenAI's error body; the server keeps serving either way.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest

from specdraft.serve.config import ServeConfig
from specdraft.serve.engine import Engine, Event, QueueFull, Request
from specdraft.serve.protocol import (
    BadRequest,
    ParsedRequest,
    TextStream,
    chunk_body,
    completion_body,
    error_body,
    new_id,
    parse,
    usage,
)

_POLL_S = 0.5  # how often a waiting non-streaming request checks that its client is still there


def _error(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


def build_app(engine: Engine, tokenizer, serve: ServeConfig, eos: tuple[int, ...]) -> FastAPI:
    """The app; its lifespan starts the engine's thread and stops it on shutdown (SIGTERM, SIGINT)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="specdraft", lifespan=lifespan)
    metrics = engine.metrics

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):
        return _error(f"invalid request: {exc.errors()[:1]}", 400)

    @app.exception_handler(HTTPException)
    async def _http(request, exc):
        return _error(str(exc.detail), exc.status_code)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": serve.model_id, "running": engine.running, "waiting": engine.queue_length}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": serve.model_id, "object": "model", "created": 0,
                                            "owned_by": "specdraft"}]}

    @app.get("/metrics")
    async def prometheus():
        text = metrics.render(time.monotonic(), engine.queue_length, engine.running)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def complete(http: HTTPRequest, chat: bool, endpoint: str):
        response = await _complete(http, chat, engine, tokenizer, serve, eos)
        metrics.count_request(endpoint, response.status_code)
        return response

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        return await complete(http, True, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await complete(http, False, "/v1/completions")

    return app


async def _complete(http: HTTPRequest, chat: bool, engine: Engine, tokenizer, serve: ServeConfig, eos):
    try:
        body = json.loads(await http.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return _error(f"malformed JSON in the request body: {exc}", 400)
    try:
        parsed = parse(body, chat, tokenizer, serve, eos)
    except BadRequest as exc:
        return _error(exc.message, exc.status, exc.param)
    request = Request(parsed.prompt_ids, parsed.config, parsed.n, parsed.seed, asyncio.get_running_loop(),
                      asyncio.Queue())
    try:
        engine.submit(request)
    except QueueFull as exc:
        return _error(str(exc), 429)
    request_id = new_id(chat)
    if parsed.stream:
        events = _stream(http, request, parsed, engine, tokenizer, request_id, serve.model_id)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await _collect(http, request, parsed, engine, tokenizer, request_id, serve.model_id)


async def _next_event(http: HTTPRequest, request: Request) -> Event | None:
    """The next engine event, or None when the client has gone away."""
    while True:
        try:
            return await asyncio.wait_for(request.events.get(), _POLL_S)
        except TimeoutError:
            if await http.is_disconnected():
                return None


async def _collect(http, request: Request, parsed: ParsedRequest, engine: Engine, tokenizer, request_id: str,
                   model: str):
    """Wait for every choice, then answer with the whole completion."""
    streams = [TextStream(tokenizer, parsed.stop) for _ in range(parsed.n)]
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
            reasons[event.index] = event.finish_reason
    finally:
        engine.cancel(request)
    body = completion_body(request_id, model, parsed.chat, texts, reasons,
                           usage(len(parsed.prompt_ids), request.completion_tokens))
    return JSONResponse(body)


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def _stream(http, request: Request, parsed: ParsedRequest, engine: Engine, tokenizer, request_id: str,
                  model: str) -> AsyncIterator[str]:
    """Server-sent events: one chunk per step and choice with new text, a last chunk with the finish reason, an
    optional usage chunk, then ``[DONE]``. A client that goes away cancels the request (its rows leave the batch)."""
    streams = [TextStream(tokenizer, parsed.stop) for _ in range(parsed.n)]
    done = 0
    try:
        if parsed.chat:
            for index in range(parsed.n):
                yield _sse(chunk_body(request_id, model, True, index, "", None, first=True))
        while done < parsed.n:
            event = await _next_event(http, request)
            if event is None:
                return
            if event.error is not None:
                yield _sse(error_body(event.error, event.status))
                return
            finished = event.finish_reason is not None
            piece = streams[event.index].push(event.tokens, finished)
            if piece:
                yield _sse(chunk_body(request_id, model, parsed.chat, event.index, piece, None))
            if finished:
                done += 1
                yield _sse(chunk_body(request_id, model, parsed.chat, event.index, None, event.finish_reason))
        if parsed.include_usage:
            chunk = chunk_body(request_id, model, parsed.chat, 0, None, None)
            chunk["choices"], chunk["usage"] = [], usage(len(parsed.prompt_ids), request.completion_tokens)
            yield _sse(chunk)
        yield _sse("[DONE]")
    finally:
        engine.cancel(request)
