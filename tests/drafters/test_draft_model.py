import itertools

import torch

from specdraft.drafters import DraftModelDrafter, draft_model_drafter
from specdraft.drafters.combined import draft_model_of
from specdraft.sampling import SamplingConfig
from toys import hf_target


def test_cached_proposals_equal_fresh_proposals_after_rollbacks():
    """The drafter's cache, synchronised by common prefix, must give what a drafter with no history gives."""
    draft_model = hf_target(1)
    drafter = DraftModelDrafter(draft_model)
    generator = torch.Generator().manual_seed(0)
    context = torch.tensor([3, 4, 5, 6])
    for step in range(12):
        draft = drafter.propose(context, 4, SamplingConfig(), None).tokens
        fresh = DraftModelDrafter(draft_model).propose(context, 4, SamplingConfig(), None).tokens
        assert torch.equal(draft, fresh), step
        keep = step % 5  # accept a varying prefix, then a "recovered" token the draft did not propose
        recovered = torch.randint(0, 64, (1,), generator=generator)
        context = torch.cat([context, draft[:keep], recovered])


def test_sampled_draft_returns_warped_q_rows():
    drafter = DraftModelDrafter(hf_target(1))
    sampling = SamplingConfig(0.8, top_k=5)
    draft = drafter.propose(torch.tensor([3, 4, 5]), 3, sampling, torch.Generator().manual_seed(0))
    assert draft.q is not None and draft.q.shape == (3, 64)
    assert torch.allclose(draft.q.sum(-1), torch.ones(3))
    assert ((draft.q > 0).sum(-1) <= 5).all()
    assert (draft.q[torch.arange(3), draft.tokens] > 0).all()  # each token was drawn from its q row


def test_greedy_draft_is_deterministic_with_no_q():
    drafter = DraftModelDrafter(hf_target(1))
    draft = drafter.propose(torch.tensor([3, 4, 5]), 3, SamplingConfig(), None)
    assert draft.q is None and len(draft) == 3


def test_cache_grows_for_long_contexts():
    drafter = DraftModelDrafter(hf_target(1, max_positions=2048))
    short = drafter.propose(torch.tensor([3, 4]), 2, SamplingConfig(), None).tokens
    long_context = torch.arange(300) % 60
    tokens = drafter.propose(long_context, 3, SamplingConfig(), None).tokens
    assert torch.equal(tokens, DraftModelDrafter(drafter.model).propose(long_context, 3, SamplingConfig(), None).tokens)
    assert short.shape == (2,)


def test_confidence_threshold_cuts_the_chain_after_the_first_unsure_token():
    """confidence_threshold=t: the draft is the full chain's prefix up to and including the first token with
    q(token) < t (greedy: q = softmax of the draft logits), and never longer than γ."""
    model = hf_target(1)
    context = torch.tensor([3, 4, 5, 6])
    full = DraftModelDrafter(model).propose(context, 6, SamplingConfig(), None).tokens  # (6,)
    with torch.no_grad():
        logits = model.model(torch.cat([context, full]).unsqueeze(0)).logits[0, len(context) - 1 : -1]  # (6, V)
    q = torch.softmax(logits.float(), -1)[torch.arange(6), full]  # (6,)
    lengths = set()
    values = sorted(set(q.tolist()))
    # thresholds between the q values, not on them: the drafter's forwards may round q by an ulp differently
    for threshold in [(a + b) / 2 for a, b in itertools.pairwise(values)] + [0.999]:
        unsure = (q < threshold).nonzero()
        expected = int(unsure[0]) + 1 if unsure.numel() else 6
        draft = DraftModelDrafter(model, confidence_threshold=threshold).propose(context, 6, SamplingConfig(), None)
        assert torch.equal(draft.tokens, full[:expected]), threshold
        lengths.add(expected)
    assert len(lengths) > 1  # the thresholds did cut at different places


