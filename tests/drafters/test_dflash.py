"""DFlash drafting (arXiv 2602.06036) on a tiny random target: the training forward (all blocks under one mask)
equals drafting on the draft KV cache, greedy output equals plain decoding (fp32, several γ, adaptive and fixed),
temperature sampling keeps the target's law at the second and third tokens (chi-square), the policy prices a block
per draft, and the drafter's registration and errors."""

import copy
from collections import Counter

import pytest
import torch
from torch import nn

from specdraft.batching import generate_batch
from specdraft.decoding import generate
from specdraft.drafters import NAMED_DRAFTERS
from specdraft.drafters.base import facts_of
from specdraft.drafters.dflash import DFlashDrafter
from specdraft.errors import SpecdraftError
from specdraft.heads.eagle import head_config
from specdraft.models import quantized
from specdraft.models.native_llama import NativeLlama
from specdraft.sampling import SamplingConfig, warp
from specdraft.sequence import GenerationConfig
from specdraft.speculation import AdaptivePolicy
from specdraft.training.heads.dflash import DFLASH, block_forward, parse_settings
from specdraft.training.heads.eagle3 import teacher
from specdraft.verification import VerifyResult
from toys import assert_follows, second_token_marginal, tiny_llama

PROMPTS = [[5, 9, 3, 17, 9, 3, 22, 40], [7, 7, 31, 12], [50, 4, 18, 18, 33, 2, 61]]
KEEP = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "rms_norm_eps", "rope_theta", "max_position_embeddings")


def make_head(model, seed: int = 0, draft_vocab: int = 48, **options):
    """A random DFlash head over the ``draft_vocab`` highest token ids, started from the target like training."""
    torch.manual_seed(seed)
    settings = parse_settings({k: str(v) for k, v in ({"draft_vocab": draft_vocab} | options).items()},
                              model.config.num_hidden_layers, model.config.vocab_size)
    spec = {k: head_config(model.config)[k] for k in KEEP} | settings
    vocab = model.config.vocab_size
    head = DFLASH.build(spec | {"draft_token_ids": list(range(vocab - draft_vocab, vocab))})
    DFLASH.init(head, model)
    return head


@pytest.fixture(scope="module")
def toy():
    model = tiny_llama(layers=4)
    return model, NativeLlama.from_hf(model), make_head(model, block_size=5, layers=2)


