"""Tool calling through the server (xgrammar; skipped without it), on a tiny random Llama that speaks SmolLM2's
tokenizer and chat template (which has no tools section: tools go into the system prompt in Hermes' format):
required and named ``tool_choice`` always give ``tool_calls`` whose arguments validate, non-streamed and streamed
(assembled by the OpenAI SDK), greedy calls equal plain constrained decoding, a follow-up with the tool's result is
accepted, bad tools answer an OpenAI-style 400; the parsing and streaming of ``auto`` answers (each call sent as its
block closes, the same calls and content as the whole answer) and the rendering of a template that takes ``tools=``
are checked without a model."""

import json
from pathlib import Path
from typing import Literal

import httpx
import openai
import pytest
import torch
from pydantic import BaseModel, Field
from running import RunningServer

pytest.importorskip("xgrammar")

from specdraft.api import eos_token_ids, load_target
from specdraft.decoding import generate
from specdraft.grammar import GrammarCompiler
from specdraft.sequence import GenerationConfig
from specdraft.serve import ServeConfig, build_server_app
from specdraft.serve.tools import (
    OPEN,
    SEPARATOR,
    CallScanner,
    ToolStream,
    call_schema,
    chat_prompt_ids,
    check_tools,
    parse_calls,
)

SMOL = Path(__file__).resolve().parents[2] / "src/specdraft/weights/smollm2-135m-instruct-drafter"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and book me a flight there."}]


class Place(BaseModel):
    city: str = Field(max_length=12)
    country: Literal["FR", "DE", "IT"]


class Weather(BaseModel):
    place: Place
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=7)


class Flight(BaseModel):
    to: str = Field(max_length=10)
    seats: int = Field(ge=1, le=4)
    classes: list[Literal["economy", "business"]] = Field(max_length=2)


MODELS = {"get_weather": Weather, "book_flight": Flight}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} (a test tool)",
                                           "parameters": model.model_json_schema()}}
         for name, model in MODELS.items()]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import AutoTokenizer

    from toys import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("smol") / "tiny", seed=0,
                                tokenizer=AutoTokenizer.from_pretrained(SMOL), vocab_size=49152, max_positions=1024)


@pytest.fixture(scope="module")
def server(checkpoint):
    config = ServeConfig(target=str(checkpoint), drafter="prompt-lookup", served_model_name="tiny", max_batch=4,
                         max_tokens=128, max_n=2, speculation="fixed", num_draft_tokens=4)
    with RunningServer(build_server_app(config)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def _validated(calls, name: str | None = None, single: bool = False) -> None:
    assert calls and (len(calls) == 1 or not single)
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert name is None or call.function.name == name
        MODELS[call.function.name].model_validate_json(call.function.arguments)


CHOICES = ["required", _named("get_weather"), _named("book_flight")]
NEWLINE = {"198": 100}  # logit_bias: "\n", which only a next call can start


@pytest.mark.parametrize("tool_choice", CHOICES)
def test_required_and_named_tool_choice_give_calls_that_validate(client, tool_choice):
    name = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    for temperature, seed in ((0, None), (0.8, 1), (0.8, 2)):
        answer = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                                max_tokens=128, temperature=temperature, seed=seed, n=2)
        for choice in answer.choices:
            calls = choice.message.tool_calls
            if choice.finish_reason == "length":  # parallel calls (the default) up to the budget: the last one cut
                assert len(calls) >= 2 and (choice.message.content or "{").startswith("{")  # a head cut: content
                calls = calls[:-1]
            else:
                assert choice.finish_reason == "tool_calls" and choice.message.content is None
            _validated(calls, name)


@pytest.mark.parametrize("tool_choice", CHOICES[:2])
def test_without_parallel_tool_calls_an_answer_is_exactly_one_call(client, tool_choice):
    for temperature, seed in ((0, None), (1.0, 4)):
        answer = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                                parallel_tool_calls=False, max_tokens=128, temperature=temperature,
                                                seed=seed, n=2, logit_bias=NEWLINE | {"2": -100})
        for choice in answer.choices:
            assert choice.finish_reason == "tool_calls"
            _validated(choice.message.tool_calls, single=True)


