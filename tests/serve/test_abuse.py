"""The server under hostile and careless input, on a tiny Llama over loopback: every field range-checked before it
reaches torch (400 naming it), unsupported fields refused by name, limits applied before any work (413 for a large
body, a character limit before tokenising), a request that poisons its own distribution fails alone, and log-probs
come from the target's distribution."""

import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from running import RunningServer, start_cli_server

from specdraft.api import load_target
from specdraft.sampling import SamplingConfig, warp
from specdraft.serve import ServeConfig, build_server_app

MESSAGES = [{"role": "user", "content": "w1 w2 w3 w4 w1 w2"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    config = ServeConfig(target=str(tiny_checkpoint), drafter="prompt-lookup", served_model_name="tiny",
                         max_batch=8, max_queue=16, max_prompt_tokens=64, max_tokens=48, max_n=3,
                         max_body_bytes=1 << 16, max_prompt_chars=2000)
    with RunningServer(build_server_app(config)) as running:
        yield running


def _post(server, path: str, body: dict | None = None, content: bytes | None = None, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json=body, content=content, timeout=60,
                      headers=None if content is None else {"content-type": "application/json"}, **kwargs)


def _chat(**fields) -> dict:
    return {"model": "tiny", "messages": MESSAGES, "max_tokens": 8} | fields


def _assert_openai_error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["message"] and error["param"] == param
    assert error["type"] == ("invalid_request_error" if status in (400, 413) else error["type"])
    return error


BAD_FIELDS = [
    (CHAT, _chat(seed=2**64), "seed"),
    (CHAT, _chat(seed=-(2**63) - 1), "seed"),
    (COMPLETIONS, {"model": "tiny", "prompt": [5, 6, 10**30]}, "prompt"),
    (COMPLETIONS, {"model": "tiny", "prompt": [5, -1]}, "prompt"),
    (COMPLETIONS, {"model": "tiny", "prompt": [[5, 64]]}, "prompt"),  # the vocabulary has 64 tokens: 0 .. 63
    (CHAT, _chat(max_tokens=10**200), "max_tokens"),
    (CHAT, _chat(n=10**30), "n"),
    (CHAT, _chat(temperature=10**400), "temperature"),
    (CHAT, _chat(temperature=2.5), "temperature"),
    (CHAT, _chat(top_p=10**30), "top_p"),
    (CHAT, _chat(top_k=-1), "top_k"),
    (CHAT, _chat(top_k=1.5), "top_k"),
    (CHAT, _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]), "tools"),
    (CHAT, _chat(tool_choice="auto"), "tool_choice"),  # no tools to choose from
    (CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function",
                                                                                     "function": {"name": "g"}}),
     "tool_choice"),
    (CHAT, _chat(response_format={"type": "json"}), "response_format"),
    (CHAT, _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}),
     "response_format"),
    (CHAT, _chat(frequency_penalty=2.5), "frequency_penalty"),
    (CHAT, _chat(frequency_penalty="high"), "frequency_penalty"),
    (CHAT, _chat(presence_penalty=-2.01), "presence_penalty"),
    (COMPLETIONS, {"model": "tiny", "prompt": "w1", "presence_penalty": 10**30}, "presence_penalty"),
    (CHAT, _chat(logit_bias={"5": 100.5}), "logit_bias"),
    (CHAT, _chat(logit_bias={"5": "up"}), "logit_bias"),
    (CHAT, _chat(logit_bias={"5": None}), "logit_bias"),
    (CHAT, _chat(logit_bias={"64": 1}), "logit_bias"),  # the vocabulary has 64 tokens: 0 .. 63
    (CHAT, _chat(logit_bias={"-1": 1}), "logit_bias"),
    (CHAT, _chat(logit_bias={"w1": 1}), "logit_bias"),
    (CHAT, _chat(logit_bias={"5": 1, "05": 2}), "logit_bias"),  # one token named twice
    (CHAT, _chat(logit_bias={str(i): 1 for i in range(301)}), "logit_bias"),
    (COMPLETIONS, {"model": "tiny", "prompt": "w1", "logit_bias": [5, 10]}, "logit_bias"),
    (CHAT, _chat(min_p=0.1), "min_p"),
    (CHAT, _chat(logprobs=1), "logprobs"),
    (CHAT, _chat(top_logprobs=3), "top_logprobs"),
    (CHAT, _chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (COMPLETIONS, {"model": "tiny", "prompt": "w1", "logprobs": 21}, "logprobs"),
    (COMPLETIONS, {"model": "tiny", "prompt": "w1", "echo": True}, "echo"),
    (COMPLETIONS, {"model": "tiny", "prompt": "w1", "best_of": 3}, "best_of"),
    (CHAT, _chat(stream_options={"include_usage": True, "other": 1}), "stream_options"),
    (CHAT, _chat(messages=[{"role": "user", "content": "w1", "name": "bob"}]), "messages"),
    (CHAT, _chat(messages=[{"role": "tool", "content": "w1"}]), "messages"),  # a tool result needs tool_call_id
    (CHAT, _chat(messages=[{"role": "tool", "content": "w1", "tool_call_id": "x", "name": "f"}]), "messages"),
    (CHAT, _chat(messages=[{"role": "user", "content": "w1 " * 700}]), "messages"),  # over the character limit
    (CHAT, _chat(messages=[{"role": "user", "content": ""}] * 65), "messages"),  # more messages than prompt tokens
    (CHAT, _chat(user=5), "user"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_FIELDS)
def test_every_bad_or_unsupported_field_answers_400_naming_it(server, path, body, param):
    _assert_openai_error(_post(server, path, body), 400, param)


RAW_BODIES = [  # well-formed but strange: each once made a 500 with a text/plain body
    (CHAT, '{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
    (COMPLETIONS, '{"model": "tiny", "prompt": "w1 \\udfff"}', "prompt"),
    (CHAT, '{"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "stop": ["\\ud800"]}', "stop"),
    (CHAT, '{"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "max_tokens": ' + "9" * 5000 + "}",
     None),
    (CHAT, '{"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "temperature": 0.' + "9" * 400 + "}",
     None),  # a float: 1.0, accepted
    (CHAT, '{"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "temperature": ' + "9" * 400 + "}",
     "temperature"),
    (CHAT, '{"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "temperature": 1e400}',
     "temperature"),
    (CHAT, '{"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "top_p": NaN}', "top_p"),
    (CHAT, '{"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "logit_bias": {"5": NaN}}',
     "logit_bias"),
    (CHAT, '{"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "frequency_penalty": -Infinity}',
     "frequency_penalty"),
    (CHAT, "[" * 30_000 + "]" * 30_000, None),
    (CHAT, '{"model": "\\ud800", "messages": []}', "model"),
]


@pytest.mark.parametrize(("path", "raw", "param"), RAW_BODIES)
def test_strange_but_well_formed_bodies_answer_400_not_500(server, path, raw, param):
    response = _post(server, path, content=raw.encode())
    if "0." + "9" * 400 in raw:
        assert response.status_code == 200, response.text
        return
    _assert_openai_error(response, 400, param)


def test_no_input_made_a_500(server):
    """Every answer in this module's server was a 400, 413 or 200, each counted in /metrics; the fields that
    change nothing are accepted."""
    assert _post(server, CHAT, content=b'{"model": "tiny", "messages": "\\ud800"}').status_code == 400
    for body in (_chat(), _chat(top_k=10**30), _chat(tools=[], frequency_penalty=0, logit_bias={}, user="me")):
        assert _post(server, CHAT, body).status_code == 200
    metrics = httpx.get(server.url + "/metrics").text
    assert 'status="400"' in metrics and 'status="500"' not in metrics


def test_top_k_above_the_vocabulary_is_clamped_to_it(server):
    """The documented rule: top_k at or above the vocabulary size keeps every token, as top_k 0 does."""
    answers = [_post(server, CHAT, _chat(temperature=1.0, seed=3, top_k=k, max_tokens=12)).json() for k in
               (10**30, 64, 0)]
    texts = [a["choices"][0]["message"]["content"] for a in answers]
    assert texts[0] == texts[1] == texts[2]


def test_a_large_body_is_refused_with_413_before_it_is_read(server):
    big = b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"w1 " * 3_500_000 + b'"}]}'
    _assert_openai_error(_post(server, CHAT, content=big), 413, None)

    def chunked():  # no Content-Length: refused once the bytes read pass the limit
        for start in range(0, len(big), 1 << 16):
            yield big[start : start + (1 << 16)]

    _assert_openai_error(_post(server, CHAT, content=chunked()), 413, None)
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_a_temperature_that_overflows_fp32_is_greedy_beside_healthy_streams(server):
    """temperature 1e-300 (0 in fp32: logits / T is inf or NaN) once failed its whole batch with 500. It decodes
    greedily now, and the four greedy streams beside it answer as they do alone."""
    prompts = [[{"role": "user", "content": f"w{i} w{i + 1} w{i + 2} w{i} w{i + 1}"}] for i in (3, 10, 20, 30)]

    def stream(messages, temperature=0.0):
        with httpx.stream("POST", server.url + CHAT, timeout=60, json=_chat(
                messages=messages, max_tokens=40, temperature=temperature, stream=True)) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert not any("error" in chunk for chunk in chunks), chunks
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)

    with ThreadPoolExecutor(5) as pool:
        poison = pool.submit(stream, MESSAGES, 1e-300)
        together = list(pool.map(stream, prompts))
    alone = [stream(messages) for messages in prompts]
    assert together == alone
    assert poison.result() == stream(MESSAGES)


def _target_logprobs(tiny_checkpoint, ids: list[int], start: int, sampling: SamplingConfig | None) -> torch.Tensor:
    """log p (len(ids) - start, V) of tokens start.. of ``ids``, straight from the target's logits: warped by
    ``sampling``, or the raw log-softmax (None)."""
    target, _ = load_target(str(tiny_checkpoint))
    with torch.inference_mode():
        logits = target.forward(torch.tensor([ids]), target.new_cache(len(ids) + 1))[0, start - 1 : -1]
    return torch.log_softmax(logits.float(), -1) if sampling is None else torch.log(warp(logits, sampling))


@pytest.mark.parametrize("sampling", [None, SamplingConfig(0.8, 6, 0.9)], ids=["greedy", "warped"])
def test_completion_logprobs_are_the_targets(server, tiny_checkpoint, sampling):
    prompt = [5, 9, 3, 17, 9, 3, 22]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "logprobs": 3, "seed": 1,
            "temperature": 0 if sampling is None else sampling.temperature,
            "top_k": 0 if sampling is None else sampling.top_k, "top_p": 1 if sampling is None else sampling.top_p}
    response = _post(server, COMPLETIONS, body)
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    _, tokenizer = load_target(str(tiny_checkpoint))
    ids = tokenizer.convert_tokens_to_ids(logprobs["tokens"])
    expected = _target_logprobs(tiny_checkpoint, prompt + ids, len(prompt), sampling)  # (k, V)
    got = torch.tensor(logprobs["token_logprobs"])
    assert torch.allclose(got, expected[torch.arange(len(ids)), torch.tensor(ids)], atol=1e-4)
    for row, top in enumerate(logprobs["top_logprobs"]):
        best = expected[row].topk(3)
        assert [tokenizer.convert_tokens_to_ids(t) for t in top] == best.indices.tolist()
        assert all(math.isclose(v, max(float(e), -9999.0), abs_tol=1e-4) for v, e in
                   zip(top.values(), best.values, strict=True))
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])


