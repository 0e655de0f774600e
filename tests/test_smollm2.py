"""The real target (slow: loads SmolLM2-135M-Instruct, converting it on first use). Run with `make test-slow`."""

import pytest
import torch

from specdraft.api import encode_prompt, eos_token_ids, load_target
from specdraft.decoding import generate
from specdraft.drafters import DraftModelDrafter, PromptLookupDrafter
from specdraft.models.registry import SMOLLM2, load_model
from specdraft.prompts import BUILTIN_PROMPTS
from specdraft.sequence import GenerationConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    return load_target(SMOLLM2, torch.float32)


def test_fp32_speculative_greedy_equals_plain_on_builtin_prompts(smollm2):
    target, tokenizer = smollm2
    config = GenerationConfig(48, 4, eos_token_ids=eos_token_ids(tokenizer, SMOLLM2))
    self_draft = DraftModelDrafter(target)
    for prompt in BUILTIN_PROMPTS[::2]:
        ids = encode_prompt(tokenizer, prompt.text, chat=True)
        plain = generate(target, ids, None, config).token_ids
        assert generate(target, ids, PromptLookupDrafter(), config).token_ids == plain, prompt.category
        assert generate(target, ids, self_draft, config).token_ids == plain, prompt.category


def test_native_plain_equals_transformers_generate(smollm2):
    target, tokenizer = smollm2
    hf = load_model(SMOLLM2, torch.float32, backend="hf").model
    eos = eos_token_ids(tokenizer, SMOLLM2)
    for prompt in BUILTIN_PROMPTS[1::3]:
        ids = encode_prompt(tokenizer, prompt.text, chat=True)
        plain = generate(target, ids, None, GenerationConfig(48, eos_token_ids=eos)).token_ids
        out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=48, eos_token_id=list(eos),
                          pad_token_id=eos[0])
        assert out[0, len(ids):].tolist() == plain, prompt.category


def test_bf16_verify_equals_plain_steps_bit_for_bit_on_the_row_kernels():
    """SmolLM2 in bf16 on the row kernels: a 5-token verify's logits are exactly five 1-token steps' (where the
    onednn path rounds them differently), so bf16 speculative greedy output is plain bf16 greedy output."""
    from specdraft.models import rowgemm

    if not rowgemm.available():
        pytest.skip("no AVX2 CPU or C++ compiler for the row kernel")
    target = load_model(SMOLLM2, torch.bfloat16)
    assert target.prepack("rows")
    ids = torch.randint(0, target.vocab_size, (1, 80), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache = target.new_cache(96)
        target.forward(ids[:, :70], cache)
        verify = target.forward(ids[:, 70:75], cache)  # (1, 5, V)
        cache.crop(70)
        steps = torch.cat([target.forward(ids[:, 70 + i : 71 + i], cache) for i in range(5)], dim=1)
    assert torch.equal(verify, steps)
