"""Structured outputs through the server (xgrammar; skipped without it), on a tiny random Llama that speaks
SmolLM2's tokenizer: the OpenAI SDK's ``parse`` with a Pydantic model always validates, greedy answers equal plain
constrained decoding, ``json_object`` gives a JSON object, and the bad cases answer an OpenAI-style 400 (or
finish_reason "length" with the partial text when the budget cannot complete the grammar)."""

import json
from pathlib import Path
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from running import RunningServer

pytest.importorskip("xgrammar")

from specdraft.api import eos_token_ids, load_target
from specdraft.decoding import generate
from specdraft.grammar import GrammarCompiler
from specdraft.sequence import GenerationConfig
from specdraft.serve import ServeConfig, build_server_app

SMOL = Path(__file__).resolve().parents[2] / "src/specdraft/weights/smollm2-135m-instruct-drafter"
MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=30)
    vaccinated: bool
    toys: list[Literal["ball", "rope", "bell"]] = Field(max_length=3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import AutoTokenizer

    from toys import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("smol") / "tiny", seed=0,
                                tokenizer=AutoTokenizer.from_pretrained(SMOL), vocab_size=49152)


@pytest.fixture(scope="module")
def server(checkpoint):
    config = ServeConfig(target=str(checkpoint), drafter="prompt-lookup", served_model_name="tiny", max_batch=4,
                         max_tokens=96, max_n=2, speculation="fixed", num_draft_tokens=4)
    with RunningServer(build_server_app(config)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _schema_format(schema: dict, name: str = "pet") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_parse_with_a_pydantic_model_validates_greedy_and_sampled(client):
    for temperature, seed in ((0, None), (0.8, 1), (0.8, 2), (0.8, 3)):
        completion = client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Pet,
                                                   max_tokens=96, temperature=temperature, seed=seed)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Pet)
        Pet.model_validate_json(choice.message.content)


def test_greedy_answer_equals_plain_constrained_decoding(client, checkpoint):
    target, tokenizer = load_target(str(checkpoint))
    eos = eos_token_ids(tokenizer, str(checkpoint))
    grammar = GrammarCompiler(tokenizer, target.vocab_size, eos).json_schema(Pet.model_json_schema())
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)["input_ids"]
    plain = generate(target, ids, None, GenerationConfig(96, eos_token_ids=eos, logits_processor=grammar))
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=96, temperature=0,
                                            response_format=_schema_format(Pet.model_json_schema()))
    assert answer.choices[0].message.content == tokenizer.decode(plain.token_ids, skip_special_tokens=True)
    assert answer.usage.model_extra["speculation"]["draft_tokens_proposed"] >= 0


def test_a_structured_request_drafts_what_the_grammar_forces(client, server):
    def accepted() -> int:
        text = httpx.get(server.url + "/metrics", timeout=60).text
        label = 'specdraft_drafter_draft_tokens_accepted_total{drafter="prompt-lookup+grammar"} '
        return int(next((line.split()[-1] for line in text.splitlines() if line.startswith(label)), "0"))

    before = accepted()
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=96, temperature=0,
                                            response_format=_schema_format(Pet.model_json_schema()))
    # the keys and the punctuation between them ('{"kind": "', '", "name": "', ...) were drafted and accepted
    assert answer.usage.model_extra["speculation"]["draft_tokens_accepted"] >= 10
    assert accepted() - before >= 10


def test_json_object_and_n_choices(client):
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=96, temperature=0.8, n=2,
                                            seed=5, response_format={"type": "json_object"})
    for choice in answer.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.message.content.startswith("{")
    completion = httpx.post(str(client.base_url.join("completions")), timeout=60, json={
        "model": "tiny", "prompt": "A pet:", "max_tokens": 96, "temperature": 0,
        "response_format": _schema_format(Pet.model_json_schema())}).json()
    Pet.model_validate_json(completion["choices"][0]["text"])


def test_a_budget_too_small_for_the_grammar_finishes_with_length_and_the_partial_text(client):
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0,
                                            response_format=_schema_format(Pet.model_json_schema()))
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and choice.message.content.startswith('{"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)
    assert "closed_at_budget" not in answer.usage.model_extra  # nothing fitted, nothing was closed


BAD_FORMATS = [
    ({"type": "xml"}, "type"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}, "name"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": []}}, "schema must be an object"),
    (_schema_format({"type": "strin"}), "invalid JSON schema"),
    (_schema_format({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}), "invalid JSON schema"),
    (_schema_format({"type": "object", "patternProperties": {"^a": {"type": "string"}}}),
     "unsupported JSON schema feature: 'patternProperties'"),
    (_schema_format({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}),
     "unsupported JSON schema feature: 'not'"),
    ({"type": "json_object", "schema": {}}, "response_format.schema"),
]


@pytest.mark.parametrize(("response_format", "message"), BAD_FORMATS)
def test_bad_response_formats_answer_400(server, response_format, message):
    response = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": MESSAGES, "max_tokens": 8, "response_format": response_format})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format" and message in error["message"]
    assert error["type"] == "invalid_request_error"


def test_a_stop_token_committed_without_a_forward_has_logprob_zero():
    """The grammar drafter commits a certain stop token after the verified ones: its p is a point mass."""
    from types import SimpleNamespace

    import torch

    from specdraft.serve.engine import LOGPROB_FLOOR, Engine, Request

    seq = SimpleNamespace(tag=(Request([1], GenerationConfig(4), logprobs=2), 0))
    logp = torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), dim=-1)  # (1, V): the one verified position
    engine = SimpleNamespace(_logp={id(seq): logp})
    first, stop = Engine._token_logprobs(engine, seq, [3, 0])
    assert first[0] == pytest.approx(float(logp[0, 3])) and first[1][0][0] == 3
    assert stop[0] == 0.0 and stop[1][0] == (0, 0.0) and stop[1][1][1] == LOGPROB_FLOOR