@pytest.mark.parametrize("tool_choice", CHOICES[:2])
def test_parallel_calls_whole_and_streamed_token_by_token(client, tool_choice):
    """With parallel_tool_calls (the default) a required or named answer may hold several calls. Here the stop is
    all but forbidden and a newline, which only a next call can start, favoured: greedy, call follows call until the
    budget nears its end, where the grammar keeps only tokens after which the calls can still close, so the last
    call is closed short and every call validates. Streamed, each call's name comes first and its arguments in
    pieces as they are decoded, and the SDK assembles the same calls as the whole answer."""
    name = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=128,
                  temperature=0, logit_bias=NEWLINE | {"2": -100})
    answer = client.chat.completions.create(**kwargs)
    whole = answer.choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert 128 - 16 <= answer.usage.completion_tokens <= 128  # it ran into the budget's end
    assert answer.usage.model_extra["closed_at_budget"] == 1  # and says that the grammar closed it
    calls = whole.message.tool_calls
    assert len(calls) >= 2
    _validated(calls, name)
    with client.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls" and not streamed.message.content  # the SDK assembles ""
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in calls]
    pieces: dict[int, int] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            pieces[delta.index] = pieces.get(delta.index, 0) + bool(delta.function and delta.function.arguments)
    assert len(pieces) == len(calls) and min(pieces.values()) >= 2


def test_a_function_without_parameters_is_called_with_an_empty_object(client):
    tools = [{"type": "function", "function": {"name": "ping"}}]
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=tools, tool_choice="required",
                                            max_tokens=32, temperature=0.8, seed=3)
    call = answer.choices[0].message.tool_calls[0].function
    assert (call.name, json.loads(call.arguments)) == ("ping", {})


def test_greedy_call_equals_plain_constrained_decoding(client, checkpoint):
    target, tokenizer = load_target(str(checkpoint))
    eos = eos_token_ids(tokenizer, str(checkpoint))
    tools = check_tools({"tools": TOOLS, "tool_choice": _named("get_weather")})
    grammar = GrammarCompiler(tokenizer, target.vocab_size, eos).json_schema(call_schema(tools))
    ids = chat_prompt_ids(MESSAGES, tools, tokenizer)
    assert tokenizer.decode(ids).endswith(f"<|im_start|>assistant\n{OPEN}\n")
    plain = generate(target, ids, None, GenerationConfig(128, eos_token_ids=eos, logits_processor=grammar))
    expected = json.loads(tokenizer.decode(plain.token_ids, skip_special_tokens=True))
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=128,
                                            temperature=0, tool_choice=_named("get_weather"))
    call = answer.choices[0].message.tool_calls[0].function
    assert (call.name, json.loads(call.arguments)) == (expected["name"], expected["arguments"])


@pytest.mark.parametrize("tool_choice", CHOICES[:2])
def test_streamed_calls_are_assembled_by_the_sdk(client, tool_choice):
    name = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                           max_tokens=128, temperature=0)
    with client.chat.completions.stream(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                        max_tokens=128, temperature=0) as stream:
        streamed = stream.get_final_completion()
    choice = streamed.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    _validated(choice.message.tool_calls, name)
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]


def test_auto_answers_stream_the_same_content_as_whole_ones(client):
    """The random model never writes a call: its auto answer is text, and the held-back stream loses none of it."""
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=40, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=40,
                                                 temperature=0, stream=True))
    assert whole.choices[0].message.tool_calls is None and whole.choices[0].message.content
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_a_follow_up_with_the_tool_result_is_accepted(client):
    first = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=128, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = MESSAGES + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    for tool_choice in ("auto", "none", "required"):
        answer = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice=tool_choice,
                                                max_tokens=16, temperature=0)
        assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
        if tool_choice != "none":  # "none" does not show the tools, only the conversation
            assert answer.usage.prompt_tokens > first.usage.prompt_tokens


