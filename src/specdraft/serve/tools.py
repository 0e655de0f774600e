"""Tool calling on ``/v1/chat/completions``: OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, the
conversation's tool calls and tool results, and ``tool_calls`` in the answer.

The format is Hermes' (NousResearch), which Qwen2.5 and others use: the model writes each call as
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``. A chat template that renders ``tools=``
itself (its source names ``tools``) gets the tools, the assistant's calls and the tool results as transformers
passes them; any other template (SmolLM2-135M-Instruct's has no tools section) gets the tools as a block at the end
of the system prompt (:data:`TOOLS_PROMPT`), the assistant's calls as ``<tool_call>`` text and the tool results as
a user turn of ``<tool_response>`` blocks.

``tool_choice``: ``none`` (the tools are not shown and nothing is parsed), ``auto`` (free text; the
``<tool_call>`` blocks of the answer become ``tool_calls``), ``required`` and a named function: the prompt ends with
``<tool_call>\\n`` and the answer is constrained by a grammar (:mod:`specdraft.grammar`) to a JSON object
``{"name", "arguments"}`` whose arguments validate against that function's ``parameters`` schema (any listed
function for ``required``), so the call always parses; with ``parallel_tool_calls`` (the default) one or more of
them, separated by :data:`SEPARATOR` (the end of one block and the start of the next). Exact under speculation as
every grammar is. The calls of a constrained answer are read as they are written (:class:`CallScanner`), so a
streamed answer sends each call's name as soon as it is complete and its arguments token by token; a streamed
``auto`` answer sends each call whole as soon as its ``</tool_call>`` arrives, and its content around the blocks as
it comes (:class:`ToolStream`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from specdraft.grammar import unsupported_schema_feature

OPEN, CLOSE = "<tool_call>", "</tool_call>"
SEPARATOR = f"\n{CLOSE}\n{OPEN}\n"  # between two calls of a constrained answer
_HEAD = re.compile(r'\{"name": "([A-Za-z0-9_-]{1,64})", "arguments": ')  # a constrained call up to its arguments
TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


class ToolError(ValueError):
    """Bad tool input; ``param`` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True)
class ToolRequest:
    """A request's checked tools: ``functions`` ({name, description?, parameters}), ``choice`` none / auto /
    required / named (``name`` the named function), ``parallel`` (False: at most one call)."""

    functions: tuple[dict, ...]
    choice: str
    name: str | None = None
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    @property
    def active(self) -> bool:
        return self.choice != "none" and bool(self.functions)

    def openai_tools(self) -> list[dict]:
        return [{"type": "function", "function": f} for f in self.functions]


def _function(tool, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) != {"type", "function"}:
        raise ToolError(f"{where} must be an object {{type: \"function\", function: {{...}}}}", "tools")
    function = tool["function"]
    if not isinstance(function, dict) or not set(function) <= {"name", "description", "parameters", "strict"}:
        raise ToolError(f"{where}.function must be an object of name, description, parameters and strict", "tools")
    if not isinstance(function.get("name"), str) or not _NAME.fullmatch(function["name"]):
        raise ToolError(f"{where}.function.name must be 1 to 64 letters, digits, _ or -", "tools")
    if not isinstance(function.get("description", ""), str) or \
            not isinstance(function.get("strict") or False, bool):
        raise ToolError(f"{where}.function.description must be a string and strict true or false", "tools")
    parameters = function.get("parameters", _EMPTY_PARAMETERS)
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise ToolError(f"{where}.function.parameters must be a JSON schema of type object", "tools")
    found = unsupported_schema_feature(parameters)
    if found is not None:
        raise ToolError(f"{where}.function.parameters: unsupported JSON schema feature: {found}", "tools")
    described = {"description": function["description"]} if "description" in function else {}
    return {"name": function["name"]} | described | {"parameters": parameters}


def _choice(value, names: list[str]) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if names else "none"), None
    if value in ("none", "auto", "required"):
        if value != "none" and not names:
            raise ToolError(f"tool_choice {value!r} needs tools", "tool_choice")
        return value, None
    if isinstance(value, dict) and value.get("type") == "function" and set(value) == {"type", "function"} and \
            isinstance(value["function"], dict) and set(value["function"]) == {"name"}:
        name = value["function"]["name"]
        if name not in names:
            raise ToolError(f"tool_choice names function {str(name)[:64]!r}, which is not in tools", "tool_choice")
        return "named", name
    raise ToolError("tool_choice must be none, auto, required or {type: \"function\", function: {name}}",
                    "tool_choice")


