"""The server through the official ``openai`` client and raw HTTP, on a tiny Llama: outputs equal batch-1
decoding, streaming equals non-streaming, bad input answers 400 (or 429) and the server keeps serving."""

import time

import httpx
import openai
import pytest
from running import RunningServer

from specdraft.api import eos_token_ids, load_target
from specdraft.decoding import generate
from specdraft.drafters import PromptLookupDrafter
from specdraft.errors import SpecdraftError
from specdraft.sampling import LogitPenalties, SamplingConfig
from specdraft.sequence import GenerationConfig
from specdraft.serve import ServeConfig, build_server_app
from specdraft.serve.engine import Engine, QueueFull, Request

MESSAGES = [{"role": "user", "content": "w1 w2 w3 w4 w1 w2"}]


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    config = ServeConfig(target=str(tiny_checkpoint), drafter="prompt-lookup", served_model_name="tiny",
                         max_batch=4, max_queue=8, max_prompt_tokens=64, max_tokens=48, max_n=3)
    with RunningServer(build_server_app(config)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """Batch-1 greedy decoding of the chat prompt, as `specdraft generate` runs it."""
    target, tokenizer = load_target(str(tiny_checkpoint))
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)["input_ids"]
    config = GenerationConfig(40, 4, eos_token_ids=eos_token_ids(tokenizer, str(tiny_checkpoint)))
    result = generate(target, ids, PromptLookupDrafter(), config)
    return tokenizer.decode(result.token_ids, skip_special_tokens=True), result, len(ids)


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_chat_completion_equals_batch_one_greedy(client, reference):
    text, result, prompt_tokens = reference
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, temperature=0)
    assert response.choices[0].message.content == text
    assert response.choices[0].finish_reason == ("length" if result.finish_reason == "length" else "stop")
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == len(result.token_ids)


def test_logit_bias_and_penalties_equal_batch_one_greedy_with_the_same_processing(client, tiny_checkpoint):
    """The request's bias and penalties reach every verified position: the answer is batch-1 decoding's with the
    same :class:`LogitPenalties`, and differs from the answer without them."""
    target, tokenizer = load_target(str(tiny_checkpoint))
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)["input_ids"]
    penalties = LogitPenalties(((10, 3.0), (20, -100.0)), frequency_penalty=1.5, presence_penalty=0.5)
    config = GenerationConfig(30, 4, eos_token_ids=eos_token_ids(tokenizer, str(tiny_checkpoint)),
                              logits_processor=penalties)
    expected = generate(target, ids, PromptLookupDrafter(), config).token_ids
    fields = dict(model="tiny", messages=MESSAGES, max_tokens=30, temperature=0)
    response = client.chat.completions.create(**fields, logit_bias={"10": 3, "20": -100}, frequency_penalty=1.5,
                                              presence_penalty=0.5)
    assert response.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert response.choices[0].message.content != client.chat.completions.create(**fields).choices[0].message.content
    completion = client.completions.create(model="tiny", prompt=ids, max_tokens=30, temperature=0,
                                           logit_bias={"10": 3, "20": -100}, frequency_penalty=1.5,
                                           presence_penalty=0.5)
    assert completion.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)


def test_streaming_equals_non_streaming(client, reference):
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    pieces, reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert "".join(pieces) == reference[0]
    assert reasons[-1] in ("stop", "length") and usage.completion_tokens == len(reference[1].token_ids)


def test_completions_stream_and_not(client, tiny_checkpoint):
    whole = client.completions.create(model="tiny", prompt="w5 w6 w7 w5 w6", max_tokens=12, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="w5 w6 w7 w5 w6", max_tokens=12, temperature=0, stream=True))
    assert whole.choices[0].text == streamed and whole.usage.completion_tokens <= 12


def test_n_choices_sampled_with_a_seed_are_reproducible(client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=10, temperature=1.0, n=3, seed=7)
    first, second = client.chat.completions.create(**kwargs), client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]


