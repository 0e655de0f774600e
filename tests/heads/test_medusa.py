"""Medusa heads (Cai et al. 2024) and the Medusa drafter: initialisation, loss offsets, a toy training run whose heads
learn the target's continuation (τ > 1), greedy equality and the sampled marginal on both model paths, and the
errors for bad heads folders."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from specdraft.decoding import generate
from specdraft.drafters.medusa import DEFAULT_TREE, MedusaDrafter, parse_tree
from specdraft.drafters.registry import make_named
from specdraft.errors import SpecdraftError
from specdraft.heads import WEIGHTS_FILE, load_heads, save_heads
from specdraft.heads.medusa import MedusaHeads, build_medusa, medusa_loss
from specdraft.models.hf import HFCausalLM
from specdraft.models.native_llama import NativeLlama
from specdraft.sampling import SamplingConfig
from specdraft.sequence import GenerationConfig
from specdraft.training.data.batches import collate_distill
from specdraft.training.heads.kinds import MEDUSA
from toys import assert_follows, sample_second_tokens, second_token_marginal, tiny_llama

PROMPTS = [[5, 9, 3, 17, 9, 3, 22, 40], [7, 7, 31, 12], [50, 4, 18, 18, 33, 2, 61], [11, 23]]


def _spec(vocab=64, hidden=32, heads=4, share=True) -> dict:
    return {"hidden_size": hidden, "vocab_size": vocab, "num_heads": heads, "share_lm_head": share, "decay": 0.8}


def _train_toy_heads(model, prompts, new_tokens: int = 24, steps: int = 150, share: bool = True) -> MedusaHeads:
    """Heads trained (full batch, Adam) on the target's own greedy continuations of ``prompts``: a deterministic
    sequence pattern the heads can memorise."""
    target = NativeLlama.from_hf(model)
    records = [{"prompt_token_ids": p, "response_token_ids": generate(target, p, None,
                                                                        GenerationConfig(new_tokens)).token_ids}
               for p in prompts]
    batch = collate_distill([{"ids": torch.tensor(r["prompt_token_ids"] + r["response_token_ids"]),
                              "prompt_len": len(r["prompt_token_ids"])} for r in records], pad_id=0)
    torch.manual_seed(0)
    heads = build_medusa(_spec(share=share))
    MEDUSA.init(heads, model)
    optimizer = torch.optim.Adam(heads.parameters(), lr=1e-2)
    for _ in range(steps):
        loss, _ = MEDUSA.loss(heads, model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return heads.eval()


@pytest.fixture(scope="module")
def trained():
    model = tiny_llama(0)
    return model, _train_toy_heads(model, PROMPTS)


def test_fresh_heads_are_the_lm_head():
    """Zero-initialised residual blocks are the identity: every fresh head's logits are the LM head's logits of the
    same hidden state (shared LM head, and Medusa's own projections copied from it)."""
    torch.manual_seed(0)
    hidden, lm_head = torch.randn(3, 5, 32), torch.randn(64, 32)  # (B, T, D), (V, D)
    expected = hidden @ lm_head.T  # (B, T, V)
    shared = MedusaHeads(32, 64, 3)
    torch.testing.assert_close(shared(hidden, lm_head), expected.expand(3, -1, -1, -1))
    own = MedusaHeads(32, 64, 3, share_lm_head=False)
    own.init_from_lm_head(lm_head)
    torch.testing.assert_close(own(hidden), expected.expand(3, -1, -1, -1))
    assert sum(p.numel() for p in shared.parameters()) == 3 * (32 * 32 + 32)
    with pytest.raises(SpecdraftError, match="pass its weight"):
        shared(hidden)


def test_loss_scores_head_k_against_token_t_plus_k_plus_1():
    """Logits that put head k at position t on ids[t+k+1] are all right; shifted by one they are all wrong."""
    ids = torch.tensor([[3, 8, 1, 6, 4, 9, 2, 7]])  # (1, 8)
    batch = collate_distill([{"ids": ids[0], "prompt_len": 2}], pad_id=0)  # labels[t] = ids[t+1]
    width, heads, vocab = batch["labels"].shape[1], 3, 10

    def logits_at(shift: int) -> torch.Tensor:
        out = torch.full((heads, 1, width, vocab), -10.0)
        for k in range(1, heads + 1):
            for t in range(width):
                if t + k + 1 + shift < ids.shape[1]:
                    out[k - 1, 0, t, ids[0, t + k + 1 + shift]] = 10.0
        return out

    loss, accuracy, count = medusa_loss(logits_at(0), batch["labels"], batch["mask"])
    # response tokens are ids[2:8] = labels[1:7]; head k at t targets ids[t+k+1], a response token for t in 0..6-k
    assert count == 6
    assert [a for a, n in accuracy] == [n for a, n in accuracy] == [6, 5, 4]
    assert float(loss) < 1e-3
    _, wrong, _ = medusa_loss(logits_at(1), batch["labels"], batch["mask"])
    assert all(a == 0 for a, _ in wrong)


def test_self_distillation_scores_head_k_against_the_target_distribution_of_token_t_plus_k_plus_1():
    """teacher (B, T, V) = p(label t): one-hot teachers give the hard-label loss; soft ones give
    sum_k λ_k mean CE(teacher[t + k], head k at t), checked by hand; the distill option reaches the spec."""
    torch.manual_seed(0)
    ids = torch.tensor([[3, 8, 1, 6, 4, 9, 2, 7]])  # (1, 8)
    batch = collate_distill([{"ids": ids[0], "prompt_len": 2}], pad_id=0)
    width, heads, vocab = batch["labels"].shape[1], 3, 10
    logits = torch.randn(heads, 1, width, vocab)  # (K, B, T, V)
    one_hot = F.one_hot(batch["labels"].clamp_min(0), vocab).float()  # (B, T, V)
    hard, _, _ = medusa_loss(logits, batch["labels"], batch["mask"])
    torch.testing.assert_close(medusa_loss(logits, batch["labels"], batch["mask"], teacher=one_hot)[0], hard)
    teacher = torch.softmax(torch.randn(1, width, vocab), -1)  # (B, T, V)
    loss, _, _ = medusa_loss(logits, batch["labels"], batch["mask"], decay=0.5, teacher=teacher)
    expected = 0.0
    for k in range(1, heads + 1):
        rows = [t for t in range(width - k) if batch["mask"][0, t + k]]
        ce = [-(teacher[0, t + k] * torch.log_softmax(logits[k - 1, 0, t], -1)).sum() for t in rows]
        expected += 0.5 ** (k - 1) * torch.stack(ce).mean()
    torch.testing.assert_close(loss, expected)
    model = tiny_llama(0)
    assert MEDUSA.spec(model.config, type("C", (), {"num_heads": 2, "share_lm_head": True}), {"distill": "1"})[
        "distill"] is True
    assert build_medusa(_spec() | {"distill": True}).distill
    with pytest.raises(SpecdraftError, match="distill must be 0"):
        MEDUSA.spec(model.config, type("C", (), {"num_heads": 2, "share_lm_head": True}), {"distill": "yes"})


def test_trained_heads_learn_the_pattern_and_draft_it(trained):
    """Trained on the target's own continuations, the heads draft them: τ > 1 there, output unchanged; an offset
    error between training and drafting would leave τ near 1."""
    model, heads = trained
    target = NativeLlama.from_hf(model)
    drafter = MedusaDrafter.from_module(heads)
    for prompt in PROMPTS:
        plain = generate(target, prompt, None, GenerationConfig(24)).token_ids
        result = generate(target, prompt, drafter, GenerationConfig(24, 4, speculation="fixed"))
        assert result.token_ids == plain
        assert result.stats.block_efficiency > 2.0, result.stats.block_efficiency
    chain = MedusaDrafter.from_module(heads, top_k=1)  # each head's argmax: a chain through the tree path
    fixed = GenerationConfig(24, 4, speculation="fixed")
    assert generate(target, PROMPTS[0], chain, fixed).stats.block_efficiency > 1.5


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_greedy_equals_plain_decoding(trained, kind):
    """fp32 tiny targets, native and transformers: Medusa output is plain greedy output token for token, on
    prompts the heads saw and on new ones, for several γ and trees."""
    model, heads = trained
    target = NativeLlama.from_hf(model) if kind == "native" else HFCausalLM(model)
    for prompt in PROMPTS + [[40, 41, 42], [3] * 9]:
        plain = generate(target, prompt, None, GenerationConfig(30)).token_ids
        for gamma, tree in ((4, ""), (2, ""), (5, "0/1/0.0/0.0.0/0.0.0.0/0.0.0.0.0")):
            drafter = MedusaDrafter.from_module(heads, tree=tree)
            assert generate(target, prompt, drafter, GenerationConfig(30, gamma)).token_ids == plain
        for gamma, nodes in ((4, 1), (4, 6), (3, 24)):
            drafter = MedusaDrafter.from_module(heads, tree_nodes=nodes, top_k=4)
            assert generate(target, prompt, drafter, GenerationConfig(30, gamma)).token_ids == plain


def test_dynamic_tree_keeps_the_most_confident_paths(trained):
    """tree_nodes=N: at most N nodes, closed under ancestors, depth <= γ; with one node it is head 1's argmax, and
    every node's path is among the best N by summed head log-probabilities (checked by brute force)."""
    model, heads = trained
    target = NativeLlama.from_hf(model)
    drafter = MedusaDrafter.from_module(heads, tree_nodes=1)
    drafter.begin(target, None)
    drafter.hidden = torch.randn(32, generator=torch.Generator().manual_seed(0))
    logp = torch.log_softmax(heads(drafter.hidden, model.lm_head.weight), -1).detach()  # (K, V)
    one = drafter.propose(torch.tensor([5]), 4, SamplingConfig(0.0), None)
    assert one.tokens.tolist() == [int(logp[0].argmax())]
    for nodes, gamma in ((5, 4), (12, 3), (40, 4)):
        drafter = MedusaDrafter.from_module(heads, tree_nodes=nodes, top_k=3)
        drafter.begin(target, None)
        drafter.hidden = torch.randn(32, generator=torch.Generator().manual_seed(nodes))
        logp = torch.log_softmax(heads(drafter.hidden, model.lm_head.weight), -1).detach()  # (K, V)
        draft = drafter.propose(torch.tensor([5]), gamma, SamplingConfig(0.0), None)
        parents = draft.parents.tolist()
        assert 1 <= len(draft) <= nodes and all(-1 <= parent < i for i, parent in enumerate(parents))
        paths = []
        for i in range(len(draft)):
            path, node = [], i
            while node >= 0:
                path.insert(0, int(draft.tokens[node]))
                node = parents[node]
            paths.append(tuple(path))
        assert len(set(paths)) == len(paths) and max(map(len, paths)) <= gamma
        score = {path: sum(float(logp[k, t]) for k, t in enumerate(path)) for path in paths}
        top3 = logp.topk(3, -1).indices  # (K, 3)
        assert all(t in top3[k].tolist() for path in paths for k, t in enumerate(path))
        leaves = [path for path in paths if not any(o[:-1] == path for o in paths)]
        worst_kept = min(score[path] for path in leaves)
        # every path of depth <= γ over the top-3 candidates that scores above the worst kept leaf by a margin
        # (the beam may cut ties) is in the tree
        for depth in range(1, gamma + 1):
            for ranks in itertools.product(range(3), repeat=depth):
                path = tuple(int(top3[k, r]) for k, r in enumerate(ranks))
                total = sum(float(logp[k, t]) for k, t in enumerate(path))
                if total > worst_kept + 1e-6 and len(draft) == nodes:
                    assert path in score, (path, total, worst_kept)


def test_dynamic_tree_options_are_checked(trained):
    _, heads = trained
    with pytest.raises(SpecdraftError, match="tree_nodes must be"):
        MedusaDrafter.from_module(heads, tree_nodes=-1)
    with pytest.raises(SpecdraftError, match="not both"):
        MedusaDrafter.from_module(heads, tree="0/1", tree_nodes=4)


def test_sampled_marginal_matches_the_target(trained):
    """Sampling (temperature 1): the second token, the first one drafted by the heads, follows the target's exact
    marginal sum_t1 p(t1) p(t2 | t1) (chi-square), and drafts do get accepted."""
    model, heads = trained
    target = NativeLlama.from_hf(model)
    prompt, sampling = PROMPTS[0], SamplingConfig(1.0)
    marginal = second_token_marginal(model, prompt, sampling)  # (V,)
    for drafter in (MedusaDrafter.from_module(heads, tree="/".join(str(i) for i in range(8)) + "/0.0/0.1/1.0"),
                    MedusaDrafter.from_module(heads, tree_nodes=10, top_k=4)):
        counts, accepted = sample_second_tokens(target, prompt, drafter, sampling, trials=1000)
        assert_follows(counts, marginal, 1000)
        assert accepted > 100


def test_first_step_is_empty_and_begin_resets():
    drafter = MedusaDrafter.from_module(build_medusa(_spec()))
    target = NativeLlama.from_hf(tiny_llama(0))
    drafter.begin(target, None)
    assert len(drafter.propose(torch.tensor([5, 6]), 4, SamplingConfig(0.0), None)) == 0
    drafter.hidden = torch.zeros(32)
    draft = drafter.propose(torch.tensor([5, 6]), 4, SamplingConfig(0.0), None)
    assert len(draft) == len(DEFAULT_TREE) == 16 and draft.is_tree
    assert len(drafter.propose(torch.tensor([5, 6]), 2, SamplingConfig(0.0), None)) == 10  # cut to depth 2
    drafter.begin(target, None)
    assert drafter.hidden is None


def test_parse_tree():
    assert parse_tree("0/1/0.0 0.1") == [(0,), (1,), (0, 0), (0, 1)]
    assert parse_tree("") == list(DEFAULT_TREE)
    with pytest.raises(SpecdraftError, match="paths of choice ranks"):
        parse_tree("0,1")
    with pytest.raises(SpecdraftError, match="without its prefix"):
        MedusaDrafter.from_module(build_medusa(_spec()), tree="0/1.0")


def test_heads_folder_round_trip_and_cli_factory(trained, tmp_path):
    model, heads = trained
    path = save_heads(heads, "medusa", _spec(), tmp_path / "heads", "tiny")
    meta, loaded = load_heads(path)
    assert meta["kind"] == "medusa" and meta["spec"]["num_heads"] == 4
    for a, b in zip(heads.state_dict().values(), loaded.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b)
    target = NativeLlama.from_hf(model)
    drafter = make_named("medusa", target, None, {"heads": str(path), "tree": "0/0.0/0.0.0"})
    plain = generate(target, PROMPTS[1], None, GenerationConfig(20)).token_ids
    assert generate(target, PROMPTS[1], drafter, GenerationConfig(20, 3)).token_ids == plain
    with pytest.raises(SpecdraftError, match="heads=PATH"):
        make_named("medusa", target, None, {})


def test_bad_heads_folders_are_clear_errors(tmp_path):
    heads = build_medusa(_spec())
    with pytest.raises(SpecdraftError, match="not a heads folder"):
        MedusaDrafter(str(tmp_path / "nowhere"))
    path = save_heads(heads, "medusa", _spec(), tmp_path / "heads", "tiny")
    weights = path / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(SpecdraftError, match="corrupt heads weights"):
        MedusaDrafter(str(path))
    path = save_heads(heads, "medusa", _spec(heads=2), tmp_path / "other", "tiny")
    with pytest.raises(SpecdraftError, match="does not match"):
        MedusaDrafter(str(path))
    (path / "heads.json").write_text("{not json")
    with pytest.raises(SpecdraftError, match="corrupt"):
        MedusaDrafter(str(path))


def test_vocabulary_mismatch_is_refused(tmp_path):
    """Heads trained for another vocabulary (or hidden size) are refused before drafting."""
    path = save_heads(build_medusa(_spec(vocab=80)), "medusa", _spec(vocab=80), tmp_path / "heads", "tiny")
    target = NativeLlama.from_hf(tiny_llama(0))
    with pytest.raises(SpecdraftError, match="vocabulary mismatch"):
        generate(target, PROMPTS[0], MedusaDrafter(str(path)), GenerationConfig(8, 3))
    drafter = MedusaDrafter.from_module(build_medusa(_spec(hidden=16)))
    with pytest.raises(SpecdraftError, match="hidden size 16"):
        drafter.begin(target, None)


def test_heads_saved_in_bfloat16_load_as_float32(trained, tmp_path):
    """save_heads(dtype=bfloat16) halves the file; load_heads gives fp32 modules equal to the rounded weights."""
    from safetensors.torch import load_file

    _, heads = trained
    path = save_heads(heads, "medusa", _spec(), tmp_path / "bf16", "tiny", dtype=torch.bfloat16)
    assert {t.dtype for t in load_file(str(path / WEIGHTS_FILE)).values()} == {torch.bfloat16}
    _, loaded = load_heads(path)
    for a, b in zip(heads.state_dict().values(), loaded.state_dict().values(), strict=True):
        assert b.dtype == torch.float32
        torch.testing.assert_close(a.to(torch.bfloat16).float(), b)


def test_shipped_heads_names_resolve_and_unknown_paths_fail(tmp_path, monkeypatch):
    from specdraft.models import registry

    monkeypatch.setitem(registry.SHIPPED_HEADS, "toy-heads", tmp_path / "absent")
    with pytest.raises(SpecdraftError, match="shipped heads 'toy-heads' are missing"):
        load_heads("toy-heads")
    with pytest.raises(SpecdraftError, match="not a heads folder"):
        load_heads(tmp_path / "nowhere")
