"""EAGLE head (Li et al. 2024, arXiv 2401.15077) and its EAGLE-2 dynamic-tree drafter (arXiv 2406.16858): sizes,
the feature-stream alignment between training and drafting, the loss, learning on a toy target, greedy equality
with plain decoding on both model paths, the sampled marginal (chi-square), the heads folder and its errors."""


import pytest
import torch
import torch.nn.functional as F

from specdraft.decoding import generate
from specdraft.drafters.eagle import EagleDrafter
from specdraft.drafters.registry import make_named
from specdraft.errors import SpecdraftError
from specdraft.heads import WEIGHTS_FILE, save_heads
from specdraft.heads.eagle import EagleHead, build_eagle, eagle_loss, eagle_spec, num_parameters
from specdraft.models.hf import HFCausalLM
from specdraft.models.native_llama import NativeLlama
from specdraft.models.shared_embeddings import target_weights
from specdraft.sampling import SamplingConfig
from specdraft.sequence import GenerationConfig
from specdraft.training.data.batches import collate_distill
from specdraft.training.heads.kinds import EAGLE
from specdraft.training.heads.train_heads import HEAD_KINDS
from specdraft.trees import depths
from specdraft.verification import VerifyResult
from toys import assert_follows, sample_second_tokens, second_token_marginal, tiny_llama

PROMPTS = [[5, 9, 3, 17, 9, 3, 22, 40], [7, 7, 31, 12], [50, 4, 18, 18, 33, 2, 61], [11, 23]]


def _head(model, seed: int = 0, **options) -> EagleHead:
    torch.manual_seed(seed)
    return build_eagle(eagle_spec(model.config, None, {k: str(v) for k, v in options.items()}))


def _features(model, ids: list[int]) -> torch.Tensor:
    """The target's final-normed features (T, D) of ``ids``, teacher-forced."""
    with torch.no_grad():
        return model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]


