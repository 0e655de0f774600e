"""OpenAI-compatible request checking and response bodies (``/v1/chat/completions``, ``/v1/completions``).

Every bad field raises :class:`BadRequest`, which the app answers with HTTP 400 (413 for a body over the size
limit) and OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``. Checking has two stages:
:func:`check` reads every field and applies every limit that needs no tokenizer (numbers in range, prompt
characters), cheaply, on the event loop; :func:`tokenize` then encodes the prompt, off the event loop.

Fields: those OpenAI defines that this server implements, plus the extension ``top_k``. ``logit_bias``,
``frequency_penalty`` and ``presence_penalty`` become the request's
:class:`~specdraft.sampling.LogitPenalties`, applied to the target's logits before warping at every verified
position; ``response_format`` (``json_object``, ``json_schema``) is checked here and compiled into a grammar mask
(:mod:`specdraft.grammar`) by :func:`constrain`, off the event loop. ``tools``, ``tool_choice`` and
``parallel_tool_calls`` (chat) are checked by :mod:`specdraft.serve.tools`, which also renders the prompt; a
required or named ``tool_choice`` is compiled into the grammar of one call by :func:`constrain`. A field it does not
implement is refused by name, unless it carries the value that changes nothing (``frequency_penalty: 0``,
``echo: false``, ...); ``user`` is accepted and never changes the answer. Nothing is silently ignored.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, replace

from specdraft.errors import SpecdraftError
from specdraft.sampling import LogitPenalties, SamplingConfig, chain_processors
from specdraft.sequence import GenerationConfig
from specdraft.serve.config import ServeConfig
from specdraft.serve.tools import (
    SEPARATOR,
    ToolError,
    ToolRequest,
    call_schema,
    chat_prompt_ids,
    check_tool_message,
    check_tools,
)

MAX_TOP_LOGPROBS = 20  # most alternatives per token (top_logprobs; logprobs of /v1/completions)
MAX_TEMPERATURE = 2.0  # OpenAI's range is 0 .. 2
MAX_PENALTY = 2.0  # frequency_penalty and presence_penalty: OpenAI's range is -2 .. 2
MAX_LOGIT_BIAS = 100.0  # logit_bias values: OpenAI's range is -100 .. 100
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit on the tokens one logit_bias names
SEED_RANGE = (-(2**63), 2**63 - 1)  # a 64-bit signed integer, as OpenAI's seed

_BOTH = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop", "stream",
                   "stream_options", "logprobs", "user", "logit_bias", "frequency_penalty", "presence_penalty",
                   "response_format"})
_FIELDS = {True: _BOTH | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                          "parallel_tool_calls"}, False: _BOTH | {"prompt"}}
_NEUTRAL = {  # fields this server does not implement, accepted only at the value that changes nothing
    "tools": ([],), "functions": ([],),
    "tool_choice": ("none",), "function_call": ("none",), "parallel_tool_calls": (True, False),
    "modalities": (["text"],), "store": (False,), "echo": (False,),
    "best_of": (1,), "suffix": ("",),
}
_ROLES = ("system", "user", "assistant", "developer", "tool")


class BadRequest(Exception):
    """A request the server refuses; ``status`` 400 (bad input), 413 (body too large) or 429 (queue full)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def error_body(message: str, status: int, param: str | None = None) -> dict:
    kinds = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
             429: "rate_limit_exceeded", 503: "service_unavailable"}
    codes = {413: "request_too_large", 429: "rate_limit_exceeded"}
    return {"error": {"message": message, "type": kinds.get(status, "server_error"), "param": param,
                      "code": codes.get(status)}}


@dataclass
class ParsedRequest:
    """A checked completion request: what to tokenise (``source``), then the prompt's token ids and how to decode."""

    source: list[dict] | str | list[int]  # chat messages, prompt text, or prompt token ids
    config: GenerationConfig
    n: int
    seed: int | None
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    chat: bool
    logprobs: int | None = None  # None: off; k: each token's log-probability and its k most likely alternatives
    max_tokens_given: bool = True  # False: the default max_tokens, shortened to fit the context
    prompt_ids: list[int] | None = None  # set by :func:`tokenize`
    response_format: dict | None = None  # {"type": "json_object"} or {"type": "json_schema", "schema": {...}}
    tools: ToolRequest | None = None  # tools, tool_choice and parallel_tool_calls (chat)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _integer(body: dict, name: str, default: int | None, low: int, high: int | None) -> int | None:
    """An integer in [low, high] (``high`` None: no upper limit), range-checked before it reaches torch."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, got {_show(value)}", name)
    if value < low or (high is not None and value > high):
        interval = f"{low} .. {high}" if high is not None else f">= {low}"
        raise BadRequest(f"{name} must be {'in ' if high is not None else ''}{interval}, got {_show(value)}", name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    """A number in [low, high] (``(low, high]`` when ``low_open``); ints of any size compare exactly, NaN and
    infinities fail the range."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{name} must be a number, got {_show(value)}", name)
    if not ((low < value) if low_open else (low <= value)) or not value <= high:
        interval = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise BadRequest(f"{name} must be in {interval}, got {_show(value)}", name)
    return float(value)


