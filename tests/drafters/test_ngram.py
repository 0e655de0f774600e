"""The ngram drafter: its table against counting by hand, backoff, the copy before the table, saving and loading
(atomic, refusing damaged tables and other tokenizers), greedy equality and the sampled distribution, the draft-model
combination, and the build-ngram command."""

import json
import random
from collections import Counter

import numpy as np
import pytest
import torch

from specdraft.cli import main
from specdraft.decoding import generate
from specdraft.drafters.combined import WithNGramTable
from specdraft.drafters.ngram import NGramDrafter, build_table, load_table
from specdraft.drafters.registry import make_named
from specdraft.errors import SpecdraftError
from specdraft.models.native_llama import NativeLlama
from specdraft.sampling import SamplingConfig
from specdraft.sequence import GenerationConfig
from toys import (
    assert_sequences_follow,
    bigram_sequence_probs,
    hf_target,
    random_bigram,
    save_tiny_checkpoint,
    tiny_llama,
)

GREEDY = SamplingConfig()


def test_table_holds_each_ngrams_most_frequent_successor_and_its_share():
    table = build_table([[1, 2, 3, 1, 2, 4], [1, 2, 3], [5, 7], [5, 6]], max_order=2, min_count=1)
    assert table.lookup([1]) == (2, 1.0, 1)
    successor, share, order = table.lookup([2])
    assert (successor, order) == (3, 1) and share == pytest.approx(2 / 3)
    assert table.lookup([5]) == (6, 0.5, 1)  # a tie goes to the smaller id
    assert table.lookup([9, 1, 2])[2] == 2  # the longest n-gram held: (1, 2)
    assert table.lookup([4, 3]) == (1, 1.0, 1)  # (4, 3) never seen: backs off to (3,)
    assert table.lookup([4]) is None and table.lookup([]) is None  # 4 ends every answer it is in
    pruned = build_table([[1, 2, 3, 1, 2, 4], [1, 2, 3]], max_order=2, min_count=2)
    assert pruned.lookup([3]) is None and pruned.lookup([2, 3]) is None  # seen once
    assert pruned.lookup([1, 2])[:1] == (3,)


def test_table_matches_counting_on_random_answers():
    rng = random.Random(0)
    answers = [[rng.randrange(6) for _ in range(rng.randint(1, 40))] for _ in range(60)]
    table = build_table(answers, max_order=3, min_count=2)
    for n in (1, 2, 3):
        counts: dict[tuple, Counter] = {}
        for answer in answers:
            for i in range(n, len(answer)):
                counts.setdefault(tuple(answer[i - n : i]), Counter())[answer[i]] += 1
        for gram, successors in counts.items():
            found = table.lookup(list(gram))
            total = sum(successors.values())
            if total < 2:
                assert found is None or found[2] < n
                continue
            best = max(successors.values())
            expected = min(token for token, count in successors.items() if count == best)
            assert found[0] == expected and found[1] == pytest.approx(best / total) and found[2] == n
    assert table.manifest["entries"] == len(table.keys)


def test_saved_table_loads_and_bad_tables_are_refused(tmp_path):
    table = build_table([[1, 2, 3, 1, 2, 4], [1, 2, 3]], 2, 1, {"tokenizer_fingerprint": "abc"})
    table.save(tmp_path / "t")
    loaded = load_table(tmp_path / "t", "abc")
    assert np.array_equal(loaded.keys, table.keys) and np.array_equal(loaded.successors, table.successors)
    assert np.allclose(loaded.shares, table.shares, atol=1e-3) and loaded.max_order == 2
    assert loaded.lookup([7, 1, 2]) == table.lookup([7, 1, 2])[:1] + (pytest.approx(2 / 3, abs=1e-3), 2)
    assert not [p for p in (tmp_path / "t").iterdir() if p.name.startswith(".")]
    with pytest.raises(SpecdraftError, match="another tokenizer"):
        load_table(tmp_path / "t", "xyz")
    with pytest.raises(SpecdraftError, match="no n-gram table"):
        load_table(tmp_path / "missing")
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    (tmp_path / "t" / "manifest.json").write_text(json.dumps(manifest | {"format": "other"}))
    with pytest.raises(SpecdraftError, match="not an n-gram table"):
        load_table(tmp_path / "t")
    with pytest.raises(SpecdraftError, match="no answer"):
        build_table([[1], []])
    with pytest.raises(SpecdraftError, match="max_order"):
        build_table([[1, 2]], max_order=0)