def check_tools(body: dict) -> ToolRequest | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request, checked; None without tools."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ToolError("tools must be a list of function tools", "tools")
    functions = [_function(tool, i) for i, tool in enumerate(tools or [])]
    names = [f["name"] for f in functions]
    if len(set(names)) < len(names):
        raise ToolError("tools name a function twice", "tools")
    choice, name = _choice(body.get("tool_choice"), names)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if not functions:
        return None
    return ToolRequest(tuple(functions), choice, name, parallel is not False)


def check_tool_message(message: dict, i: int) -> dict:
    """A ``tool`` message ({role, content, tool_call_id}) or an assistant message with ``tool_calls``, as the clean
    message the chat template reads (arguments as objects)."""
    where = f"messages[{i}]"
    if message["role"] == "tool":
        if not set(message) <= {"role", "content", "tool_call_id"} or \
                not isinstance(message.get("tool_call_id"), str):
            raise ToolError(f"{where}: a tool message needs a tool_call_id string (and role, content only)",
                            "messages")
        return {"role": "tool", "content": message.get("content"), "tool_call_id": message["tool_call_id"]}
    calls = message.get("tool_calls")
    if not set(message) <= {"role", "content", "tool_calls"} or not isinstance(calls, list) or not calls:
        raise ToolError(f"{where}.tool_calls must be a non-empty list", "messages")
    clean = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function" or \
                not isinstance(function.get("name"), str) or not isinstance(function.get("arguments"), str):
            raise ToolError(f"{where}.tool_calls[{k}] must be {{id, type: \"function\", function: {{name, "
                            "arguments}}}} with arguments a JSON string", "messages")
        try:
            arguments = json.loads(function["arguments"])
        except (json.JSONDecodeError, RecursionError):
            arguments = None
        if not isinstance(arguments, dict):
            raise ToolError(f"{where}.tool_calls[{k}].function.arguments is not a JSON object", "messages")
        clean.append({"id": str(call.get("id", "")), "type": "function",
                      "function": {"name": function["name"], "arguments": arguments}})
    return {"role": "assistant", "content": message.get("content") or "", "tool_calls": clean}


