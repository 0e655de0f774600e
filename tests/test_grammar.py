"""Structured outputs under speculation (xgrammar; skipped without it): the grammar's mask on p at every verified
position, the matcher advanced along the draft and rolled back, refused draft tokens cut where that is exact;
greedy output equal to plain constrained decoding (an independent reference loop), valid JSON, and sampling exact
on the processed distribution (bias, penalties and the mask together, chi-square)."""

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from specdraft.decoding import generate  # noqa: E402
from specdraft.drafters import DraftModelDrafter, PromptLookupDrafter  # noqa: E402
from specdraft.errors import SpecdraftError  # noqa: E402
from specdraft.grammar import GrammarCompiler, grammar_cut, unsupported_schema_feature  # noqa: E402
from specdraft.sampling import LogitPenalties, SamplingConfig, chain_processors, warp  # noqa: E402
from specdraft.sequence import GenerationConfig  # noqa: E402
from test_logits_processing import ScriptDrafter  # noqa: E402
from toys import assert_sequences_follow, hf_target, random_bigram  # noqa: E402

TOKENIZER = Path(__file__).resolve().parent.parent / "src/specdraft/weights/smollm2-135m-instruct-drafter"
VOCAB, EOS = 49152, 2
SCHEMA = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
    "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    "name": {"type": "string", "maxLength": 6}},
    "required": ["color", "ok", "n", "tags", "name"], "additionalProperties": False}
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 30, 2, 198, 1, 4093, 198]


@pytest.fixture(scope="module")
def compiler():
    from transformers import AutoTokenizer

    return GrammarCompiler(AutoTokenizer.from_pretrained(TOKENIZER), VOCAB, (EOS,))


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.fixture(scope="module")
def target():
    return hf_target(0, vocab_size=VOCAB)


def reference_constrained(model, prompt, grammar, max_new):
    """Plain greedy constrained decoding without a cache, on xgrammar's matcher directly (and without the tokens
    that hold a control character)."""
    matcher, bitmask, ids = xgr.GrammarMatcher(grammar.compiled), xgr.allocate_token_bitmask(1, VOCAB), list(prompt)
    for _ in range(max_new):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1:].float()  # (1, V)
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=VOCAB)
        logits[:, ~grammar.spellable] = -torch.inf
        ids.append(int(logits.argmax(-1)))
        assert matcher.accept_token(ids[-1])
        if ids[-1] == EOS:
            break
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def expected(target, compiler):
    return reference_constrained(target.model, PROMPT, compiler.json_schema(SCHEMA), 120)


def test_no_token_with_a_control_character(compiler, tokenizer):
    newline, tab = tokenizer.convert_tokens_to_ids("Ċ"), tokenizer.convert_tokens_to_ids("ĉ")
    assert not compiler.spellable[newline] and not compiler.spellable[tab] and compiler.spellable[EOS]
    assert 100 < int((~compiler.spellable).sum()) < 1000


def test_the_reference_answer_is_valid_json_of_the_schema(expected, tokenizer):
    assert expected[-1] == EOS
    answer = json.loads(tokenizer.decode(expected[:-1]))
    assert set(answer) == set(SCHEMA["properties"]) and answer["color"] in ("red", "green", "blue")
    assert isinstance(answer["ok"], bool) and 0 <= answer["n"] <= 99 and len(answer["name"]) <= 6
    assert len(answer["tags"]) <= 3 and set(answer["tags"]) <= {"a", "b"}


DRAFTERS = {  # the drafters a constrained answer must not depend on
    "plain": lambda: None,
    "draft-model": lambda: DraftModelDrafter(hf_target(1, vocab_size=VOCAB)),
    "prompt-lookup": PromptLookupDrafter,
    "tree": lambda: DraftModelDrafter(hf_target(1, vocab_size=VOCAB), tree_branching=2, tree_nodes=6),
}


@pytest.mark.parametrize("kind", ["plain", "script", "draft-model", "prompt-lookup", "tree"])
def test_greedy_speculative_constrained_equals_plain_reference(target, compiler, expected, kind):
    drafter = ScriptDrafter(len(PROMPT), expected, lambda step, i: (step * 7 + i * 3) % 5 == 0) \
        if kind == "script" else DRAFTERS[kind]()
    config = GenerationConfig(120, 4, speculation="fixed", eos_token_ids=(EOS,),
                              logits_processor=compiler.json_schema(SCHEMA))
    result = generate(target, PROMPT, drafter, config)
    assert result.token_ids == expected
    if kind == "script":  # the wrong tokens are refused by the grammar and cut: steps verify shorter drafts
        assert result.stats.draft_tokens_accepted > len(expected) // 3
        assert result.stats.draft_length_counts[4] < result.stats.target_forward_calls


