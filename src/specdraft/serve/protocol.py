"""OpenAI-compatible request checking and response bodies (``/v1/chat/completions``, ``/v1/completions``).

Every bad field raises :class:`BadRequest`, which the app answers with HTTP 400 and OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``. Extensions beyond OpenAI's fields: ``top_k``.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

from specdraft.decoding import GenerationConfig
from specdraft.errors import SpecdraftError
from specdraft.sampling import SamplingConfig
from specdraft.serve.config import ServeConfig


class BadRequest(Exception):
    """A request the server refuses; ``status`` 400 (bad input) or 429 (queue full)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def error_body(message: str, status: int, param: str | None = None) -> dict:
    kinds = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_exceeded",
             503: "service_unavailable"}
    return {"error": {"message": message, "type": kinds.get(status, "server_error"), "param": param,
                      "code": kinds.get(status, "server_error") if status == 429 else None}}


@dataclass
class ParsedRequest:
    """A checked completion request: the prompt's token ids and how to decode them."""

    prompt_ids: list[int]
    config: GenerationConfig
    n: int
    seed: int | None
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    chat: bool


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
        raise BadRequest(f"{name} must be a number, got {value!r}", name)
    return float(value)


def _integer(body: dict, name: str, default: int | None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, got {value!r}", name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise BadRequest("stop must be a non-empty string or a list of at most 4 of them", "stop")
    return tuple(stops)


def _messages(body: dict, tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant", "developer"):
            raise BadRequest(f"messages[{i}] needs a role of system, user, assistant or developer", "messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"messages[{i}].content parts must be text parts", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string", "messages")
        role = "system" if message["role"] == "developer" else message["role"]
        clean.append({"role": role, "content": content})
    if not getattr(tokenizer, "chat_template", None):
        raise BadRequest("this model's tokenizer has no chat template: use /v1/completions", "messages")
    encoded = tokenizer.apply_chat_template(clean, add_generation_prompt=True, return_dict=True)
    return list(encoded["input_ids"])


def _prompt(body: dict, tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt is empty", "prompt")
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise BadRequest("prompt must be a non-empty string, a list of one string, or a list of token ids", "prompt")


def parse(body, chat: bool, tokenizer, serve: ServeConfig, eos: tuple[int, ...]) -> ParsedRequest:
    """Check a request body against the OpenAI schema and the server's limits."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if model != serve.model_id:
        raise BadRequest(f"unknown model {model!r}: this server serves {serve.model_id!r}", "model")
    prompt_ids = _messages(body, tokenizer) if chat else _prompt(body, tokenizer)
    if len(prompt_ids) > serve.max_prompt_tokens:
        raise BadRequest(f"the prompt has {len(prompt_ids)} tokens, more than this server's limit of "
                         f"{serve.max_prompt_tokens}", "messages" if chat else "prompt")
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, name, serve.max_tokens if chat else min(16, serve.max_tokens))
    if max_tokens < 1 or max_tokens > serve.max_tokens:
        raise BadRequest(f"{name} must be in 1 .. {serve.max_tokens}, got {max_tokens}", name)
    n = _integer(body, "n", 1)
    if not 1 <= n <= serve.max_n:
        raise BadRequest(f"n must be in 1 .. {serve.max_n}, got {n}", "n")
    temperature, top_p = _number(body, "temperature", 1.0), _number(body, "top_p", 1.0)
    top_k = _integer(body, "top_k", 0)
    if temperature < 0:
        raise BadRequest(f"temperature must be >= 0, got {temperature}", "temperature")
    if not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}", "top_p")
    stream, options = body.get("stream", False), body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise BadRequest("stream must be true or false and stream_options an object", "stream")
    stop = _stop(body)
    try:
        sampling = SamplingConfig(temperature, top_k, top_p)
        config = GenerationConfig(max_tokens, serve.num_draft_tokens, sampling, eos, stop)
    except SpecdraftError as exc:
        raise BadRequest(str(exc)) from None
    return ParsedRequest(prompt_ids, config, n, _integer(body, "seed", None), stream,
                         bool(options.get("include_usage", False)), stop, chat)


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's finish reasons: an end-of-sequence token or a stop string is "stop", the token limit "length"."""
    return None if reason is None else ("length" if reason == "length" else "stop")


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(request_id: str, model: str, chat: bool, texts: list[str], reasons: list[str | None],
                    usage_: dict) -> dict:
    """The whole (non-streaming) response."""
    choices = []
    for i, (text, reason) in enumerate(zip(texts, reasons, strict=True)):
        content = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        choices.append({"index": i, **content, "logprobs": None, "finish_reason": finish_reason(reason)})
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage_}


def chunk_body(request_id: str, model: str, chat: bool, index: int, text: str | None, reason: str | None,
               first: bool = False) -> dict:
    """One streamed chunk of choice ``index``."""
    if chat:
        delta = ({"role": "assistant", "content": text or ""} if first else {} if text is None
                 else {"content": text})
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason(reason)}
    else:
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason(reason)}
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}


class TextStream:
    """Incremental detokenisation of one choice: text is released once it cannot change (no trailing partial
    UTF-8 character) and cannot turn out to be the start of a stop string; a stop string and what follows it are
    cut from the final text, as OpenAI does."""

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.sent = 0
        self._hold = max((len(s) for s in stop), default=1) - 1

    def push(self, tokens: list[int], finished: bool) -> str:
        """Add tokens; return the newly releasable text."""
        self.ids += tokens
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if finished:
            cuts = [text.find(s) for s in self.stop if s in text]
            ready = text[: min(cuts)] if cuts else text
        else:
            ready = text[: max(0, len(text) - self._hold)] if self.stop else text
            ready = ready.rstrip("\ufffd")
        piece = ready[self.sent :] if len(ready) > self.sent else ""
        self.sent = max(self.sent, len(ready))
        return piece
