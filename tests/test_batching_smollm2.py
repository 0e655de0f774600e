"""Batched decoding on the real target (slow): every row equals batch-1 decoding, fp32, greedy."""

import pytest
import torch

from specdraft.api import encode_prompt, eos_token_ids, load_drafter, load_target
from specdraft.batch_drafting import lockstep_factory
from specdraft.batching import drafter_factory, generate_batch
from specdraft.decoding import generate
from specdraft.models.registry import SMOLLM2, SMOLLM2_DRAFTER
from specdraft.prompts import BUILTIN_PROMPTS
from specdraft.sequence import GenerationConfig

pytestmark = pytest.mark.slow


def test_fp32_batched_rows_equal_batch_one_with_the_shipped_drafter():
    target, tokenizer = load_target(SMOLLM2, torch.float32)
    config = GenerationConfig(48, 4, eos_token_ids=eos_token_ids(tokenizer, SMOLLM2))
    prompts = [encode_prompt(tokenizer, p.text, chat=True) for p in BUILTIN_PROMPTS[:6]]
    plain = [generate(target, ids, None, config).token_ids for ids in prompts]
    assert [r.token_ids for r in generate_batch(target, prompts, None, config)] == plain

    prototype = load_drafter(target, tokenizer, draft=SMOLLM2_DRAFTER)
    one_by_one = drafter_factory(prototype)
    lockstep = lockstep_factory(prototype, 10, 1024, one_by_one)
    for make in (one_by_one, lockstep):
        results = generate_batch(target, prompts, make, config, batch_size=4)
        assert [r.token_ids for r in results] == plain
        assert sum(r.stats.draft_tokens_accepted for r in results) > 0