def test_one_processor_serves_many_sequences_through_forks(target, compiler, expected):
    processor = compiler.json_schema(SCHEMA)
    config = GenerationConfig(120, 3, speculation="fixed", eos_token_ids=(EOS,), logits_processor=processor)
    for _ in range(2):
        assert generate(target, PROMPT, PromptLookupDrafter(), config).token_ids == expected
    assert processor.consumed == []  # each sequence decoded with a fork of its own


def test_unsupported_and_invalid_schemas_are_clear_errors(compiler):
    assert unsupported_schema_feature(SCHEMA) is None
    assert "patternProperties" in unsupported_schema_feature({"type": "object", "patternProperties": {}})
    assert "'not' at #/properties/a" in unsupported_schema_feature({"properties": {"a": {"not": {}}}})
    assert "not local" in unsupported_schema_feature({"$ref": "https://example.com/s.json"})
    assert "if" in unsupported_schema_feature({"anyOf": [{"if": {}}]})
    with pytest.raises(SpecdraftError, match="unsupported JSON schema feature"):
        compiler.json_schema({"type": "object", "patternProperties": {"^a": {"type": "string"}}})
    for bad in ({"type": "strin"}, {"type": "object", "properties": 5}, {"type": "string", "pattern": "[a-z"},
                {"properties": {"a": {"$ref": "#/$defs/missing"}}}):
        with pytest.raises(SpecdraftError, match="invalid JSON schema"):
            compiler.json_schema(bad)


OPEN = {"type": "object", "properties": {"note": {"type": "string", "minLength": 40},
                                         "color": {"enum": ["red", "green", "blue"]}},
        "required": ["note", "color"], "additionalProperties": False}  # a string with no upper bound comes first


@pytest.fixture(scope="module")
def unbounded(target, compiler):
    """The toy's plain constrained answer to OPEN without a budget: its note runs on past 80 tokens."""
    answer = reference_constrained(target.model, PROMPT, compiler.json_schema(OPEN), 80)
    assert EOS not in answer
    return answer


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_an_answer_that_would_run_past_its_budget_closes_within_it(target, compiler, tokenizer, unbounded, kind):
    drafter = DRAFTERS[kind]()
    config = GenerationConfig(40, 4, speculation="fixed", eos_token_ids=(EOS,),
                              logits_processor=compiler.json_schema(OPEN))
    result = generate(target, PROMPT, drafter, config)
    assert result.finish_reason == "eos" and len(result.token_ids) <= 40 and result.token_ids[-1] == EOS
    assert result.closed_at_budget
    answer = json.loads(tokenizer.decode(result.token_ids[:-1]))
    assert set(answer) == {"note", "color"} and answer["color"] in ("red", "green", "blue")
    shared = next(i for i, (a, b) in enumerate(zip(result.token_ids, unbounded, strict=False)) if a != b)
    assert 40 - 16 - 12 <= shared < 40  # the model's own note up to where its close had to begin
    plain = generate(target, PROMPT, None, config)
    assert result.token_ids == plain.token_ids  # exact under speculation, as the mask is


def test_an_answer_that_ends_within_its_budget_is_left_as_it_is(target, compiler, expected):
    for drafter in (None, DraftModelDrafter(hf_target(1, vocab_size=VOCAB))):
        for budget in (len(expected), len(expected) + 5):
            config = GenerationConfig(budget, 4, speculation="fixed", eos_token_ids=(EOS,),
                                      logits_processor=compiler.json_schema(SCHEMA))
            result = generate(target, PROMPT, drafter, config)
            assert result.token_ids == expected and not result.closed_at_budget


def test_a_budget_too_small_for_the_document_ends_at_the_budget(target, compiler, expected):
    config = GenerationConfig(6, 4, speculation="fixed", eos_token_ids=(EOS,),
                              logits_processor=compiler.json_schema(SCHEMA))
    result = generate(target, PROMPT, None, config)
    assert result.finish_reason == "length" and result.token_ids == expected[:6]