def test_confidence_threshold_is_lossless():
    """Greedy: same output as plain decoding; sampling: the first drafted position follows the target's p."""
    from collections import Counter

    from specdraft.decoding import generate
    from specdraft.sampling import warp
    from specdraft.sequence import GenerationConfig
    from toys import assert_follows

    target, prompt = hf_target(0), [3, 4, 5, 6]
    drafter = DraftModelDrafter(hf_target(1), confidence_threshold=0.3)
    plain = generate(target, prompt, None, GenerationConfig(24)).token_ids
    assert generate(target, prompt, drafter, GenerationConfig(24, 5)).token_ids == plain
    sampling = SamplingConfig(1.0)
    with torch.no_grad():
        p1 = warp(target.model(torch.tensor([prompt])).logits[0, -1], sampling)  # (V,)
    counts, trials = Counter(), 600
    for seed in range(trials):
        generator = torch.Generator().manual_seed(seed)
        result = generate(target, prompt, drafter, GenerationConfig(2, 4, sampling, speculation="fixed"), generator)
        counts[result.token_ids[0]] += 1
    assert_follows(counts, p1, trials)


def test_confidence_threshold_options_are_checked():
    import pytest

    from specdraft.errors import SpecdraftError

    with pytest.raises(SpecdraftError, match="confidence_threshold must be in"):
        DraftModelDrafter(hf_target(1), confidence_threshold=1.5)
    with pytest.raises(SpecdraftError, match="chain drafts"):
        DraftModelDrafter(hf_target(1), tree_branching=2, confidence_threshold=0.3)


def _vocab_keep(target, prompt: list[int], size: int) -> torch.Tensor:
    """``size`` token ids holding the target's greedy continuation of ``prompt`` (drafts can be accepted)."""
    from specdraft.decoding import generate
    from specdraft.sequence import GenerationConfig

    used = sorted(set(generate(target, prompt, None, GenerationConfig(30)).token_ids))
    rest = [t for t in range(64) if t not in used]
    return torch.tensor(used + rest[: max(size - len(used), 0)])


def test_draft_vocab_native_rows_equal_masked_full_logits_and_stay_inside():
    """keep: a native drafter multiplies by the kept LM-head rows only; its drafts (chain, tree, sampled q) equal
    a transformers drafter's that masks full logits, and never leave the subset."""
    from specdraft.models.native_llama import NativeLlama
    from toys import tiny_llama

    keep = torch.tensor([3, 9, 17, 21, 40, 41, 42, 60])
    native = NativeLlama.from_hf(tiny_llama(1))
    masked = hf_target(1)
    context = torch.tensor([3, 4, 5, 6])
    for options in ({}, {"tree_branching": 2, "tree_nodes": 6}):
        a = DraftModelDrafter(native, keep=keep, **options).propose(context, 4, SamplingConfig(), None)
        b = DraftModelDrafter(masked, keep=keep, **options).propose(context, 4, SamplingConfig(), None)
        assert torch.equal(a.tokens, b.tokens) and torch.isin(a.tokens, keep).all()
    sampling = SamplingConfig(1.0)
    a = DraftModelDrafter(native, keep=keep).propose(context, 4, sampling, torch.Generator().manual_seed(1))
    b = DraftModelDrafter(masked, keep=keep).propose(context, 4, sampling, torch.Generator().manual_seed(1))
    torch.testing.assert_close(a.q, b.q)
    outside = torch.ones(64, dtype=torch.bool)
    outside[keep] = False
    assert (a.q[:, outside] == 0).all() and torch.isin(a.tokens, keep).all()


def test_draft_vocab_is_lossless():
    """Greedy output equals plain decoding (chain and tree); sampling keeps the target's first-token p."""
    from collections import Counter

    from specdraft.decoding import generate
    from specdraft.models.native_llama import NativeLlama
    from specdraft.sampling import warp
    from specdraft.sequence import GenerationConfig
    from toys import assert_follows, tiny_llama

    target, prompt = hf_target(0), [3, 4, 5, 6]
    draft = NativeLlama.from_hf(tiny_llama(1))
    keep = _vocab_keep(target, prompt, 24)
    plain = generate(target, prompt, None, GenerationConfig(30)).token_ids
    for options in ({}, {"tree_branching": 2, "tree_nodes": 6}, {"confidence_threshold": 0.2}):
        result = generate(target, prompt, DraftModelDrafter(draft, keep=keep, **options), GenerationConfig(30, 4))
        assert result.token_ids == plain
    sampling = SamplingConfig(1.0)
    with torch.no_grad():
        p1 = warp(target.model(torch.tensor([prompt])).logits[0, -1], sampling)  # (V,)
    drafter, counts, trials = DraftModelDrafter(draft, keep=keep), Counter(), 600
    for seed in range(trials):
        generator = torch.Generator().manual_seed(seed)
        config = GenerationConfig(2, 4, sampling, speculation="fixed")
        counts[generate(target, prompt, drafter, config, generator).token_ids[0]] += 1
    assert_follows(counts, p1, trials)