def test_chat_logprobs_streamed_equal_whole_and_follow_the_openai_schema(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kwargs).choices[0]
    content = whole.logprobs.content
    assert content and all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.logprob == entry.top_logprobs[0].logprob for entry in content)  # greedy: the argmax
    assert all(entry.bytes == list(entry.token.encode()) for entry in content)
    streamed = [entry for chunk in client.chat.completions.create(**kwargs, stream=True) for choice in chunk.choices
                if choice.logprobs is not None for entry in choice.logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]
    assert client.chat.completions.create(**(kwargs | {"logprobs": False, "top_logprobs": None})).choices[
        0].logprobs is None


def test_a_default_max_tokens_fits_the_context_and_an_explicit_one_must(tiny_checkpoint):
    """The tiny target's context is 256 positions: a server allowing 250 + 200 shortens a chat request's default
    max_tokens to what fits, and refuses an explicit one that does not fit (400 naming max_tokens)."""
    from specdraft.serve.protocol import BadRequest, parse

    _, tokenizer = load_target(str(tiny_checkpoint))
    serve = ServeConfig(target="tiny", max_prompt_tokens=250, max_tokens=200)
    messages = [{"role": "user", "content": "w1 " * 100}]
    parsed = parse({"model": "tiny", "messages": messages}, True, tokenizer, serve, (2,), 64, 256)
    assert parsed.config.max_new_tokens == 256 - len(parsed.prompt_ids) < 200
    with pytest.raises(BadRequest) as refused:
        parse({"model": "tiny", "messages": messages, "max_tokens": 200}, True, tokenizer, serve, (2,), 64, 256)
    assert refused.value.param == "max_tokens" and "context of 256" in refused.value.message