def _call_text(call: dict) -> str:
    body = {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
    return f"{OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{CLOSE}"


def _hermes_messages(messages: list[dict], tools: ToolRequest | None) -> list[dict]:
    """Messages for a template without a tools section: tools in the system prompt, calls and results as text."""
    out: list[dict] = []
    for message in messages:
        if message["role"] == "tool":
            block = f"<tool_response>\n{message['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        elif message.get("tool_calls"):
            texts = ([message["content"]] if message["content"] else []) + [_call_text(c)
                                                                             for c in message["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(texts)})
        else:
            out.append(dict(message))
    if tools is not None and tools.active:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools.openai_tools())
        block = TOOLS_PROMPT.format(tools=listed)
        if out and out[0]["role"] == "system":
            out[0]["content"] = out[0]["content"] + "\n\n" + block
        else:
            out.insert(0, {"role": "system", "content": block})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def template_has_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def chat_prompt_ids(messages: list[dict], tools: ToolRequest | None, tokenizer) -> list[int]:
    """The prompt's token ids: the chat template with the generation prompt, the tools rendered (module docstring)
    when ``tool_choice`` is not none, and ``<tool_call>\\n`` after it when the answer must be a call."""
    native = template_has_tools(tokenizer)
    shown = tools is not None and tools.active
    plain = not shown and not any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    if plain or native:
        kwargs = {"tools": tools.openai_tools()} if shown and native else {}
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                            **kwargs)["input_ids"]
    else:
        ids = tokenizer.apply_chat_template(_hermes_messages(messages, tools), add_generation_prompt=True,
                                            return_dict=True)["input_ids"]
    ids = list(ids)
    if shown and tools.constrained:
        ids += tokenizer.encode(OPEN + "\n", add_special_tokens=False)
    return ids


def _hoist(parameters: dict, prefix: str, defs: dict) -> dict:
    """``parameters`` with its local ``$defs``/``definitions`` moved into ``defs`` under ``prefix``-ed names and its
    ``$ref``s rewritten to match, so that it can sit inside a larger schema."""
    moved, subs = {}, {}
    for key in ("$defs", "definitions"):
        for name, sub in (parameters.get(key) or {}).items():
            moved[f"#/{key}/{name}"] = f"#/$defs/{prefix}{name}"
            subs[prefix + name] = sub

    def rewrite(node):
        if isinstance(node, dict):
            return {k: (moved.get(v, v) if k == "$ref" and isinstance(v, str) else rewrite(v))
                    for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    defs.update({name: rewrite(sub) for name, sub in subs.items()})
    return rewrite({k: v for k, v in parameters.items() if k not in ("$defs", "definitions")})


def call_schema(tools: ToolRequest) -> dict:
    """The JSON schema of one call ``{"name", "arguments"}``: the named function's, or any listed one's."""
    functions = [f for f in tools.functions if tools.choice != "named" or f["name"] == tools.name]
    defs: dict = {}
    options = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                 "arguments": _hoist(f["parameters"], f"{f['name']}__", defs)},
                "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return schema | ({"$defs": defs} if defs else {})


def _call(body, names: set[str]) -> dict | None:
    if not isinstance(body, dict) or body.get("name") not in names:
        return None
    arguments = body.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"id": _new_id(), "type": "function",
            "function": {"name": body["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _loads(text: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def _new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class CallScanner:
    """The calls of a constrained answer (``{"name": ..., "arguments": {...}}``, then :data:`SEPARATOR` and the next)
    read as its text arrives: :meth:`push` returns the streamed ``delta.tool_calls`` entries the new text completes
    (a call's id and name once its ``"arguments": `` is written, then its arguments' text as it comes; the SDK
    concatenates them); :attr:`calls` holds the calls so far, each call's ``arguments`` the text the model wrote.
    The grammar fixes the shape (the keys in that order, compact JSON), so nothing is guessed."""

    def __init__(self) -> None:
        self.text, self.at = "", 0  # all the text, and how far it has been read
        self.calls: list[dict] = []
        self._state = "head"  # head: before a call's arguments; arguments: inside them; tail: after them
        self._depth, self._string, self._escaped = 0, False, False

    def push(self, piece: str) -> list[dict]:
        self.text += piece
        deltas: list[dict] = []
        while self.at < len(self.text):
            if self._state == "head":
                head = _HEAD.match(self.text, self.at)
                if head is None:
                    break
                self.calls.append({"id": _new_id(), "type": "function",
                                   "function": {"name": head.group(1), "arguments": ""}})
                deltas.append({"index": len(self.calls) - 1, "id": self.calls[-1]["id"], "type": "function",
                               "function": {"name": head.group(1), "arguments": ""}})
                self.at, self._state = head.end(), "arguments"
            elif self._state == "arguments":
                start = self.at
                self._arguments()
                written = self.text[start:self.at]
                self.calls[-1]["function"]["arguments"] += written
                deltas.append({"index": len(self.calls) - 1, "function": {"arguments": written}})
            elif self.text.startswith("}" + SEPARATOR, self.at):
                self.at, self._state = self.at + 1 + len(SEPARATOR), "head"
            else:  # the closing brace, then the separator or the end
                break
        return deltas

    def _arguments(self) -> None:
        """Read the arguments object's characters (string-aware brace depth) up to its end or the text's."""
        while self.at < len(self.text):
            char = self.text[self.at]
            self.at += 1
            if self._string:
                self._string = self._escaped or char != '"'
                self._escaped = not self._escaped and char == "\\"
            elif char == '"':
                self._string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._state = "tail"
                    return

    @property
    def rest(self) -> str:
        """The text not read into a call (a call cut before its arguments began)."""
        return self.text[self.at:] if self._state == "head" else ""


def _split(text: str, tools: ToolRequest, finish_reason: str | None) -> tuple[str, list[dict]]:
    """(the text outside the parsed calls, the calls): :func:`parse_calls` before stripping."""
    names = {f["name"] for f in tools.functions}
    if tools.constrained:
        scanner = CallScanner()
        scanner.push(text)
        return scanner.rest, scanner.calls
    calls, kept, last = [], [], 0
    for match in _BLOCK.finditer(text):
        call = _call(_loads(match.group(1)), names)
        if call is None or (calls and not tools.parallel):
            continue
        calls.append(call)
        kept.append(text[last:match.start()])
        last = match.end()
    return ("".join(kept) + text[last:], calls) if calls else (text, [])


def parse_calls(text: str, tools: ToolRequest, finish_reason: str | None) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished answer. Constrained: the answer is one or more calls' JSON
    (:class:`CallScanner`; cut by the token budget, the calls as far as they were written, the last one's arguments
    cut short, as OpenAI answers then, and the text of a call cut before its arguments as content). Auto: each
    ``<tool_call>`` block that holds a call of a listed function becomes a call (the first only without
    ``parallel``); the rest of the text is the content (None when empty and there are calls)."""
    content, calls = _split(text, tools, finish_reason)
    if not calls:
        return content, []
    return content.strip() or None, calls


class ToolStream:
    """Streamed content and calls of one choice with tools. Constrained: the calls go out as they are written
    (:class:`CallScanner`). Auto: text goes out as content up to where a ``<tool_call>`` block may begin (a tail
    that could be the start of the tag is held back); a block is held until its ``</tool_call>`` arrives, then it
    goes out whole as a call if it holds a call of a listed function (only the first call without ``parallel``;
    after it all text is content) and as content otherwise; at the end a block left open (cut by the token budget
    or a stop) is read the same way. The blocks are read as :func:`parse_calls` reads the whole answer, so the
    streamed calls are its calls (with their own ids) and the streamed content its content, save for the
    stripping, as content sent cannot be taken back: whitespace at the end of the content so far is held (it may
    precede a call) and dropped at the end if there are calls, and the content's leading whitespace is dropped
    once a call is known, but content that opens with whitespace and goes out before the first call's block
    closes keeps that whitespace. Content that follows a call in the same piece waits for the next piece (or the
    end), so that it goes out after the call."""

    def __init__(self, tools: ToolRequest) -> None:
        self.tools, self.text = tools, ""
        self.calls: list[dict] = []
        self.scanner = CallScanner() if tools.constrained else None
        self.deltas: list[dict] = []  # the ``delta.tool_calls`` entries to send now, set by :meth:`push`
        self._names = {f["name"] for f in tools.functions}
        self._at = 0  # the text before it is read: content sent or held, or a call's block
        self._held = ""  # content read but not sent
        self._sent = False  # whether any content has gone out

    def push(self, piece: str, finished: bool, finish_reason: str | None = None) -> str:
        """Add released text; return the content to send now, with :attr:`deltas` the calls' pieces to send after
        it (:attr:`calls` holds the calls so far, all of them at the end)."""
        self.text += piece
        if self.scanner is not None:
            self.deltas, self.calls = self.scanner.push(piece), self.scanner.calls
            return self.scanner.rest if finished else ""
        self.deltas = []
        before = self._read(finished)
        if finished:
            return before + self._release(final=True)
        return before if self.deltas else before + self._release(final=False)

    def _read(self, finished: bool) -> str:
        """Read the text into held content and calls; return the content released before this piece's calls."""
        before = ""
        while self._at < len(self.text):
            calling = self.tools.parallel or not self.calls
            start = self.text.find(OPEN, self._at) if calling else -1
            if start < 0:
                end = len(self.text) if finished or not calling else len(self.text) - _tag_start(self.text, self._at)
                self._held, self._at = self._held + self.text[self._at:end], end
                break
            close = self.text.find(CLOSE, start + len(OPEN))
            self._held, self._at = self._held + self.text[self._at:start], start
            if close < 0 and not finished:
                break
            end = len(self.text) if close < 0 else close + len(CLOSE)
            call = _call(_loads(_BLOCK.match(self.text, start, end).group(1)), self._names)
            self._at = end
            if call is None:
                self._held += self.text[start:end]
                continue
            self.calls.append(call)
            self.deltas += call_deltas([call], first=len(self.calls) - 1)
            before += self._release(final=False)
        return before

    def _release(self, final: bool) -> str:
        """The held content to send now: without its trailing whitespace (kept held, or dropped at the end when
        there are calls), and without its leading whitespace when there are calls and no content went out yet."""
        text = self._held.lstrip() if self.calls and not self._sent else self._held
        out = text if final and not self.calls else text.rstrip()
        self._held, self._sent = text[len(out):], self._sent or bool(out)
        return out


def _tag_start(text: str, at: int) -> int:
    """The length of the longest end of ``text[at:]`` that could begin a ``<tool_call>`` tag."""
    for size in range(min(len(OPEN) - 1, len(text) - at), 0, -1):
        if text.endswith(OPEN[:size]):
            return size
    return 0


def call_deltas(calls: list[dict], first: int = 0) -> list[dict]:
    """The streamed ``delta.tool_calls`` entries of finished calls, indexed from ``first`` (the number of calls
    sent before them): per call, its id and name, then its arguments (as OpenAI streams them; the SDK concatenates
    the pieces)."""
    deltas = []
    for index, call in enumerate(calls, start=first):
        deltas.append({"index": index, "id": call["id"], "type": "function",
                       "function": {"name": call["function"]["name"], "arguments": ""}})
        deltas.append({"index": index, "function": {"arguments": call["function"]["arguments"]}})
    return deltas
