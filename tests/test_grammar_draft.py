"""The grammar as a drafter (xgrammar; skipped without it): the tokens a grammar forces are proposed where it forces
them, in the tokenizer's own encoding, and verified by the target: greedy output equals plain constrained decoding
whatever drafter they join, and sampling follows the processed distribution (chi-square), including where the
target prefers another tokenization of the forced text."""

from collections import Counter

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from specdraft.decoding import generate  # noqa: E402
from specdraft.drafters import DraftModelDrafter, PromptLookupDrafter  # noqa: E402
from specdraft.drafters.grammar_draft import GRAMMAR, GrammarDrafter, after_run  # noqa: E402
from specdraft.grammar import GrammarCompiler, GrammarProcessor, certain_tokens, longest_match  # noqa: E402
from specdraft.sampling import LogitPenalties, SamplingConfig, chain_processors  # noqa: E402
from specdraft.sequence import GenerationConfig  # noqa: E402
from test_grammar import EOS, PROMPT, SCHEMA, TOKENIZER, VOCAB, constrained_sequence_probs, reference_constrained  # noqa: E402
from toys import BigramLM, assert_sequences_follow, hf_target, random_bigram  # noqa: E402

# a vocabulary where the forced opening '{"a": ' is one token and also three: the target may take either
PIECES = ["<eos>", "{", '"a"', ": ", '{"a": ', "1", "2", "}", "x"]
ONE_KEY = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"], "additionalProperties": False}
EMPTY = torch.zeros(0, dtype=torch.long)


@pytest.fixture(scope="module")
def compiler():
    from transformers import AutoTokenizer

    return GrammarCompiler(AutoTokenizer.from_pretrained(TOKENIZER), VOCAB, (EOS,))