BAD = [
    ({"tool_choice": _named("fly")}, "tool_choice", "not in tools"),
    ({"tool_choice": {"type": "function"}}, "tool_choice", "tool_choice must be"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "strin"}}}}}]}, "tools", "invalid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"not": {"type": "string"}}}}}}]}, "tools", "unsupported JSON schema feature: 'not'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools",
     "type object"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "twice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "w " * 20000}}]}, "tools",
     "exceed this server's limit"),  # 40,000 characters of tools: over 32 x 1,024
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "combined"),
    ({"messages": [{"role": "tool", "content": "21"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "a", "type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]}, "messages", "arguments is not a JSON object"),
]


@pytest.mark.parametrize(("fields", "param", "message"), BAD)
def test_bad_tools_answer_400_naming_the_field(server, fields, param, message):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, "tools": TOOLS} | fields
    response = httpx.post(server.url + "/v1/chat/completions", timeout=60, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert error["type"] == "invalid_request_error"


AUTO = check_tools({"tools": TOOLS})


def test_auto_answers_are_parsed_into_calls_and_content():
    weather = '{"name": "get_weather", "arguments": {"place": {"city": "Rome", "country": "IT"}}}'
    text = f"Let me look.\n{OPEN}\n{weather}\n</tool_call>\n{OPEN}\n{{\"name\": \"book_flight\", " \
           '"arguments": "{\\"to\\": \\"Rome\\"}"}\n</tool_call>'
    content, calls = parse_calls(text, AUTO, "stop")
    assert content == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "book_flight"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"to": "Rome"}
    single = check_tools({"tools": TOOLS, "parallel_tool_calls": False})
    assert len(parse_calls(text, single, "stop")[1]) == 1
    for plain in ("No call here.", f"{OPEN}{{\"name\": \"unknown\", \"arguments\": {{}}}}</tool_call>",
                  f"{OPEN}{{broken</tool_call>"):
        assert parse_calls(plain, AUTO, "stop") == (plain, [])
    cut = check_tools({"tools": TOOLS, "tool_choice": "required"})
    assert parse_calls('{"name": "get_we', cut, "length") == ('{"name": "get_we', [])


def test_calls_are_read_as_they_are_written():
    first = '{"name": "book_flight", "arguments": {"to": "a}\\"{[", "seats": 2, "classes": ["economy"]}}'
    second = '{"name": "get_weather", "arguments": {"place": {"city": "Rome", "country": "IT"}, "days": 3}}'
    text = first + SEPARATOR + second
    whole = CallScanner()
    whole.push(text)
    assert [c["function"]["name"] for c in whole.calls] == ["book_flight", "get_weather"] and whole.rest == ""
    assert [json.loads(c["function"]["arguments"]) for c in whole.calls] == \
        [json.loads(first)["arguments"], json.loads(second)["arguments"]]
    scanner, assembled = CallScanner(), {}
    for start in range(0, len(text), 3):  # three characters at a time, as tokens come
        for delta in scanner.push(text[start:start + 3]):
            entry = assembled.setdefault(delta["index"], {"name": "", "arguments": ""})
            entry["name"] += delta["function"].get("name", "") if "id" in delta else ""
            entry["arguments"] += delta["function"]["arguments"]
    assert [(e["name"], e["arguments"]) for e in assembled.values()] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole.calls]
    cut = check_tools({"tools": TOOLS, "tool_choice": "required"})
    content, calls = parse_calls(text[:len(first) + 30], cut, "length")  # cut inside the second call's head
    assert content == text[len(first) + len(SEPARATOR):len(first) + 30] and len(calls) == 1
    content, calls = parse_calls(first[:50], cut, "length")  # cut inside the arguments: as far as written
    assert content is None and calls[0]["function"]["arguments"] == first[37:50]


def test_parallel_calls_are_a_grammar_of_one_or_more_calls():
    from transformers import AutoTokenizer

    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(SMOL), 49152, (2,))
    tools = check_tools({"tools": TOOLS, "tool_choice": "required"})
    one = '{"name": "book_flight", "arguments": {"to": "Oslo", "seats": 1, "classes": []}}'
    for text, parallel, accepted in ((one + SEPARATOR + one, True, True), (one, True, True),
                                     (one + SEPARATOR, False, False), (one + SEPARATOR, True, True)):
        grammar = compiler.json_schema_list(call_schema(tools), SEPARATOR) if parallel else \
            compiler.json_schema(call_schema(tools))
        assert grammar.matcher.accept_string(text) == accepted
        assert not accepted or grammar.matcher.is_completed() == text.endswith("}")
    ids = torch.tensor(compiler.encode(one))  # after one call: the stop, or a newline that starts the next one
    assert compiler.json_schema_list(call_schema(tools), SEPARATOR).certain_stop(ids) is None
    assert compiler.json_schema(call_schema(tools)).certain_stop(ids) == 2