def test_chain_follows_the_table_and_a_context_match_is_copied_first():
    table = build_table([[1, 2, 3, 4, 5]] * 3 + [[9, 1, 8]], max_order=2, min_count=1)
    drafter = NGramDrafter(table)
    draft = drafter.propose(torch.tensor([7, 1, 2]), 3, GREEDY, None)
    assert draft.tokens.tolist() == [3, 4, 5] and draft.q is None
    assert draft.source.tolist() == [12, 12, 12]  # 10 + order 2
    assert torch.allclose(draft.confidence, torch.ones(3))
    assert drafter.propose(torch.tensor([7, 1]), 2, GREEDY, None).tokens.tolist() == [2, 3]  # (1,) -> 2: 3 of 4
    assert drafter.draft_kind(torch.tensor([7, 1]), GREEDY) == 10 * 11 + 2
    assert NGramDrafter.kind_order(10 * 11 + 2) == 1 and NGramDrafter.kind_order(3) == 3
    context = torch.tensor([6, 7, 1, 6, 6, 7, 1])  # "6 7 1" seen before: copied, not the table's 2
    assert drafter.propose(context, 2, GREEDY, None).tokens.tolist() == [6, 6]
    assert drafter.draft_kind(context, GREEDY) == 3
    assert NGramDrafter(table, prompt_lookup_min=0).propose(context, 2, GREEDY, None).tokens.tolist() == [2, 3]
    assert len(drafter.propose(torch.tensor([11, 12]), 3, GREEDY, None)) == 0
    assert drafter.draft_kind(torch.tensor([11, 12]), GREEDY) == 0
    with pytest.raises(SpecdraftError, match="prompt_lookup_min"):
        NGramDrafter(table, prompt_lookup_min=4)



def test_a_steps_kind_and_draft_look_the_context_up_once():
    table = build_table([[1, 2, 3, 4, 5]] * 3, max_order=2, min_count=1)
    drafter = NGramDrafter(table)
    looked = []
    lookup = table.lookup
    object.__setattr__(table, "lookup", lambda tail: looked.append(list(tail)) or lookup(tail))
    context = torch.tensor([7, 1, 2])
    assert drafter.draft_kind(context, GREEDY) == drafter.draft_kind(context, GREEDY) == 10 * 12 + 2
    assert drafter.propose(context, 3, GREEDY, None).tokens.tolist() == [3, 4, 5]
    assert looked == [[1, 2], [2, 3], [3, 4]]  # the kind's lookup read again by the draft, then one a depth
    looked.clear()
    assert drafter.propose(torch.tensor([7, 1, 3]), 1, GREEDY, None).tokens.tolist() == [4]  # another context
    assert looked == [[1, 3]]
    looked.clear()
    assert drafter.propose(context, 1, GREEDY, None).tokens.tolist() == [3]  # read once: asked again, looked up again
    assert looked == [[1, 2]]

@pytest.fixture(scope="module", params=["native", "hf"])
def target(request):
    return NativeLlama.from_hf(tiny_llama(0)) if request.param == "native" else hf_target(0)


def test_greedy_equals_plain_decoding_and_the_targets_answers_are_drafted(target):
    prompts = [[5, 9, 3, 17], [22, 40, 5], [8, 8, 30, 2], [11, 4]]
    answers = [generate(target, p, None, GenerationConfig(30)).token_ids for p in prompts]
    drafter = NGramDrafter(build_table(answers, max_order=3, min_count=1), prompt_lookup_min=0)
    config = GenerationConfig(30, 4, speculation="fixed")
    for prompt, plain in zip(prompts, answers, strict=True):
        result = generate(target, prompt, drafter, config)
        assert result.token_ids == plain
    assert result.stats.block_efficiency > 2.0  # its own answers, drafted from the table