def test_load_drafter_reads_the_ranking_next_to_the_weights(tmp_path):
    import pytest

    from specdraft.api import load_drafter
    from specdraft.draft_vocab import save_token_ranking
    from specdraft.errors import SpecdraftError
    from toys import save_tiny_checkpoint, tiny_tokenizer

    folder = save_tiny_checkpoint(tmp_path / "draft", seed=1)
    target, tokenizer = hf_target(0), tiny_tokenizer()
    with pytest.raises(SpecdraftError, match="has no token_ranking"):
        load_drafter(target, tokenizer, draft=str(folder), options={"draft_vocab": "8"})
    save_token_ranking(folder, torch.arange(64).flip(0))
    drafter = load_drafter(target, tokenizer, draft=str(folder), options={"draft_vocab": "8", "tree_branching": "2"})
    assert drafter.vocab_keep.tolist() == list(range(63, 55, -1)) and drafter.tree_branching == 2
    assert load_drafter(target, tokenizer, draft=str(folder), options={"draft_vocab": "0"}).vocab_keep is None
    with pytest.raises(SpecdraftError, match="draft_vocab must be an integer"):
        load_drafter(target, tokenizer, draft=str(folder), options={"draft_vocab": "many"})


def test_folder_drafter_options_are_defaults_that_given_options_override(tmp_path):
    import pytest

    from specdraft.api import load_drafter
    from specdraft.draft_vocab import save_token_ranking
    from specdraft.drafters.options import DRAFTER_OPTIONS_FILE
    from specdraft.errors import SpecdraftError
    from toys import save_tiny_checkpoint, tiny_tokenizer

    folder = save_tiny_checkpoint(tmp_path / "draft", seed=1)
    save_token_ranking(folder, torch.arange(64))
    (folder / DRAFTER_OPTIONS_FILE).write_text('{"draft_vocab": 16, "confidence_threshold": 0.25}')
    target, tokenizer = hf_target(0), tiny_tokenizer()
    drafter = load_drafter(target, tokenizer, draft=str(folder))
    assert drafter.vocab_keep.tolist() == list(range(16)) and drafter.confidence_threshold == 0.25
    off = {"draft_vocab": "0", "confidence_threshold": "0"}
    plain = load_drafter(target, tokenizer, draft=str(folder), options=off)
    assert plain.vocab_keep is None and plain.confidence_threshold == 0.0
    (folder / DRAFTER_OPTIONS_FILE).write_text("[1, 2")
    with pytest.raises(SpecdraftError, match=r"corrupt .*drafter_options\.json"):
        load_drafter(target, tokenizer, draft=str(folder))


def test_trees_asked_for_leave_out_the_folders_chain_options_but_not_given_ones(tmp_path):
    """A folder's defaults for chains (a confidence stop, the prompt-lookup branch, a context window) do not apply
    when the given options ask for trees; its draft vocabulary still does, and a chain option given beside
    ``tree_branching`` is still refused."""
    import pytest

    from specdraft.api import load_drafter
    from specdraft.draft_vocab import save_token_ranking
    from specdraft.drafters.combined import WithPromptLookup
    from specdraft.drafters.options import DRAFTER_OPTIONS_FILE
    from specdraft.errors import SpecdraftError
    from toys import save_tiny_checkpoint, tiny_tokenizer

    folder = save_tiny_checkpoint(tmp_path / "draft", seed=1)
    save_token_ranking(folder, torch.arange(64))
    (folder / DRAFTER_OPTIONS_FILE).write_text('{"draft_vocab": 16, "confidence_threshold": 0.3, "prompt_lookup": 3, '
                                               '"prompt_lookup_alone": 1, "context_window": 8}')
    target, tokenizer = hf_target(0), tiny_tokenizer()
    chains = load_drafter(target, tokenizer, draft=str(folder))
    assert isinstance(chains, WithPromptLookup) and chains.inner.inner.confidence_threshold == 0.3
    trees = load_drafter(target, tokenizer, draft=str(folder), options={"tree_branching": "2", "tree_nodes": "6"})
    assert isinstance(trees, DraftModelDrafter) and trees.tree_branching == 2 and trees.confidence_threshold == 0.0
    assert trees.vocab_keep.tolist() == list(range(16))
    context = torch.tensor([7, 8, 9, 10, 11, 3, 7, 8])
    draft = trees.propose(context, 3, SamplingConfig(), None)
    assert 1 <= len(draft) <= 6 and set(draft.tokens.tolist()) <= set(range(16))
    for given in ({"tree_branching": "2", "prompt_lookup": "2"}, {"tree_branching": "2", "context_window": "8"}):
        with pytest.raises(SpecdraftError, match="chain drafts"):
            load_drafter(target, tokenizer, draft=str(folder), options=given)
    with pytest.raises(SpecdraftError, match="tree_branching"):
        load_drafter(target, tokenizer, draft=str(folder), options={"tree_branching": "two"})