@pytest.fixture(scope="module")
def target():
    return hf_target(0, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def expected(target, compiler):
    return reference_constrained(target.model, PROMPT, compiler.json_schema(SCHEMA), 120)


def test_forced_tokens_where_the_grammar_forces_them(compiler):
    tokenizer_encode = compiler.encode
    grammar = compiler.json_schema(SCHEMA)
    assert grammar.forced_tokens(EMPTY, EMPTY, 8) == tokenizer_encode('{"color":')  # the space may join the value
    assert grammar.forced_tokens(EMPTY, EMPTY, 2) == tokenizer_encode('{"color":')[:2]
    green = torch.tensor(tokenizer_encode('{"color": "green'))
    assert grammar.forced_tokens(green, EMPTY, 8) == tokenizer_encode('", "ok":')
    assert grammar.forced_tokens(green[:3], green[3:], 8) == tokenizer_encode('", "ok":')  # after draft tokens
    assert grammar.forced_tokens(green[:-1], EMPTY, 8) == []  # inside the enum value: "gr" or "blue"
    assert grammar.consumed == green.tolist()[:-1] and not grammar.matcher.is_terminated()
    bad = torch.tensor(tokenizer_encode('{"x'))
    assert grammar.forced_tokens(bad[:1], bad[1:], 8) == []  # a draft the grammar refuses forces nothing


def test_the_forced_encoding_stops_where_a_following_character_could_join_it():
    encode = longest_match(PIECES)
    assert encode('{"a": 1}') == [4, 5, 7] and encode('{"a"?x') == [1, 2]
    assert certain_tokens(encode, '{"a": ') == [4]
    glued = longest_match(["<eos>", "a", "a1", "b"])
    assert certain_tokens(glued, "ba") == [3]  # "a" could become "a1"
    grammar = GrammarCompiler.from_vocab(PIECES, (0,)).json_schema(ONE_KEY)
    assert grammar.forced_tokens(EMPTY, EMPTY, 4) == [4]
    assert grammar.forced_tokens(torch.tensor([1]), EMPTY, 4) == [2, 3]  # the target took "{": the rest in pieces
    assert grammar.forced_tokens(torch.tensor([4, 5]), EMPTY, 4) == [7, 0]  # "}" ends the grammar: then the stop
    assert grammar.forced_tokens(torch.tensor([4, 5]), EMPTY, 1) == [7]
    assert grammar.forced_tokens(torch.tensor([4, 5, 7]), EMPTY, 4) == [0]
    assert grammar.certain_stop(torch.tensor([4, 5, 7])) == 0 and grammar.certain_stop(torch.tensor([4, 5])) is None
    assert grammar.forced_tokens(torch.tensor([4]), EMPTY, 4) == []  # 1 or 2


def test_the_grammar_drafter_proposes_the_forced_run_then_the_inner_draft():
    grammar = GrammarCompiler.from_vocab(PIECES, (0,)).json_schema(ONE_KEY)
    prompt = torch.tensor([8, 8])
    alone = GrammarDrafter(None, grammar, 2)
    draft = alone.propose(torch.cat([prompt, torch.tensor([1])]), 4, SamplingConfig(), None)
    assert draft.tokens.tolist() == [2, 3] and draft.source.tolist() == [GRAMMAR] * 2 and draft.q is None
    assert alone.draft_kind(prompt, SamplingConfig()) == "grammar" and alone.name == "grammar"
    assert len(alone.propose(torch.tensor([8, 8, 4]), 4, SamplingConfig(), None)) == 0
    lookup = GrammarDrafter(PromptLookupDrafter(2, 1), grammar, 6)
    context = torch.tensor([1, 2, 3, 5, 7, 0, 1])  # the prompt shows '{"a": 1}' in pieces; the answer starts "{"
    assert lookup.propose(context, 4, SamplingConfig(), None).tokens.tolist() == [2, 3, 5, 7]  # forced, then copied
    tree = after_run(torch.tensor([4, 5]), DraftModelDrafter(random_bigram(9, seed=1)).propose(
        torch.tensor([1, 4, 5]), 2, SamplingConfig(0.9), torch.Generator().manual_seed(0)), 9)
    assert tree.tokens[:2].tolist() == [4, 5] and tree.q[:2].argmax(-1).tolist() == [4, 5]
    assert float(tree.q[:2].max(-1).values.min()) == 1.0 and tree.parents is None  # a chain: point masses first


@pytest.mark.parametrize("kind", ["grammar", "draft-model", "prompt-lookup", "tree"])
def test_greedy_with_the_grammar_drafter_equals_plain_constrained_decoding(target, compiler, expected, kind):
    drafter = {
        "grammar": lambda: None,
        "draft-model": lambda: DraftModelDrafter(hf_target(1, vocab_size=VOCAB)),
        "prompt-lookup": PromptLookupDrafter,
        "tree": lambda: DraftModelDrafter(hf_target(1, vocab_size=VOCAB), tree_branching=2, tree_nodes=6),
    }[kind]()
    config = GenerationConfig(120, 4, speculation="fixed", eos_token_ids=(EOS,), grammar_draft=True,
                              logits_processor=compiler.json_schema(SCHEMA))
    result = generate(target, PROMPT, drafter, config)
    assert result.token_ids == expected
    # the keys and punctuation were drafted and accepted: fewer target forwards than tokens
    assert result.stats.draft_tokens_accepted >= 8
    assert result.stats.target_forward_calls < len(expected) - 8


@pytest.mark.parametrize("drafter_kind", ["grammar", "draft-model"])
def test_sampling_with_the_grammar_drafter_follows_the_processed_distribution(drafter_kind):
    bigram = random_bigram(9, seed=5)
    grammar = GrammarCompiler.from_vocab(PIECES, (0,)).json_schema(ONE_KEY)
    processor = chain_processors(LogitPenalties(((1, 1.5), (5, -0.5)), 0.3, 0.2), grammar)
    prompt = [8, 1, 8]
    sampling = SamplingConfig(0.9)
    drafter = DraftModelDrafter(random_bigram(9, seed=6)) if drafter_kind == "draft-model" else None
    generator = torch.Generator().manual_seed(7)
    config = GenerationConfig(4, 3, sampling, speculation="fixed", logits_processor=processor, grammar_draft=True)
    results = [generate(bigram, prompt, drafter, config, generator) for _ in range(3000)]
    assert sum(r.stats.draft_tokens_accepted for r in results) > 1000
    counts = Counter(tuple(r.token_ids) for r in results)
    assert counts[(1, 2, 3, 5)] + counts[(1, 2, 3, 6)] > 100  # the target often refused the forced '{"a": '
    exact = constrained_sequence_probs(bigram.table, prompt, 4, sampling, processor)
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-4)
    assert_sequences_follow(counts, exact, 3000)


def test_the_stop_token_after_a_complete_grammar_costs_no_target_forward(monkeypatch):
    """The target's own token completes the grammar ('1}' after '{"a": '): the stop token, the only one allowed
    there, is committed in the same step. Greedy output equals plain constrained decoding, in fewer forwards than
    with the certain stop switched off (then a last forward only confirms it)."""
    pieces = PIECES + ["1}"]  # token 9 closes the object with the value
    table = torch.zeros(10, 10)
    table[8, 4] = table[4, 9] = 5.0  # the target prefers '{"a": ' after "x", then "1}"
    target = BigramLM(table)
    grammar = GrammarCompiler.from_vocab(pieces, (0,)).json_schema(ONE_KEY)

    def run(grammar_draft: bool):
        config = GenerationConfig(8, 1, speculation="fixed", eos_token_ids=(0,), logits_processor=grammar,
                                  grammar_draft=grammar_draft)
        return generate(target, [8, 8], None, config)

    plain = run(False)
    assert plain.token_ids == [4, 9, 0] and plain.stats.target_forward_calls == 3
    drafted = run(True)  # '{"a": ' forced and accepted, "1}" the target's, then the stop without a forward
    assert drafted.token_ids == plain.token_ids and drafted.finish_reason == "eos"
    assert drafted.stats.target_forward_calls == 1 and drafted.stats.new_tokens == 3
    monkeypatch.setattr(GrammarProcessor, "_only_stop", lambda self: None)
    assert run(True).stats.target_forward_calls == 2