@pytest.mark.slow
def test_a_10_mb_body_is_refused_within_a_second_while_health_answers_in_100_ms(tiny_checkpoint, tmp_path):
    """The server as run (its own process, default limits): bodies of 10 MB and more answer 413 in under 1 s, and
    /health, asked every 10 ms meanwhile, always answers in under 100 ms."""
    process, url = start_cli_server(tmp_path / "serve.log", "--target", str(tiny_checkpoint), "--served-model-name",
                                    "tiny")
    one_message = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "w1 " * 3_500_000}]})
    many = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "w1 w2 w3 w4 w5 w6"}] * 200_000})
    health, stop = [], threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=url, timeout=5) as client:
            while not stop.is_set():
                began = time.perf_counter()
                assert client.get("/health").status_code == 200
                health.append(time.perf_counter() - began)
                time.sleep(0.01)

    poller = threading.Thread(target=poll)
    try:
        poller.start()
        time.sleep(0.2)
        for body in (one_message.encode(), many.encode(), (one_message.encode()[i : i + 65536] for i in
                                                            range(0, len(one_message), 65536))):
            began = time.perf_counter()
            response = httpx.post(url + CHAT, content=body, timeout=30, headers={"content-type": "application/json"})
            took = time.perf_counter() - began
            assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
            assert took < 1.0, f"413 after {took:.2f} s"
        time.sleep(0.2)
    finally:
        stop.set()
        poller.join(10)
        process.terminate()
        process.wait(30)
    assert len(health) > 10 and max(health) < 0.1, f"/health took up to {max(health) * 1000:.0f} ms"