def test_prompt_lookup_branch_is_the_model_chain_plus_the_copied_continuation():
    """Greedy: the draft is a tree whose paths are the model's chain and the prompt-lookup copy (merged where they
    agree); with no n-gram hit it is the model's chain alone."""
    from specdraft.drafters import PromptLookupDrafter
    from specdraft.trees import chain_parents, insert_path, is_chain

    model = hf_target(1)
    context = torch.tensor([7, 8, 9, 10, 11, 3, 7, 8])  # "7 8" occurred before, followed by 9 10 11
    chain = DraftModelDrafter(model).propose(context, 4, SamplingConfig(), None).tokens
    copied = PromptLookupDrafter(3).propose(context, 4, SamplingConfig(), None).tokens
    assert copied.tolist() == [9, 10, 11, 3]
    draft = draft_model_drafter(model, prompt_lookup=3).propose(context, 4, SamplingConfig(), None)
    tokens, parents = insert_path(chain, chain_parents(len(chain)), copied)
    assert torch.equal(draft.tokens, tokens) and draft.q is None
    assert (draft.parents is None) == is_chain(parents)
    assert draft.parents is None or torch.equal(draft.parents, parents)
    no_hit = torch.tensor([20, 21, 22, 23])
    alone = draft_model_drafter(model, prompt_lookup=3, prompt_lookup_min=2).propose(no_hit, 4, SamplingConfig(), None)
    assert torch.equal(alone.tokens, DraftModelDrafter(model).propose(no_hit, 4, SamplingConfig(), None).tokens)
    assert alone.parents is None