@pytest.mark.parametrize("sampling", [SamplingConfig(1.0), SamplingConfig(0.8, top_k=3)])
def test_sampled_sequences_follow_the_target(sampling):
    target = random_bigram(5, seed=0)
    table = build_table([[0, 1, 2, 3, 4, 0, 1], [2, 2, 4, 1]], max_order=2, min_count=1)
    generator = torch.Generator().manual_seed(7)
    prompt, trials = [0, 1, 2, 0, 3], 4000
    config = GenerationConfig(3, 3, sampling, speculation="fixed")
    counts, accepted = Counter(), 0
    for _ in range(trials):
        result = generate(target, prompt, NGramDrafter(table), config, generator)
        counts[tuple(result.token_ids)] += 1
        accepted += result.stats.draft_tokens_accepted
    assert accepted > trials / 20  # drafts are verified and some accepted
    assert_sequences_follow(counts, bigram_sequence_probs(target, prompt, 3, sampling), trials)


class _Inner:
    """A drafter that records what it was asked."""

    name, vocab_size, max_context = "inner", None, None

    def __init__(self) -> None:
        self.asked: list[list[int]] = []

    def propose(self, context, num_draft_tokens, sampling, generator):
        self.asked.append(context.tolist())
        return "inner's draft"


def test_a_draft_model_combination_drafts_from_the_table_alone_where_its_ngram_is_long_enough():
    table = build_table([[1, 2, 3, 4, 5]] * 3, max_order=2, min_count=1)
    inner = _Inner()
    combined = WithNGramTable(inner, NGramDrafter(table), min_order=2)
    assert combined.propose(torch.tensor([7, 1, 2]), 2, GREEDY, None).tokens.tolist() == [3, 4]
    assert combined.draft_kind(torch.tensor([7, 1, 2]), GREEDY) == ("ngram", 10 * 12 + 2)
    assert inner.asked == []
    assert combined.propose(torch.tensor([7, 2]), 2, GREEDY, None) == "inner's draft"  # order 1 < 2
    assert inner.asked == [[7, 2]]
    assert combined.propose(torch.tensor([7, 1, 2]), 2, SamplingConfig(1.0), None) == "inner's draft"
    with pytest.raises(SpecdraftError, match="ngram_min_order"):
        WithNGramTable(inner, NGramDrafter(table), 0)


def test_by_name_with_a_table_folder_and_clear_errors(tmp_path):
    build_table([[1, 2, 3]], 2, 1).save(tmp_path / "t")
    drafter = make_named("ngram", None, None, {"table": str(tmp_path / "t"), "prompt_lookup_min": "0"})
    assert isinstance(drafter, NGramDrafter) and drafter.copies is None
    with pytest.raises(SpecdraftError, match="build-ngram"):
        make_named("ngram", hf_target(0), None, {})
    with pytest.raises(SpecdraftError, match="unknown drafter option"):
        make_named("ngram", None, None, {"table": str(tmp_path / "t"), "order": "3"})


def test_cli_build_ngram_then_generate(tmp_path, capsys):
    target = str(save_tiny_checkpoint(tmp_path / "target", seed=0))
    base = ["generate", "--target", target, "--prompt", "w3 w5 w7", "--max-new-tokens", "12", "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    answers = tmp_path / "answers.jsonl"
    answers.write_text(json.dumps({"prompt": "w3 w5 w7", "answer_ids": plain["token_ids"]}) + "\n")
    out = tmp_path / "table"
    assert main(["build-ngram", "--answers", str(answers), "--target", target, "--out", str(out),
                 "--min-count", "1"]) == 0
    assert "n-grams of 1 to 4 tokens from 1 answers (12 tokens)" in capsys.readouterr().out
    assert main([*base, "--drafter", "ngram", "--drafter-option", f"table={out}"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"]
    assert main(["build-ngram", "--answers", str(tmp_path / "none.jsonl"), "--target", target, "--out",
                 str(out)]) == 2
    assert "no such file" in capsys.readouterr().err