def _text(value: str, where: str, param: str) -> str:
    """A string the tokenizer can encode: no lone surrogate (JSON's ``"\\ud800"`` escapes decode to one)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(f"{where} holds a lone surrogate ({value[exc.start]!r} at character {exc.start}), which is "
                         "not valid Unicode text", param) from None
    return value


def _fields(body: dict, chat: bool) -> None:
    for name, value in body.items():
        if name in _FIELDS[chat]:
            continue
        if name in _NEUTRAL:
            if value is None or value in _NEUTRAL[name]:
                continue
            allowed = " or ".join(repr(v) for v in _NEUTRAL[name])
            raise BadRequest(f"{name} is not supported by this server (only {allowed} or null)", name)
        raise BadRequest(f"{name} is not supported by this server", name)
    if not isinstance(body.get("user", ""), str):
        raise BadRequest("user must be a string", "user")


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise BadRequest("stop must be a non-empty string or a list of at most 4 of them", "stop")
    return tuple(_text(s, "stop", "stop") for s in stops)


def _message(message, i: int) -> dict:
    """A message as ``{role, content}`` with a string content (``tool_call_id`` for a tool result, ``tool_calls``
    for an assistant's calls; :func:`specdraft.serve.tools.check_tool_message`)."""
    if not isinstance(message, dict) or message.get("role") not in _ROLES:
        raise BadRequest(f"messages[{i}] needs a role of system, user, assistant, developer or tool", "messages")
    if message["role"] == "assistant" and message.get("tool_calls", 0) in (None, []):  # no calls, said explicitly
        message = {k: v for k, v in message.items() if k != "tool_calls"}
    if message["role"] == "tool" or (message["role"] == "assistant" and "tool_calls" in message):
        try:
            clean = check_tool_message(message, i)
        except ToolError as exc:
            raise BadRequest(exc.message, exc.param) from None
        return clean | {"content": _content({"role": clean["role"], "content": clean["content"]}, i)}
    return {"role": message["role"], "content": _content(message, i)}


def _content(message: dict, i: int) -> str:
    extra = sorted(set(message) - {"role", "content"})
    if extra:
        raise BadRequest(f"messages[{i}].{extra[0]} is not supported by this server", "messages")
    content = message.get("content")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   and set(p) == {"type", "text"} for p in content):
            raise BadRequest(f"messages[{i}].content parts must be text parts", "messages")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise BadRequest(f"messages[{i}].content must be a string", "messages")
    return _text(content, f"messages[{i}].content", "messages")


