"""One sequence's failure is its own: a row whose distribution is non-finite or whose drafter raises ends alone
(the batch decoder marks it, the engine answers its request with an error), and every other row's output is
the one it has alone."""

import asyncio
import math

import pytest
import torch

from specdraft.api import load_target
from specdraft.batching import BatchDecoder
from specdraft.decoding import generate
from specdraft.drafters import PromptLookupDrafter
from specdraft.sampling import SamplingConfig
from specdraft.sequence import GenerationConfig
from specdraft.serve.engine import Engine, Request

PROMPTS = [[5, 9, 3, 17, 9, 3, 22, 40], [7], [11, 12, 13, 11, 12], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]]
CONFIG = GenerationConfig(30, 3)


def _poisoned() -> GenerationConfig:
    """Sampling whose warping is NaN everywhere: no validated setting gives one any more, so force it."""
    sampling = SamplingConfig(1.0)
    object.__setattr__(sampling, "temperature", math.nan)
    return GenerationConfig(30, 3, sampling)


class _BrokenDrafter:
    """A drafter whose ``propose`` raises."""

    name, vocab_size, max_context = "broken", None, None

    def begin(self, target, cache) -> None:
        pass

    def propose(self, context, num_draft_tokens, sampling, generator):
        raise RuntimeError("the drafter broke")

    def observe(self, result) -> None:
        pass


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return load_target(str(tiny_checkpoint))


@pytest.fixture(scope="module")
def alone(loaded):
    return [generate(loaded[0], p, PromptLookupDrafter(), CONFIG).token_ids for p in PROMPTS]


def test_failing_rows_end_alone_and_the_others_equal_their_lone_runs(loaded, alone):
    target = loaded[0]
    decoder = BatchDecoder(target, 6, 64)
    healthy = [decoder.add(p, PromptLookupDrafter(), CONFIG) for p in PROMPTS]
    nan_row = decoder.add([5, 6, 7, 5, 6], PromptLookupDrafter(), _poisoned(), torch.Generator().manual_seed(0))
    broken_row = decoder.add([8, 9, 10], _BrokenDrafter(), CONFIG)
    failed = []
    while decoder.rows:
        failed += [seq for seq, tokens in decoder.step() if seq.error is not None and not tokens]
    assert failed == [broken_row, nan_row]  # the drafter fails before the forward, the distribution after it
    assert nan_row.finish_reason == broken_row.finish_reason == "error"
    assert "the drafter broke" in str(broken_row.error)
    assert [seq.generated for seq in healthy] == alone


def test_the_engine_answers_the_poisoned_request_alone(loaded, alone):
    target, tokenizer = loaded
    engine = Engine(target, tokenizer, PromptLookupDrafter, max_batch=8, capacity=64, max_queue=8)
    engine.start()

    async def scenario():
        loop = asyncio.get_running_loop()
        requests = [Request(p, CONFIG, loop=loop, events=asyncio.Queue()) for p in PROMPTS]
        poisoned = Request([5, 6, 7, 5, 6], _poisoned(), seed=0, loop=loop, events=asyncio.Queue())
        for request in (requests[0], requests[1], poisoned, requests[2], requests[3]):
            engine.submit(request)

        async def drain(request):
            tokens = []
            while True:
                event = await asyncio.wait_for(request.events.get(), 60)
                if event.error is not None:
                    return event
                tokens += event.tokens
                if event.finish_reason is not None:
                    return tokens

        return await asyncio.gather(*(drain(r) for r in requests)), await drain(poisoned)

    try:
        answers, error = asyncio.run(scenario())
    finally:
        engine.stop()
    assert answers == alone
    assert error.status == 500 and "decoding failed" in error.error
    assert engine.metrics.sequences_failed == 1