BAD = [
    ({"model": "other", "messages": MESSAGES}, "model"),
    ({"model": "tiny", "messages": []}, "messages"),
    ({"model": "tiny", "messages": [{"role": "user"}]}, "messages"),
    ({"model": "tiny", "messages": MESSAGES, "temperature": -0.5}, "temperature"),
    ({"model": "tiny", "messages": MESSAGES, "top_p": 0}, "top_p"),
    ({"model": "tiny", "messages": MESSAGES, "top_p": 1.5}, "top_p"),
    ({"model": "tiny", "messages": MESSAGES, "n": 9}, "n"),
    ({"model": "tiny", "messages": MESSAGES, "max_tokens": 4096}, "max_tokens"),
    ({"model": "tiny", "messages": MESSAGES, "temperature": "hot"}, "temperature"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "w1 " * 100}]}, "messages"),
    ([1, 2], None),
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_bad_input_answers_400_with_an_openai_error(server, body, param):
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param


def test_malformed_json_and_bad_prompt_answer_400_and_the_server_keeps_serving(server, client):
    for path, data in (("/v1/chat/completions", b"{not json"), ("/v1/completions", b'{"model": "tiny"}'),
                       ("/v1/completions", b"\xff\xfe")):
        response = httpx.post(server.url + path, content=data, headers={"content-type": "application/json"})
        assert response.status_code == 400, path
        assert response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="unknown model"):
        client.chat.completions.create(model="nope", messages=MESSAGES)
    assert client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3).choices[0].message


def test_a_full_queue_answers_429(tiny_checkpoint):
    config = ServeConfig(target=str(tiny_checkpoint), served_model_name="tiny", max_batch=1, max_queue=0, max_n=2)
    with RunningServer(build_server_app(config)) as running:
        body = {"model": "tiny", "messages": MESSAGES, "n": 2, "max_tokens": 4}
        response = httpx.post(running.url + "/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 429
        assert response.json()["error"]["type"] == "rate_limit_exceeded"
        body["n"] = 1
        assert httpx.post(running.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200


def test_engine_queue_bound_and_cancellation(tiny_checkpoint):
    target, tokenizer = load_target(str(tiny_checkpoint))
    engine = Engine(target, tokenizer, lambda: None, max_batch=2, capacity=128, max_queue=1)
    config = GenerationConfig(8, 2, SamplingConfig())
    engine.submit(Request([5, 6, 7], config, n=3))  # 2 free rows + 1 queue slot
    with pytest.raises(QueueFull):
        engine.submit(Request([5, 6, 7], config))
    assert engine.queue_length == 3


def test_disconnected_stream_is_dropped_and_metrics_count(server, client):
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=30,
                      json={"model": "tiny", "messages": MESSAGES, "max_tokens": 48, "stream": True}) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the first event, then hang up
    assert client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3).choices[0].message
    text = httpx.get(server.url + "/metrics").text
    for name in ("specdraft_requests_total", "specdraft_completion_tokens_total", "specdraft_block_efficiency",
                 "specdraft_acceptance_rate", "specdraft_queue_length", "specdraft_tokens_per_second"):
        assert name in text
    assert 'status="400"' in text and 'status="200"' in text
    tau = float(next(line for line in text.splitlines() if line.startswith("specdraft_block_efficiency ")).split()[1])
    assert tau >= 1.0


def test_bad_config_is_a_clear_error():
    with pytest.raises(SpecdraftError, match="max_batch"):
        ServeConfig(target="x", max_batch=0)
    with pytest.raises(SpecdraftError, match="not both"):
        ServeConfig(target="x", draft="y", drafter="prompt-lookup")


class _SlowDrafter:
    """Proposes nothing, slowly: keeps a sequence in the batch long enough to be cancelled mid-way."""

    name, vocab_size, max_context = "slow", None, None

    def begin(self, target, cache) -> None:
        pass

    def propose(self, context, num_draft_tokens, sampling, generator):
        from specdraft.drafters.base import EMPTY_DRAFT

        time.sleep(0.05)
        return EMPTY_DRAFT

    def observe(self, result) -> None:
        pass