def test_training_blocks_equal_drafting_on_the_cache(toy):
    """Two blocks of one sequence under the training mask give the rows the drafter computes from the committed
    features alone, block by block."""
    model, target, head = toy
    tokens = torch.tensor([[5, 9, 3, 17, 9, 3, 22, 40, 11, 12]])  # (1, L)
    layers = [i + 1 for i in head.target_layer_ids]
    features, _, _ = teacher(model, tokens, torch.ones_like(tokens), layers, head.d2t)  # (1, L, kD)
    anchors = torch.tensor([[3, 7]])
    rows = block_forward(head, features, tokens, anchors, model.get_input_embeddings().weight)  # (1, 2, S, D)
    for b, anchor in enumerate(anchors[0].tolist()):
        drafter = DFlashDrafter.from_module(head)
        drafter.begin(target, None)
        drafter.observe(VerifyResult(0, 0, 0, hidden=features[0, :anchor]))
        drafter._sync(tokens[0, : anchor + 1])
        expected = head.logits(rows[0, b, 1:])  # (S - 1, N)
        drafted = drafter._block(tokens[0, : anchor + 1])  # (S - 1, N)
        torch.testing.assert_close(drafted, expected.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("speculation", ["fixed", "adaptive"])
@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_greedy_equals_plain_decoding(toy, speculation, quantize):
    """fp32: DFlash's output is plain greedy output token for token at every γ, below, at and above the block,
    with dense or int8 drafter weights."""
    if quantize == "int8" and not quantized.available():
        pytest.skip("specdraft's int8 kernels cannot run here")
    _, target, head = toy
    for prompt in PROMPTS:
        plain = generate(target, prompt, None, GenerationConfig(24)).token_ids
        for gamma in (1, 3, 4, 6):
            drafter = DFlashDrafter.from_module(head, quantize=quantize)
            result = generate(target, prompt, drafter, GenerationConfig(24, gamma, speculation=speculation))
            assert result.token_ids == plain
            assert max(result.stats.accept_lengths, default=0) <= min(gamma, head.block_size - 1)


def test_int8_drafts_track_the_dense_head(toy):
    """The int8 copy of the head drafts from logits close to the dense head's (Q8_0 rounding only)."""
    if not quantized.available():
        pytest.skip("specdraft's int8 kernels cannot run here")
    model, target, head = toy
    context = torch.tensor(PROMPTS[0])
    layers = [i + 1 for i in head.target_layer_ids]
    features, _, _ = teacher(model, context[None], torch.ones_like(context[None]), layers, head.d2t)
    logits = []
    for quantize in ("none", "int8"):
        drafter = DFlashDrafter.from_module(head, quantize=quantize)
        drafter.begin(target, None)
        drafter.observe(VerifyResult(0, 0, 0, hidden=features[0, :-1]))
        drafter._sync(context)
        logits.append(drafter._block(context))
    assert (logits[0] - logits[1]).abs().max() < 0.05 * logits[0].abs().max()


def _drafted(target, head, quantize: str, features: torch.Tensor, context: torch.Tensor, split: int | None = None):
    """The block's logits after observing ``features`` (1, L - 1, kD) of ``context`` (L,), in one piece or two
    (synced after the first ``split`` rows, so a block is drafted over a shorter context first)."""
    drafter = DFlashDrafter.from_module(head, quantize=quantize)
    drafter.begin(target, None)
    cut = split or features.shape[1]
    drafter.observe(VerifyResult(0, 0, 0, hidden=features[0, :cut]))
    if split:
        drafter._sync(context[: cut + 1])
        drafter._block(context[: cut + 1])
        drafter.observe(VerifyResult(0, 0, 0, hidden=features[0, cut:]))
    drafter._sync(context)
    return drafter._block(context)


def test_fused_int8_block_is_the_heads_forward_on_its_q8_0_weights(toy):
    """The int8 drafter's fused calls (Qwen3's q/k norms, the non-causal block over scratch slots, key-value-only
    calls for context rows) give the dense head's logits when that head's linear weights are the same Q8_0 blocks:
    only the int8 rounding of the activations remains. Context synced in two pieces, with a block drafted in
    between over slots that later rows take, gives the same logits bit for bit (row-invariant kernels)."""
    if not quantized.available():
        pytest.skip("specdraft's int8 kernels cannot run here")
    model, target, head = toy
    rounded = copy.deepcopy(head)
    for module in rounded.modules():
        if isinstance(module, nn.Linear):
            module.weight.data = quantized.dequantize(quantized.quantize(module.weight.data.float(), "q8_0"))
    context = torch.tensor(PROMPTS[0] + [11, 12, 13])
    layers = [i + 1 for i in head.target_layer_ids]
    features, _, _ = teacher(model, context[None], torch.ones_like(context[None]), layers, head.d2t)
    dense = _drafted(target, rounded, "none", features[:, :-1], context)  # (B - 1, V_d)
    fused = _drafted(target, head, "int8", features[:, :-1], context)
    assert (fused - dense).abs().max() < 0.01 * dense.abs().max()
    assert torch.equal(_drafted(target, head, "int8", features[:, :-1], context, split=4), fused)


def test_batched_rows_draft_as_batch_one(toy):
    """Batched decoding hands each row's drafter the features of its own committed tokens: every row's output and
    accepted lengths equal batch-1 decoding's."""
    _, target, head = toy
    config = GenerationConfig(24, 4, speculation="fixed")
    alone = [generate(target, prompt, DFlashDrafter.from_module(head), config) for prompt in PROMPTS]
    batched = generate_batch(target, PROMPTS, lambda: DFlashDrafter.from_module(head), config)
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    assert [r.stats.accept_lengths for r in batched] == [r.stats.accept_lengths for r in alone]


def _third_token_marginal(model, prompt: list[int], sampling) -> torch.Tensor:
    """sum_{t1, t2} p(t1) p(t2 | t1) p(t3 | t1, t2) (V,) of a transformers toy."""
    vocab = model.config.vocab_size
    with torch.no_grad():
        p1 = warp(model(torch.tensor([prompt])).logits[0, -1], sampling)  # (V,)
        p2 = warp(model(torch.tensor([prompt + [t] for t in range(vocab)])).logits[:, -1], sampling)  # (V, V)
        pairs = [prompt + [a, b] for a in range(vocab) for b in range(vocab)]
        p3 = warp(model(torch.tensor(pairs)).logits[:, -1], sampling).view(vocab, vocab, vocab)  # (V, V, V)
    return torch.einsum("a,ab,abc->c", p1, p2, p3)


def test_greedy_trees_equal_plain_decoding(toy):
    """fp32: trees grown from the block's per-position distributions keep plain greedy output at every depth, and
    they are trees (some node with siblings)."""
    _, target, head = toy
    for prompt in PROMPTS:
        plain = generate(target, prompt, None, GenerationConfig(24)).token_ids
        for gamma in (1, 3, 4):
            drafter = DFlashDrafter.from_module(head, tree_branching=2, tree_nodes=6)
            result = generate(target, prompt, drafter, GenerationConfig(24, gamma, speculation="fixed"))
            assert result.token_ids == plain
    drafter = DFlashDrafter.from_module(head, tree_branching=2, tree_nodes=6)
    drafter.begin(target, None)
    width = len(head.target_layer_ids) * head.spec["hidden_size"]
    drafter.observe(VerifyResult(0, 0, 0, hidden=torch.randn(4, width)))
    draft = drafter.propose(torch.tensor(PROMPTS[1] + [3]), 3, SamplingConfig(), None)
    assert draft.is_tree and draft.tokens.shape[0] == 6 and draft.q is None
    assert len(set(draft.parents.tolist())) < 6  # a parent with two children


@pytest.mark.parametrize("tree_branching", [0, 2])
def test_sampled_tokens_follow_the_target(toy, tree_branching):
    """Temperature sampling, chains and trees: the second and third generated tokens (drafted as positions 1 and 2
    of one block at the second step) follow the target's exact marginals (chi-square), and drafts are accepted."""
    model, target, _ = toy
    head = make_head(model, seed=1, block_size=4, draft_vocab=64)
    with torch.no_grad():  # a peaked draft close to the target's first guess, so that some drafts pass
        head.lm_head.weight.mul_(4.0)
    sampling, trials, prompt = SamplingConfig(temperature=1.0), 600, PROMPTS[1]
    counts2, counts3, accepted = Counter(), Counter(), 0
    for seed in range(trials):
        generator = torch.Generator().manual_seed(seed)
        config = GenerationConfig(4, 3, sampling, speculation="fixed")
        drafter = DFlashDrafter.from_module(head, tree_branching=tree_branching, tree_nodes=5)
        result = generate(target, prompt, drafter, config, generator)
        counts2[result.token_ids[1]] += 1
        counts3[result.token_ids[2]] += 1
        accepted += sum(result.stats.accept_lengths[1:2])
    assert_follows(counts2, second_token_marginal(model, prompt, sampling), trials)
    assert_follows(counts3, _third_token_marginal(model, prompt, sampling), trials)
    assert accepted > 0


def test_policy_prices_one_forward_per_draft():
    """With the drafting cost per draft rather than per token, the adaptive policy asks deeper drafts of DFlash."""
    class Curve:  # a 10 ms step whose every extra verified token adds 1 ms
        def seconds(self, tokens: int, context: int = 0) -> float:
            return 0.01 * (1 + 0.1 * (tokens - 1))

    curve, deep = Curve(), []
    for flat in (False, True):
        policy = AdaptivePolicy(curve, 7, draft_seconds_per_token=0.004, one_forward_draft=flat)
        deep.append(policy.budget(100, 7))
    assert deep[1] > deep[0], deep


def test_registration_and_errors(toy):
    head = toy[2]
    assert NAMED_DRAFTERS["dflash"] is DFlashDrafter
    facts = facts_of(DFlashDrafter)
    assert facts.reads_target_features and facts.cpu_only and facts.one_forward_draft
    with pytest.raises(SpecdraftError, match="heads=PATH"):
        DFlashDrafter("")
    drafter = DFlashDrafter.from_module(head)
    with pytest.raises(SpecdraftError, match="begin"):
        drafter.observe(VerifyResult(0, 0, 0, hidden=torch.zeros(2, 3 * 32)))
        drafter.propose(torch.tensor([1, 2, 3]), 2, SamplingConfig(), None)
    other = NativeLlama.from_hf(tiny_llama(layers=4, hidden=48))
    with pytest.raises(SpecdraftError, match="DFlash head mismatch"):
        DFlashDrafter.from_module(head).begin(other, None)


@pytest.mark.slow
def test_smollm2_fp32_greedy_equals_plain_decoding_on_spec_bench():
    """The real target in fp32 with the shipped DFlash heads (``--drafter dflash``'s default): the output is plain
    greedy decoding's on the first Spec-Bench question of every subtask, at fixed γ 7 and adaptively."""
    from pathlib import Path

    from specdraft.bench.questions import load_questions, select_questions
    from specdraft.drafters.registry import make_named
    from specdraft.models.registry import SMOLLM2, eos_token_ids, load_model, load_tokenizer
    from specdraft.prompts import encode_prompt

    questions_file = Path("/work/shared/data/spec_bench/question.jsonl")
    if not questions_file.is_file():
        pytest.skip(f"Spec-Bench questions not found at {questions_file}")
    target, tokenizer = load_model(SMOLLM2, torch.float32), load_tokenizer(SMOLLM2)
    eos = eos_token_ids(tokenizer, SMOLLM2)
    accepted = 0
    for question in select_questions(load_questions(questions_file), per_category=1):
        ids = encode_prompt(tokenizer, question.turns[0], chat=True)
        plain = generate(target, ids, None, GenerationConfig(48, eos_token_ids=eos)).token_ids
        for speculation in ("fixed", "adaptive"):
            drafter = make_named("dflash", target, tokenizer, {})
            config = GenerationConfig(48, 7, eos_token_ids=eos, speculation=speculation)
            result = generate(target, ids, drafter, config)
            assert result.token_ids == plain, (question.category, speculation)
            accepted += sum(result.stats.accept_lengths)
    assert accepted > 0