def test_streamed_auto_content_stops_where_a_call_may_begin():
    stream = ToolStream(AUTO)
    sent = [stream.push(piece, False) for piece in ("Sure", ". <tool", "_call>\n{\"name\": ", '"book_flight"')]
    assert sent == ["Sure", ".", "", ""]  # the space waits: it precedes a call, which the whole answer strips
    assert stream.push(', "arguments": {"to": "Oslo"}}\n</tool_call> done', True, "stop") == "  done"
    assert [c["function"]["name"] for c in stream.calls] == ["book_flight"]
    assert parse_calls(stream.text, AUTO, "stop")[0] == "Sure.  done"
    plain = ToolStream(AUTO)
    assert plain.push("a <tool", False) == "a" and plain.push("box", True, "stop") == " <toolbox"
    assert plain.calls == []


SINGLE = check_tools({"tools": TOOLS, "parallel_tool_calls": False})
WEATHER = '{"name": "get_weather", "arguments": {"place": {"city": "Rome", "country": "IT"}, "days": 2}}'
FLIGHT = '{"name": "book_flight", "arguments": "{\\"to\\": \\"Rome\\", \\"seats\\": 1}"}'


def _block(body: str) -> str:
    return f"{OPEN}\n{body}\n</tool_call>"


def _streamed(tools, text: str, size: int, reason: str = "stop") -> tuple[list[str], list[list[dict]]]:
    """The content and the ``delta.tool_calls`` entries of each push, ``text`` fed ``size`` characters at a time."""
    stream, contents, deltas = ToolStream(tools), [], []
    starts = range(0, len(text), size)
    for k, start in enumerate(starts):
        finished = k == len(starts) - 1
        contents.append(stream.push(text[start:start + size], finished, reason if finished else None))
        deltas.append(stream.deltas)
    return contents, deltas


def _assembled(deltas: list[list[dict]]) -> list[tuple[str, str]]:
    """(name, arguments) per call index, as the SDK puts the entries together; each id is sent once."""
    calls: dict[int, list[str]] = {}
    ids = [d["id"] for pushed in deltas for d in pushed if "id" in d]
    assert len(ids) == len(set(ids)) == len({d["index"] for pushed in deltas for d in pushed})
    for delta in (d for pushed in deltas for d in pushed):
        entry = calls.setdefault(delta["index"], ["", ""])
        entry[0] += delta["function"].get("name", "") if "id" in delta else ""
        entry[1] += delta["function"]["arguments"]
    return [tuple(calls[i]) for i in range(len(calls))]


def _closing_push(text: str, size: int, occurrence: int = 1) -> int:
    """The push (``size`` characters each) in which the ``occurrence``-th ``</tool_call>`` is complete."""
    end = -1
    for _ in range(occurrence):
        end = text.index("</tool_call>", end + 1)
    return (end + len("</tool_call>") - 1) // size


def test_an_auto_call_streams_as_soon_as_its_block_closes():
    text = f"Let me check.\n{_block(WEATHER)}\nIt is sunny in Rome today."
    for size in (1, 3, 5):  # pieces that split the tags and the JSON
        contents, deltas = _streamed(AUTO, text, size)
        closing = _closing_push(text, size)
        assert [k for k, pushed in enumerate(deltas) if pushed] == [closing] and closing < len(deltas) - 1
        assert [d["index"] for d in deltas[closing]] == [0, 0] and deltas[closing][0]["function"]["name"] == \
            "get_weather"
        assert json.loads(deltas[closing][1]["function"]["arguments"]) == json.loads(WEATHER)["arguments"]
        assert "".join(contents[:closing + 1]) == "Let me check."
        assert any(contents[closing + 1:-1]), "the content after the block streams before the end"
        assert "".join(contents) == "Let me check.\n\nIt is sunny in Rome today." == parse_calls(text, AUTO, "stop")[0]


def test_parallel_auto_calls_are_indexed_and_each_sent_when_closed():
    text = f"{_block(WEATHER)}\n{_block(FLIGHT)}\nBoth done."
    for size in (2, 7):
        contents, deltas = _streamed(AUTO, text, size)
        first, second = _closing_push(text, size), _closing_push(text, size, 2)
        assert [k for k, pushed in enumerate(deltas) if pushed] == [first, second] and second < len(deltas) - 1
        assert [d["index"] for d in deltas[first]] == [0, 0] and [d["index"] for d in deltas[second]] == [1, 1]
        assert _assembled(deltas) == [("get_weather", json.dumps(json.loads(WEATHER)["arguments"])),
                                      ("book_flight", '{"to": "Rome", "seats": 1}')]
        assert "".join(contents) == "Both done."