def test_a_cancelled_request_leaves_the_batch_before_the_next_step(tiny_checkpoint):
    import asyncio

    target, tokenizer = load_target(str(tiny_checkpoint))
    engine = Engine(target, tokenizer, _SlowDrafter, max_batch=2, capacity=256, max_queue=2)
    engine.start()

    async def scenario():
        request = Request([5, 6, 7], GenerationConfig(200, 2), loop=asyncio.get_running_loop(),
                          events=asyncio.Queue())
        engine.submit(request)
        first = await asyncio.wait_for(request.events.get(), 10)
        engine.cancel(request)
        for _ in range(100):
            if engine.running == 0:
                break
            await asyncio.sleep(0.05)
        return first, request

    try:
        first, request = asyncio.run(scenario())
        assert first.tokens and first.finish_reason is None
        assert engine.running == 0 and engine.metrics.cancelled == 1
        assert request.completion_tokens < 200
    finally:
        engine.stop()


def test_requests_run_the_servers_speculation_and_a_seeded_sample_replays():
    """serve speaks GenerationConfig's vocabulary: each request's config carries the server's speculation, γ and
    max_draft_batch (the batch's policy is made from it); a sampled request with a seed runs fixed speculation, the
    one whose draws a seed replays."""
    from specdraft.serve.protocol import check

    body = {"model": "t", "prompt": [1, 2, 3], "max_tokens": 4}
    for speculation in ("adaptive", "fixed"):
        serve = ServeConfig(target="t", speculation=speculation, num_draft_tokens=3, max_draft_batch=2)
        config = check(body, False, serve, (2,), 64).config
        assert (config.speculation, config.num_draft_tokens, config.max_draft_batch) == (speculation, 3, 2)
    serve = ServeConfig(target="t")
    assert check({**body, "temperature": 1.0, "seed": 5}, False, serve, (2,), 64).config.speculation == "fixed"
    assert check({**body, "temperature": 1.0}, False, serve, (2,), 64).config.speculation == "adaptive"  # no seed
    assert check({**body, "temperature": 0, "seed": 5}, False, serve, (2,), 64).config.speculation == "adaptive"
    with pytest.raises(SpecdraftError, match="speculation must be one of"):
        ServeConfig(target="t", speculation="always")


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_a_conversations_next_turn_reads_its_start_from_the_kept_cache(tiny_checkpoint, prefix_cache):
    """A chat's second turn (its first turn and the answer, then more) reads the positions the first left in the
    batch's cache (``usage.prompt_tokens_details.cached_tokens``, the metrics' counter); answers equal fresh batch-1
    decoding's either way."""
    config = ServeConfig(target=str(tiny_checkpoint), quantize="int4", served_model_name="tiny", max_batch=2,
                         max_prompt_tokens=128, max_tokens=16, prefix_cache=prefix_cache)
    target, tokenizer = load_target(str(tiny_checkpoint), quantize="int4")
    eos = eos_token_ids(tokenizer, str(tiny_checkpoint))

    def fresh(messages):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        result = generate(target, ids, None, GenerationConfig(16, eos_token_ids=eos))
        return tokenizer.decode(result.token_ids, skip_special_tokens=True), len(ids)

    with RunningServer(build_server_app(config)) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        messages = list(MESSAGES)
        first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "w3 w4"}]
        second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
        metrics = httpx.get(running.url + "/metrics").text
    (text_1, length_1), (text_2, _) = fresh(MESSAGES), fresh(messages)
    assert first.choices[0].message.content == text_1 and second.choices[0].message.content == text_2
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert (cached >= length_1) if prefix_cache else (cached == 0)
    assert f"specdraft_prompt_tokens_cached_total {cached}\n" in metrics