def test_a_close_plan_finishes_the_document_and_its_rest_is_the_plan_after_its_first_token(compiler, tokenizer):
    processor = compiler.json_schema(SCHEMA).fork(100)
    text = '{"color": "red", "ok": true, "n": 4'
    processor._sync(torch.tensor(tokenizer.encode(text)))
    plan = processor.close_plan(100)
    assert plan[-1] == EOS
    answer = json.loads(text + tokenizer.decode(plan[:-1]))
    assert answer["name"] == "" and answer["n"] == 4 and len(answer["tags"]) <= 1  # short values, n as written
    assert processor.close_plan(len(plan) - 1) is None  # more than the limit
    assert processor.consumed == tokenizer.encode(text)  # the matcher left as it was
    processor._sync(torch.tensor(tokenizer.encode(text) + plan[:1]))
    assert processor.close_plan(100) == plan[1:]


TINY = ["<eos>", "[", "]", ", ", "1", "2", "3", "x"]  # a vocabulary for a JSON array of 1, 2 and 3
ARRAY = {"type": "array", "items": {"enum": [1, 2, 3]}}


def test_allowed_nodes_and_the_cut():
    processor = GrammarCompiler.from_vocab(TINY, (0,)).json_schema(ARRAY)
    generated = torch.tensor([1, 4])  # "[1"
    chain = torch.tensor([3, 7, 5])  # ", " allowed, "x" refused, "2" behind it
    allowed = processor.allowed_nodes(generated, chain, None)
    assert allowed.tolist() == [True, False, False]
    assert grammar_cut(allowed, None, exact_drop=True).tolist() == [True, False, False]
    assert grammar_cut(allowed, None, exact_drop=False).tolist() == [True, True, False]  # q's refused token stays
    tree, parents = torch.tensor([3, 2, 7, 5]), torch.tensor([-1, -1, 0, 0])  # ", " / "]" at the root; x / 2
    allowed = processor.allowed_nodes(generated, tree, parents)
    assert allowed.tolist() == [True, True, False, True]
    assert grammar_cut(allowed, parents, exact_drop=False).tolist() == [True, True, True, True]
    masked = processor(torch.zeros(5, 8), generated, tree, parents)  # rows: root, then each node
    allowed_rows = [(row == 0).nonzero().flatten().tolist() for row in masked]
    assert allowed_rows == [[2, 3], [4, 5, 6], [0], list(range(8)), [2, 3]]  # node 2's row is unreachable


def constrained_sequence_probs(table, prompt, length, sampling, processor):
    """The exact probability of every continuation under the processed (penalties, then the grammar mask), then
    warped, p of a bigram target, one position at a time (row 0 only: no draft)."""
    probs, empty = {}, torch.zeros(0, dtype=torch.long)
    for seq in itertools.product(range(table.shape[0]), repeat=length):
        prob, last, fork = 1.0, prompt[-1], processor.fork(length)  # closed within the budget, as generate does
        for i, token in enumerate(seq):
            row = fork(table[last][None], torch.tensor(seq[:i], dtype=torch.long), empty, None)  # (1, V)
            if not torch.isfinite(row).any():  # past the end of the grammar: nothing follows
                prob = 0.0
                break
            prob *= float(warp(row, sampling)[0, token])
            if prob == 0.0:
                break
            last = token
        probs[seq] = prob
    return probs


@pytest.mark.parametrize("drafter_kind", ["draft-model", "prompt-lookup"])
def test_sampling_with_bias_penalties_and_a_grammar_follows_the_processed_distribution(drafter_kind):
    target, draft = random_bigram(8, seed=3), random_bigram(8, seed=4)
    grammar = GrammarCompiler.from_vocab(TINY, (0,)).json_schema(ARRAY)
    processor = chain_processors(LogitPenalties(((4, 1.0), (2, -0.5)), 0.7, 0.4), grammar)
    prompt = [1, 4, 3, 5, 3, 4, 3, 5]  # "[1, 2, 1, 2" : prompt lookup copies from it
    sampling = SamplingConfig(0.9)
    drafter = DraftModelDrafter(draft) if drafter_kind == "draft-model" else PromptLookupDrafter()
    generator = torch.Generator().manual_seed(99)
    config = GenerationConfig(4, 3, sampling, speculation="fixed", logits_processor=processor)
    results = [generate(target, prompt, drafter, config, generator) for _ in range(4000)]
    assert sum(r.stats.draft_tokens_proposed for r in results) > 0
    counts = Counter(tuple(r.token_ids) for r in results)
    exact = constrained_sequence_probs(target.table, prompt, 4, sampling, processor)
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-4)
    assert_sequences_follow(counts, exact, 4000)
