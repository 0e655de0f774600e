"""Speculation counters: per position and per draft length in /metrics (per drafter), and each response's own
figures in ``usage.speculation``, equal to batch-1 decoding's statistics of the same requests."""

import httpx
import openai
import pytest
from running import RunningServer

from specdraft.api import eos_token_ids, load_target
from specdraft.decoding import generate
from specdraft.drafters import PromptLookupDrafter
from specdraft.sequence import GenerationConfig
from specdraft.serve import ServeConfig, build_server_app
from specdraft.serve.metrics import Metrics, SpeculationTally
from specdraft.stats import GenerationStats
from specdraft.verification import VerifyResult

CHAT = [{"role": "user", "content": "w1 w2 w3 w4 w1 w2 w3 w4 w1 w2"}]
PROMPT_IDS = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]


def _stats(*steps: tuple[int, int]) -> GenerationStats:
    stats = GenerationStats()
    for gamma, accepted in steps:
        stats.record_step(VerifyResult(gamma, accepted, 0), accepted + 1, 0.0, 0.0)
    return stats


def test_tally_and_prometheus_lines_by_hand():
    metrics = Metrics()
    metrics.record_finished("lookup", _stats((3, 3), (3, 1), (0, 0)))
    metrics.record_finished("lookup", _stats((2, 0)))
    metrics.record_finished("draft \"x\"", _stats((1, 1)))
    text = metrics.render(0.0, 0, 0)
    for line in ('specdraft_draft_position_reached_total{drafter="lookup",position="1"} 3',
                 'specdraft_draft_position_accepted_total{drafter="lookup",position="1"} 2',
                 'specdraft_draft_position_reached_total{drafter="lookup",position="2"} 2',
                 'specdraft_draft_position_accepted_total{drafter="lookup",position="2"} 1',
                 'specdraft_draft_position_reached_total{drafter="lookup",position="3"} 1',
                 'specdraft_draft_position_accepted_total{drafter="lookup",position="3"} 1',
                 'specdraft_draft_length_steps_total{drafter="lookup",length="0"} 1',
                 'specdraft_draft_length_steps_total{drafter="lookup",length="2"} 1',
                 'specdraft_draft_length_steps_total{drafter="lookup",length="3"} 2',
                 'specdraft_drafter_draft_tokens_proposed_total{drafter="lookup"} 8',
                 'specdraft_drafter_draft_tokens_accepted_total{drafter="lookup"} 4',
                 'specdraft_drafter_draft_tokens_accepted_total{drafter="draft \\"x\\""} 1',
                 "specdraft_draft_tokens_proposed_total 9", "specdraft_draft_tokens_accepted_total 5",
                 "# TYPE specdraft_draft_position_accepted_total counter"):
        assert line in text.splitlines(), line
    tally = SpeculationTally()
    tally.add(_stats((3, 3), (3, 1)))
    assert tally.to_dict() == {"target_forward_calls": 2, "block_efficiency": 3.0, "draft_tokens_proposed": 6,
                               "draft_tokens_accepted": 4, "reached_per_position": [2, 2, 1],
                               "accepted_per_position": [2, 1, 1], "acceptance_rate_per_position": [1.0, 0.5, 1.0],
                               "draft_length_counts": [0, 0, 0, 2]}


@pytest.fixture(scope="module")
def references(tiny_checkpoint):
    """Batch-1 greedy decoding of the two requests with the server's drafter and fixed γ 3."""
    target, tokenizer = load_target(str(tiny_checkpoint))
    config = GenerationConfig(24, 3, speculation="fixed", eos_token_ids=eos_token_ids(tokenizer, str(tiny_checkpoint)))
    chat_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)["input_ids"]
    return [generate(target, ids, PromptLookupDrafter(), config).stats for ids in (chat_ids, PROMPT_IDS)]


def _value(text: str, sample: str) -> int:
    return int(next((line.split()[-1] for line in text.splitlines() if line.startswith(sample + " ")), "0"))


def test_metrics_and_usage_after_known_requests(tiny_checkpoint, references):
    config = ServeConfig(target=str(tiny_checkpoint), drafter="prompt-lookup", served_model_name="tiny", max_batch=2,
                         max_tokens=24, speculation="fixed", num_draft_tokens=3)
    with RunningServer(build_server_app(config)) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=24, temperature=0)
        stream = client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=24, temperature=0,
                                           stream=True, stream_options={"include_usage": True})
        streamed_usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
        text = httpx.get(running.url + "/metrics").text
    expected = SpeculationTally()
    for usage, stats in zip((chat.usage, streamed_usage), references, strict=True):
        alone = SpeculationTally()
        alone.add(stats)
        assert usage.model_extra["speculation"] == alone.to_dict()
        expected.add(stats)
    assert sum(expected.accepted_per_position) > 0 and len(expected.reached_per_position) == 3
    label = 'drafter="prompt-lookup"'
    for i, (reached, accepted) in enumerate(zip(expected.reached_per_position, expected.accepted_per_position,
                                                strict=True)):
        assert _value(text, f'specdraft_draft_position_reached_total{{{label},position="{i + 1}"}}') == reached
        assert _value(text, f'specdraft_draft_position_accepted_total{{{label},position="{i + 1}"}}') == accepted
    for n, steps in enumerate(expected.draft_length_counts):
        assert _value(text, f'specdraft_draft_length_steps_total{{{label},length="{n}"}}') == steps
    assert _value(text, "specdraft_draft_tokens_accepted_total") == expected.draft_tokens_accepted