def _train_toy_head(model, prompts, new_tokens: int = 24, steps: int = 200) -> EagleHead:
    """A head trained (full batch, Adam) on the target's own greedy continuations of ``prompts``."""
    target = NativeLlama.from_hf(model)
    items = [{"ids": torch.tensor(p + generate(target, p, None, GenerationConfig(new_tokens)).token_ids),
              "prompt_len": len(p)} for p in prompts]
    batch = collate_distill(items, pad_id=0)
    head = _head(model)
    EAGLE.init(head, model)
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(steps):
        loss, _ = EAGLE.loss(head, model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval()


@pytest.fixture(scope="module")
def trained():
    model = tiny_llama(0).requires_grad_(False)
    return model, _train_toy_head(model, PROMPTS)


def test_head_sizes_registry_and_options():
    model = tiny_llama(0)
    head = _head(model)
    d, hd, ffn = 32, 8, 64
    expected = 2 * d * d + d + (4 + 2 * 2) * hd * d + 4 * hd * d + d + 3 * d * ffn  # fc, qkv, o, mlp norm, mlp
    assert num_parameters(head) == expected == sum(p.numel() for p in head.parameters())
    assert not any("embed" in k or "lm_head" in k or "rope" in k for k in head.state_dict())  # target stays out
    out = head(torch.randn(2, 5, d), torch.randn(2, 5, d))
    assert out.shape == (2, 5, d)
    assert HEAD_KINDS["eagle"] is EAGLE
    assert head.loss_settings == {"cls_weight": 0.1, "reg_weight": 1.0, "noise": 0.0, "partial_alignment": 0.0}
    with pytest.raises(SpecdraftError, match="unknown eagle option decay"):
        eagle_spec(model.config, None, {"decay": "0.8"})
    with pytest.raises(SpecdraftError, match="cls_weight must be a number"):
        eagle_spec(model.config, None, {"cls_weight": "lots"})


def test_feature_stream_in_pieces_and_as_a_tree_equals_one_forward():
    """Pairs fed in pieces on the cache, or as a one-node-per-level tree with explicit positions and mask, give the
    predictions of one causal forward over all pairs (the training path)."""
    model = tiny_llama(0)
    head = _head(model).eval()
    feats, embeds = torch.randn(1, 9, 32), torch.randn(1, 9, 32)
    with torch.no_grad():
        whole = head(feats, embeds)  # (1, 9, D)
        cache = head.new_cache(32)
        pieces = torch.cat([head(feats[:, :4], embeds[:, :4], cache), head(feats[:, 4:5], embeds[:, 4:5], cache),
                            head(feats[:, 5:], embeds[:, 5:], cache)], dim=1)
        torch.testing.assert_close(pieces, whole, atol=1e-5, rtol=1e-5)
        cache.crop(6)
        mask = torch.ones(3, 9, dtype=torch.bool).tril(6)  # (3, 9): slots 0..5 plus the ancestors
        tree = head(feats[:, 6:], embeds[:, 6:], cache, torch.tensor([6, 7, 8]), mask)
        torch.testing.assert_close(tree, whole[:, 6:], atol=1e-5, rtol=1e-5)


def test_loss_regresses_the_next_feature_and_scores_tokens_against_the_target():
    """Pair t = (f_t, x_{t+1}) targets f_{t+1}: with cls_weight 0 the loss is the masked smooth L1 of that shift;
    only the head gets gradients; the count is the mask's."""
    model = tiny_llama(0)
    head = _head(model)
    ids = [3, 8, 1, 6, 4, 9, 2, 7]
    batch = collate_distill([{"ids": torch.tensor(ids), "prompt_len": 3}], pad_id=0)
    features = _features(model, ids)[None]  # (1, 8, D)
    embed, lm_head = target_weights(model)
    mask = batch["mask"]  # (1, 7): pairs whose x_{t+1} is a response token
    loss, count = eagle_loss(head, features, torch.tensor([ids]), mask, embed, lm_head, cls_weight=0.0)
    predicted = head(features[:, :-1], F.embedding(torch.tensor([ids[1:]]), embed))
    assert count == int(mask.sum()) == 5
    torch.testing.assert_close(loss, F.smooth_l1_loss(predicted[mask], features[:, 1:][mask]))
    kind_loss, kind_count = EAGLE.loss(head, model, batch)  # teacher features from the frozen target, cls 0.1
    p = torch.softmax(features[:, 1:][mask] @ lm_head.T, -1)
    ce = -(p * torch.log_softmax(predicted[mask] @ lm_head.T, -1)).sum(-1).mean()
    torch.testing.assert_close(kind_loss, loss + 0.1 * ce, atol=1e-5, rtol=1e-5)
    kind_loss.backward()
    assert kind_count == 5 and head.fc.weight.grad is not None
    assert all(p.grad is None for p in model.parameters())


def test_trained_head_learns_the_target_continuation(trained):
    """Trained briefly on the target's own continuations, the tree drafts them: τ well above an untrained head's
    and above 1.5 on every prompt, output unchanged. An offset error between training and drafting would leave τ
    near the untrained value."""
    model, head = trained
    target = NativeLlama.from_hf(model)
    untrained = EagleDrafter.from_module(_head(model))
    for prompt in PROMPTS:
        plain = generate(target, prompt, None, GenerationConfig(24)).token_ids
        result = generate(target, prompt, EagleDrafter.from_module(head), GenerationConfig(24, 4, speculation="fixed"))
        base = generate(target, prompt, untrained, GenerationConfig(24, 4, speculation="fixed")).stats.block_efficiency
        assert result.token_ids == plain
        assert result.stats.block_efficiency > max(1.5, base), (result.stats.block_efficiency, base)


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_greedy_equals_plain_decoding(trained, kind):
    """fp32 tiny targets, native and transformers: EAGLE output is plain greedy output token for token, with the
    trained and an untrained head, for several γ, k and tree sizes."""
    model, head = trained
    target = NativeLlama.from_hf(model) if kind == "native" else HFCausalLM(model)
    heads = [head, _head(model, seed=3)]
    for prompt in PROMPTS[:2] + [[40, 41, 42], [3] * 9]:
        plain = generate(target, prompt, None, GenerationConfig(30)).token_ids
        for h, (gamma, top_k, nodes) in zip(heads * 2, ((4, 4, 16), (2, 3, 5), (5, 1, 8), (6, 2, 30)), strict=True):
            drafter = EagleDrafter.from_module(h, top_k=top_k, tree_nodes=nodes)
            assert generate(target, prompt, drafter, GenerationConfig(30, gamma)).token_ids == plain


def test_tree_is_eagle2_shaped_and_leaves_only_committed_pairs(trained):
    """First step empty; then at most tree_nodes nodes, depth <= γ, the root's children are the head's top-k, every
    node is among its parent's top-k, and the head's cache holds exactly the committed pairs after propose."""
    model, head = trained
    target = NativeLlama.from_hf(model)
    drafter = EagleDrafter.from_module(head, top_k=3, tree_nodes=7)
    drafter.begin(target, None)
    context = torch.tensor(PROMPTS[0] + [12])
    assert len(drafter.propose(context[:-1], 3, SamplingConfig(), None)) == 0
    drafter.observe(VerifyResult(0, 0, 12, hidden=_features(model, PROMPTS[0])))
    draft = drafter.propose(context, 3, SamplingConfig(), None)
    assert len(draft) == 7 and draft.q is None and int(depths(draft.parents).max()) <= 3
    assert drafter._cache.length == drafter._fed == len(PROMPTS[0])
    embed, lm_head = target_weights(model)
    with torch.no_grad():  # teacher-forced: pairs (f_i, x_{i+1}) then the draft path's own predicted features
        features = _features(model, PROMPTS[0])[None]
        g = head(features, F.embedding(context[1:][None], embed))[0, -1]
    assert draft.tokens[draft.parents == -1].tolist() == (g @ lm_head.T).topk(3).indices.tolist()
    sampled = drafter.propose(context, 3, SamplingConfig(1.0), torch.Generator().manual_seed(0))
    assert sampled.q is not None and sampled.q.shape == (len(sampled), 64) and len(sampled) <= 7
    assert drafter._cache.length == len(PROMPTS[0])


def test_sampled_marginal_matches_the_target(trained):
    """Sampling (temperature 1): the second token, the first one the tree drafts, follows the target's exact
    marginal sum_t1 p(t1) p(t2 | t1) (chi-square), and drafts do get accepted."""
    model, head = trained
    target = NativeLlama.from_hf(model)
    prompt, sampling = PROMPTS[0], SamplingConfig(1.0)
    drafter = EagleDrafter.from_module(head, top_k=3, tree_nodes=8)
    counts, accepted = sample_second_tokens(target, prompt, drafter, sampling, trials=1000)
    assert_follows(counts, second_token_marginal(model, prompt, sampling), 1000)
    assert accepted > 100


def test_heads_folder_round_trip_and_cli_factory(trained, tmp_path):
    model, head = trained
    spec = eagle_spec(model.config, None, {})
    folder = save_heads(head, "eagle", spec, tmp_path / "heads", "tiny0")
    target = NativeLlama.from_hf(model)
    loaded = make_named("eagle", target, None, {"heads": str(folder), "top_k": "2", "tree_nodes": "6"})
    assert isinstance(loaded, EagleDrafter) and (loaded.top_k, loaded.tree_nodes) == (2, 6)
    for name, tensor in head.state_dict().items():
        torch.testing.assert_close(loaded.head.state_dict()[name], tensor)
    config = GenerationConfig(20, 4, speculation="fixed")  # accept lengths replay only at fixed γ
    same = EagleDrafter.from_module(head, top_k=2, tree_nodes=6)
    assert generate(target, PROMPTS[0], loaded, config).stats.accept_lengths == \
        generate(target, PROMPTS[0], same, config).stats.accept_lengths
    with pytest.raises(SpecdraftError, match="heads=PATH"):
        make_named("eagle", target, None, {})
    with pytest.raises(SpecdraftError, match="top_k and tree_nodes"):
        EagleDrafter(str(folder), top_k=0)


def test_bad_heads_folders_and_mismatched_targets_are_clear_errors(trained, tmp_path):
    model, head = trained
    with pytest.raises(SpecdraftError, match="not a heads folder"):
        EagleDrafter(str(tmp_path / "missing"))
    folder = save_heads(head, "eagle", eagle_spec(model.config, None, {}), tmp_path / "heads", "tiny0")
    weights = folder / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(SpecdraftError, match="corrupt heads weights"):
        EagleDrafter(str(folder))
    medusa = save_heads(torch.nn.Linear(2, 2), "medusa", {"hidden_size": 32, "vocab_size": 64}, tmp_path / "m", "t")
    with pytest.raises(SpecdraftError, match="medusa heads, not eagle"):
        EagleDrafter(str(medusa))
    wider = tiny_llama(0, hidden=48)
    drafter = EagleDrafter.from_module(head)
    with pytest.raises(SpecdraftError, match="EAGLE head mismatch"):
        generate(NativeLlama.from_hf(wider), PROMPTS[0], drafter, GenerationConfig(4))


def test_train_heads_cli_trains_and_exports_an_eagle_head(tmp_path):
    """``specdraft train-heads --kind eagle`` end to end (bf16 autocast, evaluation with τ, export), then the
    exported folder drafts through the CLI factory with output equal to plain decoding."""
    import argparse
    import csv
    import json

    from specdraft.models.registry import load_model
    from specdraft.training.commands import add_training_commands
    from toys import save_tiny_checkpoint, write_data_folder

    save_tiny_checkpoint(tmp_path / "target", seed=0, layers=1, hidden=32)
    target = load_model(str(tmp_path / "target"))
    records = [{"prompt_id": n, "prompt_token_ids": p, "response_token_ids": generate(
        target, p, None, GenerationConfig(16)).token_ids} for n, p in enumerate([[5 + n, 9, 3 + n] for n in range(8)])]
    write_data_folder(tmp_path / "data", records)
    parser = argparse.ArgumentParser(prog="specdraft")
    add_training_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([str(a) for a in (
        "train-heads", "--kind", "eagle", "--target", tmp_path / "target", "--data", tmp_path / "data", "--out",
        tmp_path / "run", "--steps", 12, "--batch-size", 4, "--lr", 1e-2, "--no-progress", "--heldout-every", 4,
        "--eval-prompts", 2, "--eval-max-new-tokens", 8, "--options", "cls_weight=0.2;noise=0.05")])
    args.run(args)
    meta = json.loads((tmp_path / "run" / "heads" / "heads.json").read_text())
    assert meta["kind"] == "eagle" and meta["spec"]["cls_weight"] == 0.2 and meta["spec"]["hidden_size"] == 32
    with open(tmp_path / "run" / "eval_log.csv") as handle:
        row = list(csv.DictReader(handle))[-1]
    assert {"heldout_loss", "heldout_smooth_l1", "heldout_top1", "block_efficiency@4"} <= set(row)
    drafter = make_named("eagle", target, None, {"heads": str(tmp_path / "run" / "heads")})
    prompt = records[0]["prompt_token_ids"]
    assert generate(target, prompt, drafter, GenerationConfig(16, 4)).token_ids == records[0]["response_token_ids"]