def test_a_server_bug_is_a_json_500_counted_in_metrics(tiny_checkpoint):
    """A failure that is not the request's (here a drafter factory and the engine's submit that raise) answers a
    JSON 500, or an error event and [DONE] in a stream, and /metrics counts it."""
    from specdraft.serve.app import build_app
    from specdraft.serve.engine import Engine

    target, tokenizer = load_target(str(tiny_checkpoint))

    def broken_drafter():
        raise RuntimeError("a bug in the drafter factory")

    engine = Engine(target, tokenizer, broken_drafter, max_batch=2, capacity=64, max_queue=4)
    serve = ServeConfig(target="tiny", max_prompt_tokens=32, max_tokens=16)
    with RunningServer(build_app(engine, tokenizer, serve, (2,))) as running:
        error = _assert_openai_error(_post(running, CHAT, _chat()), 500, None)
        assert error["type"] == "server_error" and "drafter factory" in error["message"]
        with httpx.stream("POST", running.url + CHAT, json=_chat(stream=True), timeout=60) as response:
            lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["type"] == "server_error"
        engine.submit = None  # calling it raises TypeError: a bug in the handler's own code
        error = _assert_openai_error(_post(running, COMPLETIONS, {"model": "tiny", "prompt": "w1"}), 500, None)
        assert error["message"] == "internal server error: TypeError"
        metrics = httpx.get(running.url + "/metrics").text
    assert 'specdraft_requests_total{endpoint="/v1/chat/completions",status="500"} 1' in metrics
    assert 'specdraft_requests_total{endpoint="/v1/completions",status="500"} 1' in metrics
    assert 'specdraft_stream_errors_total{endpoint="/v1/chat/completions",status="500"} 1' in metrics