def test_prompt_lookup_branch_is_lossless_and_ignored_when_sampling():
    from specdraft.decoding import generate
    from specdraft.sequence import GenerationConfig

    target, prompt = hf_target(0), [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    plain = generate(target, prompt, None, GenerationConfig(32)).token_ids
    for options in ({"prompt_lookup": 3}, {"prompt_lookup": 2, "confidence_threshold": 0.3}):
        drafter, trees = draft_model_drafter(hf_target(1), **options), []
        propose = drafter.propose
        drafter.propose = lambda *args, propose=propose, trees=trees: trees.append(propose(*args)) or trees[-1]
        result = generate(target, prompt, drafter, GenerationConfig(32, 4))
        assert result.token_ids == plain, options
        assert any(d.parents is not None for d in trees)  # the copied branch was verified as a tree
    sampling, context = SamplingConfig(1.0), torch.tensor(prompt)
    with_branch = draft_model_drafter(hf_target(1), prompt_lookup=3).propose(
        context, 4, sampling, torch.Generator().manual_seed(0))
    without = DraftModelDrafter(hf_target(1)).propose(context, 4, sampling, torch.Generator().manual_seed(0))
    assert torch.equal(with_branch.tokens, without.tokens) and with_branch.parents is None


def test_prompt_lookup_options_are_checked():
    import pytest

    from specdraft.errors import SpecdraftError

    with pytest.raises(SpecdraftError, match="chain drafts"):
        draft_model_drafter(hf_target(1), tree_branching=2, prompt_lookup=3)
    with pytest.raises(SpecdraftError, match="min_ngram_size"):
        draft_model_drafter(hf_target(1), prompt_lookup=2, prompt_lookup_min=3)
    with pytest.raises(SpecdraftError, match="prompt_lookup must be >= 0"):
        draft_model_drafter(hf_target(1), prompt_lookup=-1)
    with pytest.raises(SpecdraftError, match="needs prompt_lookup"):
        draft_model_drafter(hf_target(1), prompt_lookup_alone=3)


def test_prompt_lookup_alone_skips_the_model_on_a_long_match():
    from specdraft.decoding import generate
    from specdraft.sequence import GenerationConfig

    model = hf_target(1)
    context = torch.tensor([7, 8, 9, 10, 11, 12, 3, 7, 8, 9])  # "7 8 9" matched: copy 10 11 12 3
    drafter = draft_model_drafter(model, prompt_lookup=3, prompt_lookup_alone=3)
    draft = drafter.propose(context, 4, SamplingConfig(), None)
    model_drafter = draft_model_of(drafter)
    assert draft.tokens.tolist() == [10, 11, 12, 3] and draft.parents is None and model_drafter._cache is None
    short = drafter.propose(context, 8, SamplingConfig(), None)  # the copy has only 7 tokens: the model drafts too
    assert model_drafter._cache is not None and len(short) >= 8
    assert drafter.draft_kind(context, SamplingConfig()) == ("copy", 3)  # the hint a policy prices steps by
    assert drafter.draft_kind(context[:-1], SamplingConfig()) == "model"  # "7 8" is no 3-gram match
    assert drafter.draft_kind(context, SamplingConfig(temperature=1.0)) == "model"  # copies are greedy-only
    target, prompt = hf_target(0), [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    plain = generate(target, prompt, None, GenerationConfig(32)).token_ids
    assert generate(target, prompt, drafter, GenerationConfig(32, 4)).token_ids == plain


def test_siblings_hang_the_runners_up_beside_every_chain_token():
    """Greedy, ``siblings=2``: the tree is the model's chain plus, under chain[:d], the two next most likely draft
    tokens at depth d (read from the same draft logits), with no extra draft forward."""
    model = hf_target(1)
    context = torch.tensor([3, 4, 5, 6, 9])
    chain = DraftModelDrafter(model).propose(context, 3, SamplingConfig(), None).tokens  # (3,)
    logits = model.forward(torch.cat([context, chain[:-1]]).unsqueeze(0), model.new_cache(16))[0, -3:]  # (3, V)
    runners_up = logits.topk(3).indices[:, 1:]  # (3, 2): ranks 2 and 3 at each depth
    assert torch.equal(logits.argmax(-1), chain)
    drafter = draft_model_drafter(model, siblings=2)
    calls = []
    model_drafter = draft_model_of(drafter)
    forward = model_drafter._forward
    model_drafter._forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    draft = drafter.propose(context, 3, SamplingConfig(), None)
    assert len(calls) == 3  # the chain's forwards (sync + 2), as without siblings
    assert draft.q is None and draft.tokens[:3].tolist() == chain.tolist()
    siblings = [(int(p), int(t)) for p, t in zip(draft.parents[3:], draft.tokens[3:], strict=True)]
    assert siblings == [(d - 1, int(t)) for d in range(3) for t in runners_up[d]]


def test_siblings_respect_the_draft_vocabulary_and_are_lossless():
    from specdraft.decoding import generate
    from specdraft.sequence import GenerationConfig

    keep = torch.arange(0, 64, 2)  # even tokens only
    drafter = draft_model_drafter(hf_target(1), siblings=3, keep=keep)
    draft = drafter.propose(torch.tensor([3, 4, 5]), 4, SamplingConfig(), None)
    assert len(draft) == 16 and bool((draft.tokens % 2 == 0).all())
    target, prompt = hf_target(0), [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    plain = generate(target, prompt, None, GenerationConfig(40)).token_ids
    for options in ({"siblings": 1}, {"siblings": 2, "confidence_threshold": 0.3, "prompt_lookup": 3}):
        drafter, trees = draft_model_drafter(hf_target(1), **options), []
        propose = drafter.propose
        drafter.propose = lambda *args, propose=propose, trees=trees: trees.append(propose(*args)) or trees[-1]
        result = generate(target, prompt, drafter, GenerationConfig(40, 4))
        assert result.token_ids == plain, options
        assert all(d.parents is not None for d in trees)  # every step verified a tree


def test_siblings_are_ignored_when_sampling_and_checked():
    import pytest

    from specdraft.errors import SpecdraftError

    sampling, context = SamplingConfig(1.0), torch.tensor([3, 4, 5, 6])
    with_siblings = draft_model_drafter(hf_target(1), siblings=2).propose(
        context, 4, sampling, torch.Generator().manual_seed(0))
    without = DraftModelDrafter(hf_target(1)).propose(context, 4, sampling, torch.Generator().manual_seed(0))
    assert torch.equal(with_siblings.tokens, without.tokens) and with_siblings.parents is None
    assert torch.equal(with_siblings.q, without.q)
    with pytest.raises(SpecdraftError, match="siblings must be >= 0"):
        draft_model_drafter(hf_target(1), siblings=-1)
    with pytest.raises(SpecdraftError, match="tree_branching"):
        draft_model_drafter(hf_target(1), siblings=1, tree_branching=2)


def _chain_copy_reference(model, context: torch.Tensor, depth: int, smallest: int) -> list[int]:
    """At each depth: the continuation of the longest (4 down to ``smallest``) n-gram match of the running context,
    else the model's argmax after it, from a fresh forward."""
    running = context.tolist()
    for _ in range(depth):
        token = None
        for n in range(max(smallest, 4), smallest - 1, -1):
            starts = [j for j in range(len(running) - n) if running[j:j + n] == running[-n:]]
            if starts:
                token = running[starts[-1] + n]
                break
        if token is None:
            ids = torch.tensor(running).unsqueeze(0)
            token = int(model.forward(ids, model.new_cache(64))[0, -1].argmax())
        running.append(token)
    return running[context.shape[0]:]


def test_chain_copy_drafts_the_matched_continuation_at_every_depth_and_the_model_elsewhere():
    """``chain_copy=2``: a depth whose running context ends in a seen 2-gram (or longer) copies what followed it,
    with no draft forward, and the model drafts the other depths from its cache, caught up over the copies."""
    from specdraft.drafters.draft_model import COPY, MODEL

    model = hf_target(1)
    context = torch.tensor([7, 8, 9, 10, 3, 5, 7, 8])  # "7 8" seen: copy 9 10, then "9 10" matches: copy 3 5 ...
    drafter = draft_model_drafter(model, chain_copy=2)
    calls = []
    model_drafter = draft_model_of(drafter)
    forward = model_drafter._forward
    model_drafter._forward = lambda *a, **k: calls.append(a[0].shape[1]) or forward(*a, **k)
    draft = drafter.propose(context, 6, SamplingConfig(), None)
    assert draft.tokens.tolist() == _chain_copy_reference(model, context, 6, 2)
    assert draft.tokens.tolist()[:4] == [9, 10, 3, 5] and draft.q is None
    assert calls == []  # every depth copied: not even the context tail is fed
    assert draft.source.tolist()[:2] == [COPY + 2, COPY + 3] and draft.confidence[:2].isnan().all()
    for context in (torch.tensor([3, 4, 5, 6, 3, 4]), torch.tensor([11, 12, 13, 14]), torch.arange(20) % 7):
        for depth in (1, 3, 5):
            draft = draft_model_drafter(model, chain_copy=2).propose(context, depth, SamplingConfig(), None)
            assert draft.tokens.tolist() == _chain_copy_reference(model, context, depth, 2), (context, depth)
            copied = draft.source >= COPY
            assert draft.confidence[copied].isnan().all() and (draft.source[~copied] == MODEL).all()
    drafter = draft_model_drafter(model, chain_copy=2)
    assert drafter.draft_kind(torch.tensor([7, 8, 9, 7, 8]), SamplingConfig()) == ("chain_copy", 2)
    assert drafter.draft_kind(torch.tensor([7, 8, 9, 7]), SamplingConfig()) == "model"  # a 1-gram is too short


def test_chain_copy_cache_stays_exact_after_rollbacks_and_is_lossless():
    from specdraft.decoding import generate
    from specdraft.sequence import GenerationConfig

    model, generator = hf_target(1), torch.Generator().manual_seed(0)
    drafter = draft_model_drafter(model, chain_copy=2)
    context = torch.tensor([3, 4, 5, 6, 3, 4])
    for step in range(16):
        draft = drafter.propose(context, 4, SamplingConfig(), None).tokens
        assert draft.tolist() == _chain_copy_reference(model, context, 4, 2), step
        keep = step % 5
        recovered = torch.randint(0, 64, (1,), generator=generator)
        context = torch.cat([context, draft[:keep], recovered])
    target, prompt = hf_target(0), [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    plain = generate(target, prompt, None, GenerationConfig(40)).token_ids
    for options in ({"chain_copy": 2}, {"chain_copy": 3, "confidence_threshold": 0.3},
                    {"chain_copy": 2, "prompt_lookup": 3, "prompt_lookup_alone": 2, "siblings": 1}):
        drafter = draft_model_drafter(hf_target(1), **options)
        assert generate(target, prompt, drafter, GenerationConfig(40, 4)).token_ids == plain, options


def test_chain_copy_when_sampling_is_a_point_mass_row_and_options_are_checked():
    import pytest

    from specdraft.errors import SpecdraftError

    context = torch.tensor([7, 8, 9, 10, 3, 5, 7, 8])
    draft = draft_model_drafter(hf_target(1), chain_copy=2).propose(
        context, 3, SamplingConfig(1.0), torch.Generator().manual_seed(0))
    assert draft.tokens.tolist() == [9, 10, 3] and draft.q.shape == (3, 64)
    assert torch.equal(draft.q, torch.nn.functional.one_hot(draft.tokens, 64).float())
    with pytest.raises(SpecdraftError, match="chain_copy must be >= 0"):
        draft_model_drafter(hf_target(1), chain_copy=-1)
    with pytest.raises(SpecdraftError, match=r"chain_copy must be >= 0 .* with tree_branching"):
        draft_model_drafter(hf_target(1), chain_copy=2, tree_branching=2)


def test_context_window_reads_the_sinks_and_the_last_tokens_of_a_long_prompt_then_what_follows():
    """context_window=W: a prompt longer than W is read as its first SINK_TOKENS tokens and the W - SINK_TOKENS last
    ones, positions contiguous; the draft is what a fresh drafter drafts after that view, and the cache follows the
    answer's tokens (rollbacks too) without reading the prompt again."""
    from specdraft.drafters.combined import SINK_TOKENS, WithContextWindow

    model, reference = hf_target(1, max_positions=2048), hf_target(1, max_positions=2048)  # equal weights
    window = 24
    drafter = WithContextWindow(DraftModelDrafter(model), window)
    prompt = torch.arange(100) % 60 + 3  # (100,)
    view = torch.cat([prompt[:SINK_TOKENS], prompt[100 - (window - SINK_TOKENS):]])  # (W,)
    drafter.begin(None, None)
    context, fed = prompt, []
    forward = model.forward
    model.forward = lambda ids, *a, **k: fed.append(ids.shape[1]) or forward(ids, *a, **k)
    generator = torch.Generator().manual_seed(0)
    for step in range(6):
        draft = drafter.propose(context, 3, SamplingConfig(), None).tokens
        suffix = context[100:]
        alone = DraftModelDrafter(reference).propose(torch.cat([view, suffix]), 3, SamplingConfig(), None).tokens
        assert torch.equal(draft, alone), step
        context = torch.cat([context, draft[: step % 3], torch.randint(3, 60, (1,), generator=generator)])
    assert fed[0] == window and max(fed[1:]) <= 4  # the prompt once, as its window; then the tokens committed
    drafter.begin(None, None)  # a new sequence: its window is placed anew
    short = torch.tensor([3, 4, 5, 6])
    assert torch.equal(drafter.propose(short, 3, SamplingConfig(), None).tokens,
                       DraftModelDrafter(reference).propose(short, 3, SamplingConfig(), None).tokens)


def test_context_window_is_lossless_and_checked():
    import pytest

    from specdraft.decoding import generate
    from specdraft.errors import SpecdraftError
    from specdraft.sequence import GenerationConfig

    target, prompt = hf_target(0), [int(t) for t in torch.arange(40) % 50 + 3]
    plain = generate(target, prompt, None, GenerationConfig(24)).token_ids
    drafter = draft_model_drafter(hf_target(1), context_window=8, prompt_lookup=2)
    assert generate(target, prompt, drafter, GenerationConfig(24, 4)).token_ids == plain
    for bad in ({"context_window": 4}, {"context_window": -1}, {"context_window": 16, "tree_branching": 2}):
        with pytest.raises(SpecdraftError, match="context_window"):
            draft_model_drafter(hf_target(1), **bad)