def _messages(body: dict, serve: ServeConfig) -> list[dict]:
    """The messages as ``{role, content}`` strings, within the character limit (nothing tokenised yet)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
    if len(messages) > serve.max_prompt_tokens:  # every message costs at least one token of the prompt
        raise BadRequest(f"{len(messages)} messages: more than this server's prompt limit of "
                         f"{serve.max_prompt_tokens} tokens", "messages")
    clean, chars = [], 0
    for i, message in enumerate(messages):
        clean_message = _message(message, i)
        chars += len(clean_message["content"]) + sum(len(json.dumps(call["function"]["arguments"]))
                                                     for call in clean_message.get("tool_calls", ()))
        if chars > serve.prompt_char_limit:
            raise BadRequest(f"the messages exceed this server's limit of {serve.prompt_char_limit} characters",
                             "messages")
        if clean_message["role"] == "developer":
            clean_message["role"] = "system"
        clean.append(clean_message)
    return clean


def _prompt(body: dict, serve: ServeConfig, vocab_size: int) -> str | list[int]:
    """The prompt text (within the character limit) or its token ids (each checked against the vocabulary)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt is empty", "prompt")
        if len(prompt) > serve.prompt_char_limit:
            raise BadRequest(f"the prompt has {len(prompt)} characters, more than this server's limit of "
                             f"{serve.prompt_char_limit}", "prompt")
        return _text(prompt, "prompt", "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if len(prompt) > serve.max_prompt_tokens:
            raise BadRequest(f"the prompt has {len(prompt)} tokens, more than this server's limit of "
                             f"{serve.max_prompt_tokens}", "prompt")
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise BadRequest(f"prompt token id {_show(bad)} is outside the vocabulary (0 .. {vocab_size - 1})",
                             "prompt")
        return list(prompt)
    raise BadRequest("prompt must be a non-empty string, a list of one string, or a list of token ids", "prompt")


def _logprobs(body: dict, chat: bool) -> int | None:
    """Chat: ``logprobs: true`` with ``top_logprobs`` alternatives; completions: ``logprobs: k`` alternatives."""
    if not chat:
        return _integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise BadRequest(f"logprobs must be true or false, got {_show(wanted)}", "logprobs")
    top = _integer(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else None


def _sampling(body: dict, vocab_size: int) -> SamplingConfig:
    """temperature 0 .. 2 (below 1e-5 decodes greedily), top_p in (0, 1], top_k >= 0: a top_k at or above the
    vocabulary size keeps every token, as 0 does, and is clamped to it."""
    temperature = _number(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    top_k = _integer(body, "top_k", 0, 0, None)
    return SamplingConfig(temperature, min(top_k, vocab_size), top_p)


def _logit_bias(body: dict, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias``: an object from token ids (JSON keys, so strings of decimal digits) to biases in
    [-100, 100], at most 300 of them, each id in the vocabulary; ids in order, each once."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise BadRequest(f"logit_bias must be an object mapping token ids to numbers, got {_show(bias)}",
                         "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise BadRequest(f"logit_bias names {len(bias)} tokens, more than {MAX_LOGIT_BIAS_ENTRIES}", "logit_bias")
    pairs: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12 else None
        if token is None or not token < vocab_size:
            raise BadRequest(f"logit_bias key {_show(key)} is not a token id of the vocabulary (0 .. "
                             f"{vocab_size - 1})", "logit_bias")
        if token in pairs:
            raise BadRequest(f"logit_bias names token {token} twice", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:  # NaN and infinities fail the range
            raise BadRequest(f"logit_bias[{key!r}] must be a number in [-100, 100], got {_show(value)}",
                             "logit_bias")
        pairs[token] = float(value)
    return tuple(sorted(pairs.items()))


def _penalties(body: dict, vocab_size: int) -> LogitPenalties | None:
    """The request's logit bias and penalties, or None when they change nothing."""
    penalties = LogitPenalties(_logit_bias(body, vocab_size),
                               _number(body, "frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
                               _number(body, "presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY))
    return penalties if penalties.active else None


_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _response_format(body: dict) -> dict | None:
    """``response_format``: ``{"type": "text"}`` (None), ``{"type": "json_object"}``, or ``{"type": "json_schema",
    "json_schema": {"name", "schema", "description"?, "strict"?}}`` as OpenAI defines them (the schema is checked
    when it is compiled, :func:`constrain`)."""
    value = body.get("response_format")
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise BadRequest("response_format must be an object with type text, json_object or json_schema",
                         "response_format")
    extra = sorted(set(value) - {"type", "json_schema"} if kind == "json_schema" else set(value) - {"type"})
    if extra:
        raise BadRequest(f"response_format.{extra[0]} is not supported for type {kind}", "response_format")
    if kind != "json_schema":
        return None if kind == "text" else {"type": kind}
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not set(spec) <= {"name", "schema", "description", "strict"}:
        raise BadRequest("response_format.json_schema must be an object of name, schema, description and strict",
                         "response_format")
    if not isinstance(spec.get("name"), str) or not _SCHEMA_NAME.fullmatch(spec["name"]):
        raise BadRequest("response_format.json_schema.name must be 1 to 64 letters, digits, _ or -",
                         "response_format")
    if not isinstance(spec.get("schema", {}), dict) or not isinstance(spec.get("strict") or False, bool):
        raise BadRequest("response_format.json_schema.schema must be an object and strict true or false",
                         "response_format")
    return {"type": kind, "schema": spec.get("schema", {})}


def _tools(body: dict, messages: list[dict], serve: ServeConfig) -> ToolRequest | None:
    """The chat request's tools (:func:`specdraft.serve.tools.check_tools`), within the character limit together
    with the messages, and never beside a ``response_format`` when the answer must be a call."""
    try:
        tools = check_tools(body)
    except ToolError as exc:
        raise BadRequest(exc.message, exc.param) from None
    if tools is None:
        return None
    shown = len(json.dumps(tools.functions)) if tools.active else 0
    if shown + sum(len(m["content"]) for m in messages) > serve.prompt_char_limit:
        raise BadRequest(f"the tools and messages exceed this server's limit of {serve.prompt_char_limit} "
                         "characters", "tools")
    if tools.constrained and body.get("response_format") is not None:
        raise BadRequest("response_format cannot be combined with a required or named tool_choice",
                         "response_format")
    return tools


def check(body, chat: bool, serve: ServeConfig, eos: tuple[int, ...], vocab_size: int) -> ParsedRequest:
    """Check every field of a request body against the OpenAI schema and the server's limits; nothing tokenised."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _fields(body, chat)
    model = body.get("model")
    if model != serve.model_id:
        raise BadRequest(f"unknown model {_show(model)}: this server serves {serve.model_id!r}", "model")
    source = _messages(body, serve) if chat else _prompt(body, serve, vocab_size)
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, name, serve.max_tokens if chat else min(16, serve.max_tokens), 1, serve.max_tokens)
    n = _integer(body, "n", 1, 1, serve.max_n)
    seed = _integer(body, "seed", None, *SEED_RANGE)
    stream, options = body.get("stream", False), body.get("stream_options") or {}
    if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false", "stream")
    if not isinstance(options, dict) or not set(options) <= {"include_usage"} or \
            not isinstance(options.get("include_usage", False), bool):
        raise BadRequest("stream_options must be an object with at most include_usage (true or false)",
                         "stream_options")
    stop, logprobs, penalties = _stop(body), _logprobs(body, chat), _penalties(body, vocab_size)
    tools = _tools(body, source, serve) if chat else None
    try:
        config = replace(serve.generation(max_tokens, _sampling(body, vocab_size), eos, stop),
                         logits_processor=penalties)
        if seed is not None and not config.sampling.greedy:  # adaptive draft lengths follow timings, and each
            config = replace(config, speculation="fixed")  # draws its own random numbers: a seed replays only fixed
    except SpecdraftError as exc:
        raise BadRequest(str(exc)) from None
    return ParsedRequest(source, config, n, seed, stream, bool(options.get("include_usage", False)), stop, chat,
                         logprobs, body.get(name) is not None, response_format=_response_format(body), tools=tools)


def tokenize(request: ParsedRequest, tokenizer, serve: ServeConfig, context: int) -> ParsedRequest:
    """Encode the prompt (chat template for messages) and apply the token limits: the prompt's, and prompt plus
    max_tokens within the model's ``context`` (a default max_tokens is shortened to fit). A prompt the tokenizer
    cannot encode is bad input. Slow for long prompts: run it off the event loop."""
    param = "messages" if request.chat else "prompt"
    if isinstance(request.source, list) and not request.chat:
        ids = request.source
    else:
        if request.chat and not getattr(tokenizer, "chat_template", None):
            raise BadRequest("this model's tokenizer has no chat template: use /v1/completions", "messages")
        try:
            if request.chat:
                ids = chat_prompt_ids(request.source, request.tools, tokenizer)
            else:
                ids = tokenizer(request.source)["input_ids"]
        except Exception as exc:  # the tokenizer refused this text: the request's fault, not the server's
            raise BadRequest(f"the tokenizer cannot encode the {param}: {exc}", param) from None
    if len(ids) > serve.max_prompt_tokens:
        raise BadRequest(f"the prompt has {len(ids)} tokens, more than this server's limit of "
                         f"{serve.max_prompt_tokens}", param)
    request.prompt_ids, room = list(ids), context - len(ids)
    wanted = request.config.max_new_tokens
    if room < 1 or (wanted > room and request.max_tokens_given):
        raise BadRequest(f"the prompt's {len(ids)} tokens and {wanted} tokens to generate exceed the model's context "
                         f"of {context} tokens", param if room < 1 else "max_tokens")
    if wanted > room:
        request.config = replace(request.config, max_new_tokens=room)
    return request


def constrain(request: ParsedRequest, grammars) -> ParsedRequest:
    """Compile the request's ``response_format`` into a grammar mask (``grammars``: a callable that gives the
    server's :class:`~specdraft.grammar.GrammarCompiler`, made on first use) and chain it after the request's
    penalties. A schema the grammar cannot take, or a server without the grammar library, is bad input (400).
    Compiling takes milliseconds (cached by schema): run it off the event loop."""
    if request.tools is not None:
        _constrain_tools(request, grammars)
    spec = request.response_format
    if spec is None:
        return request
    try:
        compiler = grammars()
        grammar = compiler.json_object() if spec["type"] == "json_object" else compiler.json_schema(spec["schema"])
    except SpecdraftError as exc:
        raise BadRequest(str(exc), "response_format") from None
    request.config = replace(request.config, logits_processor=chain_processors(request.config.logits_processor,
                                                                                 grammar))
    return request


def _constrain_tools(request: ParsedRequest, grammars) -> None:
    """Compile every function's parameters (a schema xgrammar refuses is a 400 naming ``tools``; without the
    grammar library only a required or named ``tool_choice`` is refused), and for a required or named one the
    grammar of one call, chained after the penalties."""
    tools = request.tools
    try:
        compiler = grammars()
    except SpecdraftError as exc:
        if tools.constrained:
            raise BadRequest(str(exc), "tool_choice") from None
        return
    for i, function in enumerate(tools.functions):
        try:
            compiler.json_schema(function["parameters"])
        except SpecdraftError as exc:
            raise BadRequest(f"tools[{i}].function.parameters: {exc}", "tools") from None
    if tools.active and tools.constrained:
        try:
            grammar = compiler.json_schema_list(call_schema(tools), SEPARATOR) if tools.parallel else \
                compiler.json_schema(call_schema(tools))
        except SpecdraftError as exc:
            raise BadRequest(f"the tools' parameters cannot be combined into one grammar: {exc}", "tools") from None
        request.config = replace(request.config, logits_processor=chain_processors(request.config.logits_processor,
                                                                                     grammar))


def parse(body, chat: bool, tokenizer, serve: ServeConfig, eos: tuple[int, ...], vocab_size: int,
          context: int) -> ParsedRequest:
    """:func:`check`, then :func:`tokenize` (in the calling thread)."""
    return tokenize(check(body, chat, serve, eos, vocab_size), tokenizer, serve, context)


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's finish reasons: an end-of-sequence token or a stop string is "stop", the token limit "length";
    "tool_calls" (set by the app when the answer holds calls) stays."""
    return None if reason is None else (reason if reason in ("length", "tool_calls") else "stop")


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, speculation: dict | None = None, closed_at_budget: int = 0,
          cached_tokens: int = 0) -> dict:
    """OpenAI's usage (``prompt_tokens_details.cached_tokens``: the prompt's first tokens read from a kept cache),
    with the extensions ``speculation`` (the request's own speculation counters, summed over its choices:
    :meth:`specdraft.serve.metrics.SpeculationTally.to_dict`) when given, and ``closed_at_budget`` (how many of its
    answers the grammar closed early to keep them complete within ``max_tokens``) when any was."""
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if speculation is not None:
        body["speculation"] = speculation
    return body | {"closed_at_budget": closed_at_budget} if closed_at_budget else body


def completion_body(request_id: str, model: str, chat: bool, texts: list[str], reasons: list[str | None],
                    usage_: dict, logprobs: list[dict | None] | None = None,
                    tool_calls: list[list[dict]] | None = None) -> dict:
    """The whole (non-streaming) response; ``tool_calls``: each choice's calls (a choice with calls has
    ``message.tool_calls``, and its text, None when empty, as content)."""
    choices = []
    for i, (text, reason) in enumerate(zip(texts, reasons, strict=True)):
        content = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        if tool_calls and tool_calls[i]:
            content["message"]["tool_calls"] = tool_calls[i]
        choices.append({"index": i, **content, "logprobs": logprobs[i] if logprobs else None,
                        "finish_reason": finish_reason(reason)})
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage_}


def chunk_body(request_id: str, model: str, chat: bool, index: int, text: str | None, reason: str | None,
               first: bool = False, logprobs: dict | None = None) -> dict:
    """One streamed chunk of choice ``index``."""
    if chat:
        delta = ({"role": "assistant", "content": text or ""} if first else {} if text is None
                 else {"content": text})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason(reason)}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason(reason)}
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}
