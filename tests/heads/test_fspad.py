"""FSPAD's training options (Gui et al. 2024, arXiv 2408.15562) on the EAGLE and EAGLE-3 heads: feature sampling
starts as the identity, then conditions the features on the next token and reaches the head's input on every path
(forward, training unroll, drafting); partial alignment regresses only the first ceil(R*D) feature coordinates (hand
computed) and, for EAGLE-3, adds a weighted term to the TTT loss; options are checked; drafting stays lossless."""

import pytest
import torch
import torch.nn.functional as F

from specdraft.decoding import generate
from specdraft.drafters.eagle import EagleDrafter
from specdraft.errors import SpecdraftError
from specdraft.export.eagle3 import eagle3_tensors
from specdraft.heads.eagle import build_eagle, eagle_loss, eagle_spec, num_parameters
from specdraft.heads.eagle3 import build_eagle3
from specdraft.heads.fspad import aligned_width, parse_fspad, partial_smooth_l1
from specdraft.models.native_llama import NativeLlama
from specdraft.models.shared_embeddings import target_weights
from specdraft.sequence import GenerationConfig
from specdraft.training.data.batches import collate_distill
from specdraft.training.heads.eagle3 import EAGLE3, parse_settings, unrolled
from toys import tiny_llama

PROMPTS = [[5, 9, 3, 17, 9, 3, 22, 40], [7, 7, 31, 12]]


def _eagle(model, seed: int = 0, **options):
    torch.manual_seed(seed)
    return build_eagle(eagle_spec(model.config, None, {k: str(v) for k, v in options.items()}))


def _eagle3(model, seed: int = 0, **options):
    from specdraft.heads.eagle import head_config

    torch.manual_seed(seed)
    settings = parse_settings({k: str(v) for k, v in ({"draft_vocab": 64} | options).items()},
                              model.config.num_hidden_layers, model.config.vocab_size)
    head = build_eagle3(head_config(model.config) | settings, torch.arange(model.config.vocab_size))
    EAGLE3.init(head, model)
    return head


def _batch(model):
    target = NativeLlama.from_hf(model)
    items = [{"ids": torch.tensor(p + generate(target, p, None, GenerationConfig(8)).token_ids), "prompt_len": len(p)}
             for p in PROMPTS]
    return collate_distill(items, pad_id=0)


def _perturb(sampling) -> None:
    with torch.no_grad():
        sampling.down.weight.normal_(0.0, 0.5)


def test_options_are_checked_and_stored():
    model = tiny_llama(0)
    assert parse_fspad({}, "eagle") == {"fspad_sampling": 0, "partial_alignment": 0.0}
    for bad in ({"fspad_sampling": "-1"}, {"fspad_sampling": "x"}, {"partial_alignment": "1.5"}):
        with pytest.raises(SpecdraftError, match=r"fspad_sampling|partial_alignment"):
            parse_fspad(bad, "eagle")
    with pytest.raises(SpecdraftError, match="align_weight"):
        parse_settings({"align_weight": "-1"}, 2, 64)
    plain, sampled = _eagle(model), _eagle(model, fspad_sampling=2)
    assert plain.sampling is None and sampled.sampling.up.weight.shape == (64, 32)
    assert num_parameters(sampled) - num_parameters(plain) == 3 * 2 * 32 * 32  # W_up, W_gate, W_down
    assert sampled.loss_settings["partial_alignment"] == 0.0
    assert _eagle(model, partial_alignment=0.25).loss_settings["partial_alignment"] == 0.25
    assert [aligned_width(32, r) for r in (0, 0.25, 0.3, 1)] == [32, 8, 10, 32]


def test_feature_sampling_starts_as_identity_then_reads_the_next_token():
    """W_down = 0 at the start: the head computes exactly what the plain head computes; once trained, the features
    it reads depend on the next token (the gate), so two pairs with one feature and different tokens differ."""
    model = tiny_llama(0)
    head = _eagle(model, fspad_sampling=2).eval()
    features, embeds = torch.randn(1, 5, 32), torch.randn(1, 5, 32)
    with torch.no_grad():
        sampled = head(features, embeds)
        sampling, head.sampling = head.sampling, None
        torch.testing.assert_close(sampled, head(features, embeds))
        head.sampling = sampling
        _perturb(sampling)
        changed = head(features, embeds)
        assert (changed - sampled).abs().max() > 1e-3
        f = features[:, :1]
        a, b = sampling(f, embeds[:, :1]), sampling(f, embeds[:, 1:2])
        assert (a - b).abs().max() > 1e-3
        manual = f + sampling.down(sampling.up(f) * torch.sigmoid(sampling.gate(embeds[:, :1])))
        torch.testing.assert_close(a, manual)