@pytest.mark.parametrize("body", ['{"name": "get_weather", "arguments": {"place": ', "{broken",
                                  '{"name": "unknown", "arguments": {}}', '{"name": "book_flight", "arguments": 3}'])
def test_an_invalid_auto_block_streams_as_content_once_closed(body):
    text = f"Trying.\n{_block(body)}\nThat failed, {_block(FLIGHT)} so booked."
    contents, deltas = _streamed(AUTO, text, 4)
    assert "".join(contents[:_closing_push(text, 4) + 1]).startswith(f"Trying.\n{_block(body)}")
    assert _assembled(deltas) == [("book_flight", '{"to": "Rome", "seats": 1}')]
    assert [k for k, pushed in enumerate(deltas) if pushed] == [_closing_push(text, 4, 2)]
    assert "".join(contents) == parse_calls(text, AUTO, "stop")[0] == \
        f"Trying.\n{_block(body)}\nThat failed,  so booked."


def test_without_parallel_calls_only_the_first_call_streams_and_the_rest_is_content():
    text = f"On it.\n{_block(FLIGHT)}\n{_block(WEATHER)}\nDone."
    contents, deltas = _streamed(SINGLE, text, 3)
    assert [k for k, pushed in enumerate(deltas) if pushed] == [_closing_push(text, 3)]
    assert _assembled(deltas) == [("book_flight", '{"to": "Rome", "seats": 1}')]
    assert _block(WEATHER) in "".join(contents[:_closing_push(text, 3, 2) + 1]), "streamed as it comes"
    assert "".join(contents) == parse_calls(text, SINGLE, "stop")[0] == f"On it.\n\n{_block(WEATHER)}\nDone."


STREAMED_TEXTS = [
    "Just text, no call.  ",
    "   Leading space, then text <toolbox> and <tool",
    _block(WEATHER),
    f"\n\n{_block(WEATHER)}\n\n",
    f"Let me look.\n{_block(WEATHER)}\n{_block(FLIGHT)}",
    f"{_block(WEATHER)} between {_block('{broken')} and {_block(FLIGHT)} after \n",
    f"{_block(WEATHER)}\n{OPEN}\n{FLIGHT}\n",  # the last block cut before its end tag (a stop, the budget)
    f"Cut: {_block(WEATHER)}\n{OPEN}\n{FLIGHT[:30]}",
    f"{OPEN} nested {OPEN}\n{WEATHER}\n</tool_call> tail {_block(FLIGHT)}",
    f"  Opening space. {_block(FLIGHT)}\n\nAfter.",
]


@pytest.mark.parametrize("text", STREAMED_TEXTS)
@pytest.mark.parametrize("tools", [AUTO, SINGLE], ids=["parallel", "single"])
def test_streamed_auto_answers_equal_the_whole_answer(text, tools):
    """For any piece size: the same calls as :func:`parse_calls` of the whole text, and the same content save
    leading whitespace sent before the first call (and exactly the same without calls)."""
    content, calls = parse_calls(text, tools, "length")
    for size in (1, 2, 3, 5, 8, 13, len(text)):
        contents, deltas = _streamed(tools, text, size, "length")
        streamed = "".join(contents)
        assert _assembled(deltas) == [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        if calls:
            assert streamed.lstrip() == (content or "") and streamed.strip() == (content or "")
        else:
            assert streamed == content


HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_with_a_tools_section_renders_them_itself():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOL)
    tokenizer.chat_template = HERMES_TEMPLATE
    history = MESSAGES + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "book_flight", "arguments": {"to": "Paris"}}}]},
        {"role": "tool", "content": "booked", "tool_call_id": "a"}]
    text = tokenizer.decode(chat_prompt_ids(history, AUTO, tokenizer))
    assert text.startswith('<|im_start|>system\n<tools>{"type": "function", "function": {"name": "get_weather"')
    assert '<tool_call>{"name": "book_flight", "arguments": {"to": "Paris"}}</tool_call>' in text
    assert "# Tools" not in text and text.endswith("<|im_start|>assistant\n")