def test_partial_alignment_regresses_the_first_coordinates_only():
    """eagle_loss with cls_weight 0 is smooth L1 over the first ceil(R*D) coordinates of the head's output against
    the next feature (hand computed), differs from full alignment, and gives no gradient to the other coordinates."""
    model = tiny_llama(0).requires_grad_(False)
    head = _eagle(model, seed=1)
    embed, lm_head = target_weights(model)
    tokens = torch.tensor([[5, 9, 3, 17, 9, 3]])
    with torch.no_grad():
        features = model(tokens, output_hidden_states=True).hidden_states[-1]  # (1, 6, D)
    mask = torch.ones(1, 5, dtype=torch.bool)
    predicted = head(features[:, :-1], F.embedding(tokens[:, 1:], embed))  # (1, 5, D)
    truth = features[:, 1:]
    partial, _ = eagle_loss(head, features, tokens, mask, embed, lm_head, cls_weight=0.0, partial_alignment=0.25)
    full, _ = eagle_loss(head, features, tokens, mask, embed, lm_head, cls_weight=0.0)
    torch.testing.assert_close(partial, F.smooth_l1_loss(predicted[0, :, :8], truth[0, :, :8]))
    torch.testing.assert_close(full, F.smooth_l1_loss(predicted[0], truth[0]))
    assert abs(float(partial.detach()) - float(full.detach())) > 1e-4
    out = predicted.detach().requires_grad_(True)
    partial_smooth_l1(out, truth, 0.25).backward()
    assert out.grad[..., 8:].abs().sum() == 0 and out.grad[..., :8].abs().sum() > 0


def test_eagle3_alignment_term_and_sampled_unroll():
    """EAGLE-3 with partial_alignment R: the loss is the TTT loss plus align_weight times the partial smooth L1 of
    step 0's outputs against the next fused features; align_weight 0 gives the plain loss. Feature sampling reaches
    the unroll: perturbing W_down changes step 0's outputs."""
    model = tiny_llama(0, layers=4).requires_grad_(False)
    batch = _batch(model)
    plain = _eagle3(model, ttt_steps=2)
    aligned = _eagle3(model, ttt_steps=2, partial_alignment=0.5, align_weight=2)
    zero = _eagle3(model, ttt_steps=2, partial_alignment=0.5, align_weight=0)
    base, count = EAGLE3.loss(plain, model, batch)
    torch.testing.assert_close(EAGLE3.loss(zero, model, batch)[0], base)
    _, _, _, _, (outputs, truth) = unrolled(aligned, model, batch, 2, align=True)
    expected = base + 2 * F.smooth_l1_loss(outputs[:, :16].float(), truth[:, :16].float())
    torch.testing.assert_close(EAGLE3.loss(aligned, model, batch)[0], expected)
    assert count == int(batch["mask"].sum()) and float(expected - base) > 1e-5
    sampled = _eagle3(model, ttt_steps=2, fspad_sampling=1)
    first = unrolled(sampled, model, batch, 2)[1][0].detach()
    _perturb(sampled.sampling)
    assert (unrolled(sampled, model, batch, 2)[1][0] - first).abs().max() > 1e-3
    with pytest.raises(SpecdraftError, match="fspad_sampling"):
        eagle3_tensors(sampled, torch.float32)


def test_drafting_with_sampled_features_equals_plain_decoding():
    """A head with perturbed feature sampling drafts through it (its drafts change) and stays lossless."""
    model = tiny_llama(0)
    target = NativeLlama.from_hf(model)
    head = _eagle(model, fspad_sampling=2).eval()
    _perturb(head.sampling)
    for prompt in PROMPTS + [[40, 41, 42]]:
        plain = generate(target, prompt, None, GenerationConfig(24)).token_ids
        for gamma, top_k, nodes in ((4, 4, 16), (3, 1, 3)):
            drafter = EagleDrafter.from_module(head, top_k=top_k, tree_nodes=nodes)
            assert generate(target, prompt, drafter, GenerationConfig(24, gamma)).token_ids == plain
