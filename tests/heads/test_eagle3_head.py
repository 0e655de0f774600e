"""EAGLE-3 head (Li et al. 2025, arXiv 2503.01840): the target's aux features on both model paths, the
training-time-test unroll against step-by-step drafting on the cache, the losses, learning on a toy target,
greedy equality with plain decoding (chain and tree, native and transformers), the sampled marginal, the heads
folder and its errors."""

import pytest
import torch

from specdraft.batching import generate_batch
from specdraft.decoding import generate
from specdraft.drafters import NAMED_DRAFTERS
from specdraft.drafters.eagle3 import Eagle3Drafter, int8_head
from specdraft.drafters.registry import make_named
from specdraft.errors import SpecdraftError
from specdraft.heads import load_heads, save_heads
from specdraft.heads.eagle import head_config
from specdraft.heads.eagle3 import build_eagle3, default_aux_layers
from specdraft.models import quantized
from specdraft.models.hf import HFCausalLM
from specdraft.models.native_llama import NativeLlama
from specdraft.sampling import SamplingConfig
from specdraft.sequence import GenerationConfig
from specdraft.training.data.batches import collate_distill
from specdraft.training.heads.eagle3 import EAGLE3, parse_settings, unrolled
from specdraft.training.heads.train_heads import HEAD_KINDS
from toys import assert_follows, sample_second_tokens, second_token_marginal, tiny_llama

PROMPTS = [[5, 9, 3, 17, 9, 3, 22, 40], [7, 7, 31, 12], [50, 4, 18, 18, 33, 2, 61], [11, 23]]
LAYERS = 4


def _head(model, seed: int = 0, draft_vocab: int = 48, **options):
    """A head over the ``draft_vocab`` lowest token ids (tokens 3.. the toys' words, plus a few)."""
    torch.manual_seed(seed)
    settings = parse_settings({k: str(v) for k, v in ({"draft_vocab": draft_vocab} | options).items()},
                              model.config.num_hidden_layers, model.config.vocab_size)
    head = build_eagle3(head_config(model.config) | settings, torch.arange(model.config.vocab_size)[-draft_vocab:])
    EAGLE3.init(head, model)
    return head


def test_aux_features_native_and_hf_match():
    """Both model paths return the residual stream entering the asked layers, concatenated, equal to
    transformers' hidden_states[i]; the default layers are [2, n // 2, n - 3] on deep targets."""
    model = tiny_llama(0, layers=LAYERS)
    ids = torch.tensor([[5, 9, 3, 17, 9]])
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    expected = torch.cat([states[0], states[2], states[3]], dim=-1)  # (1, 5, 3D)
    for target in (NativeLlama.from_hf(model), HFCausalLM(model)):
        logits, aux = target.forward(ids, target.new_cache(16), return_hidden=True, hidden_layers=(0, 2, 3))
        torch.testing.assert_close(aux, expected, atol=1e-5, rtol=1e-5)
        assert logits.shape == (1, 5, 64)
    assert default_aux_layers(30) == [2, 15, 27] and default_aux_layers(LAYERS) == [0, 2, 3]


def test_unroll_equals_drafting_on_the_cache():
    """Step i of the training-time test at position t is the draft node i levels below root t: feeding the
    committed pairs on the cache, then each node alone (its ancestors and the context visible, at position t + i),
    gives the unroll's outputs exactly. A wrong TTT mask or position breaks this."""
    model = tiny_llama(0, layers=LAYERS)
    head = _head(model).eval()
    aux, steps = torch.randn(1, 7, 3 * 32), 3
    embeds = [torch.randn(1, 7, 32) for _ in range(steps)]
    with torch.no_grad():
        outputs = head.unroll(aux, embeds)  # steps x (1, 7, D)
        for t in (0, 3, 6):
            cache = head.new_cache(32)
            root = head(head.fuse(aux[:, : t + 1]), embeds[0][:, : t + 1], cache)[:, -1:]  # (1, 1, D)
            torch.testing.assert_close(root, outputs[0][:, t : t + 1], atol=1e-5, rtol=1e-5)
            feature = root
            for i in range(1, steps):
                mask = torch.ones(1, cache.length + 1, dtype=torch.bool)  # the context and the ancestors
                mask[0, : t + 1] = True
                feature = head(feature, embeds[i][:, t : t + 1], cache, torch.tensor([t + i]), mask)
                torch.testing.assert_close(feature, outputs[i][:, t : t + 1], atol=1e-5, rtol=1e-5)


def test_options_registry_and_parameters():
    model = tiny_llama(0, layers=LAYERS)
    head = _head(model)
    assert HEAD_KINDS["eagle3"] is EAGLE3 and NAMED_DRAFTERS["eagle3"]
    assert head.fc.weight.shape == (32, 96) and head.fc.bias is None
    assert head.layer.qkv_weight.shape == ((4 + 2 * 2) * 8, 64)  # q, k, v read [embeds; features]
    assert head.lm_head.weight.shape == (48, 32) and head.d2t.shape == (48,) and head.t2d.sum() == 48
    assert torch.equal(head.draft_token_ids, torch.arange(16, 64))
    assert not any("embed" in k or "rope" in k for k in head.state_dict())
    with pytest.raises(SpecdraftError, match="unknown eagle3 option"):
        parse_settings({"steps": "3"}, LAYERS, 64)
    with pytest.raises(SpecdraftError, match="aux_layers"):
        parse_settings({"aux_layers": "3,1"}, LAYERS, 64)
    with pytest.raises(SpecdraftError, match="loss must be"):
        parse_settings({"loss": "ce"}, LAYERS, 64)


def _batch(model, prompts, new_tokens: int = 24):
    target = NativeLlama.from_hf(model)
    items = [{"ids": torch.tensor(p + generate(target, p, None, GenerationConfig(new_tokens)).token_ids),
              "prompt_len": len(p)} for p in prompts]
    return collate_distill(items, pad_id=0)


def test_losses_and_metrics_on_the_unroll():
    """Each loss gives a finite value and gradients to the head only; the step-0 count is the response pairs whose
    target argmax is draftable (fkl); metrics give per-step agreement and τ estimates in range."""
    model = tiny_llama(0, layers=LAYERS).requires_grad_(False)
    batch = _batch(model, PROMPTS[:2], 8)
    for loss in ("fkl", "tvd", "tvdpp"):
        head = _head(model, loss=loss, ttt_steps=3, draft_vocab=64)
        value, count = EAGLE3.loss(head, model, batch)
        value.backward()
        assert torch.isfinite(value) and count == int(batch["mask"].sum()) and value > 0
        assert head.fc.weight.grad is not None and all(p.grad is None for p in model.parameters())
    masks, draft, target, greedy, _ = unrolled(head, model, batch, 3, greedy=True)
    counts = [int(batch["mask"][:, i:].sum()) for i in range(3)]
    assert [int(m.sum()) for m in masks] == counts and [d.shape[0] for d in draft] == counts
    assert draft[2].shape == target[2].shape == (counts[2], 64) and greedy[1].shape == (counts[1],)
    first = int(batch["mask"][0].sum())  # response pairs of the first sequence
    assert first > 3 and int(masks[0][0].nonzero()[0]) == int(masks[2][0].nonzero()[0]) + 2
    # step i's rows start i pairs earlier and predict the same response tokens, row for row
    assert torch.equal(greedy[1][:first], greedy[0][:first])
    torch.testing.assert_close(target[2][:first], target[0][:first])
    metrics = EAGLE3.metrics(head.eval(), model, batch)
    assert set(metrics) >= {"heldout_loss", "heldout_top1_step0", "heldout_top1_step2", "greedy_tau@3"}
    total, count = metrics["greedy_tau@3"]
    assert 1.0 <= total / count <= 4.0


def _train(model, prompts, steps: int = 150, **options):
    batch = _batch(model, prompts)
    head = _head(model, draft_vocab=64, **options)
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(steps):
        loss, _ = EAGLE3.loss(head, model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval()


@pytest.fixture(scope="module")
def trained():
    model = tiny_llama(0, layers=LAYERS).requires_grad_(False)
    return model, _train(model, PROMPTS, ttt_steps=3)


def test_trained_head_drafts_the_continuation(trained):
    """Trained on the target's own continuations, the chain (top_k 1) and the tree reach τ well above an untrained
    head's; the output is plain greedy decoding's."""
    model, head = trained
    target = NativeLlama.from_hf(model)
    for prompt in PROMPTS:
        plain = generate(target, prompt, None, GenerationConfig(24)).token_ids
        base = generate(target, prompt, Eagle3Drafter.from_module(_head(model, draft_vocab=64)),
                        GenerationConfig(24, 4, speculation="fixed")).stats.block_efficiency
        for drafter in (Eagle3Drafter.from_module(head, top_k=1, tree_nodes=4), Eagle3Drafter.from_module(head)):
            result = generate(target, prompt, drafter, GenerationConfig(24, 4, speculation="fixed"))
            assert result.token_ids == plain
            assert result.stats.block_efficiency > max(1.5, base), (result.stats.block_efficiency, base)


def test_trained_head_greedy_tau_equals_decoded_tau(trained):
    """On the target's own continuations the held-out greedy τ replayed from the unroll is the τ greedy chain
    decoding measures: the same new tokens in the same target forwards (the first step drafting nothing)."""
    model, head = trained
    target = NativeLlama.from_hf(model)
    metrics = EAGLE3.metrics(head, model, _batch(model, PROMPTS))
    tokens = forwards = 0
    for prompt in PROMPTS:
        drafter = Eagle3Drafter.from_module(head, top_k=1, tree_nodes=3)
        stats = generate(target, prompt, drafter, GenerationConfig(24, 3, speculation="fixed")).stats
        tokens, forwards = tokens + stats.new_tokens, forwards + stats.target_forward_calls
    assert metrics["greedy_tau@3"] == (float(tokens), forwards) and tokens / forwards > 2
    first, steps = metrics["greedy_first_accept@3"]
    assert steps == forwards and 0 < first < steps


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_greedy_equals_plain_decoding(trained, kind):
    """fp32: EAGLE-3 output is plain greedy output token for token, trained or not, chain or tree, several γ."""
    model, head = trained
    target = NativeLlama.from_hf(model) if kind == "native" else HFCausalLM(model)
    for prompt in PROMPTS:
        plain = generate(target, prompt, None, GenerationConfig(20)).token_ids
        for module in (head, _head(model, seed=3)):
            for gamma, top_k, nodes in ((1, 1, 1), (3, 1, 3), (4, 4, 16), (5, 2, 6)):
                drafter = Eagle3Drafter.from_module(module, top_k=top_k, tree_nodes=nodes)
                assert generate(target, prompt, drafter, GenerationConfig(20, gamma)).token_ids == plain


def test_int8_heads_draft_losslessly_and_track_the_dense_head(trained):
    """The int8 copy (Q8_0 fc, midlayer and LM head) keeps plain greedy output, chain and tree, and its first draft
    step's logits stay close to the dense head's (Q8_0 rounding only); the dense head is left as it was."""
    if not quantized.available():
        pytest.skip("specdraft's int8 kernels cannot run here")
    model, head = trained
    target = NativeLlama.from_hf(model)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    for prompt in PROMPTS:
        plain = generate(target, prompt, None, GenerationConfig(20)).token_ids
        for gamma, top_k, nodes in ((1, 1, 1), (3, 1, 3), (4, 4, 16)):
            drafter = Eagle3Drafter.from_module(head, top_k=top_k, tree_nodes=nodes, quantize="int8")
            assert generate(target, prompt, drafter, GenerationConfig(20, gamma)).token_ids == plain
            assert drafter.head is not head and isinstance(drafter.head.lm_head, quantized.Int8Linear)
    assert all(torch.equal(before[k], v) for k, v in head.state_dict().items())
    features = torch.randn(3, head.fc.weight.shape[1])
    dense = head.logits(head.fuse(features))  # (3, N)
    int8 = int8_head(head).logits(int8_head(head).fuse(features))
    assert (dense - int8).abs().max() < 0.02 * dense.abs().max()


def test_sampled_second_token_follows_the_target(trained):
    """Temperature sampling through the tree: the second token's law is the target's exact marginal (chi-square)."""
    model, head = trained
    target = NativeLlama.from_hf(model)
    sampling = SamplingConfig(temperature=1.0)
    p = second_token_marginal(model, PROMPTS[1], sampling)
    counts, accepted = sample_second_tokens(target, PROMPTS[1], Eagle3Drafter.from_module(head, top_k=2,
                                                                                        tree_nodes=4), sampling, 600)
    assert_follows(counts, p, 600)
    assert accepted > 0


def test_heads_saved_in_bfloat16_keep_the_draft_vocabulary_exact(tmp_path):
    """bf16 heads folders cast the floating weights only: d2t (offsets up to the vocabulary size, far beyond bf16's
    exact integers) and t2d load back unchanged."""
    from safetensors.torch import load_file

    config = tiny_llama(0, layers=LAYERS).config
    spec = head_config(config) | parse_settings({"draft_vocab": "100"}, LAYERS, 1000) | {"vocab_size": 1000}
    head = build_eagle3(spec, torch.arange(100) * 9 + 7)
    save_heads(head, "eagle3", spec, tmp_path / "h", "tiny", dtype=torch.bfloat16)
    tensors = load_file(str(tmp_path / "h" / "heads.safetensors"))
    assert (tensors["d2t"].dtype, tensors["t2d"].dtype, tensors["fc.weight"].dtype) == (
        torch.int64, torch.bool, torch.bfloat16)
    _, loaded = load_heads(tmp_path / "h", kind="eagle3")
    assert torch.equal(loaded.draft_token_ids, torch.arange(100) * 9 + 7) and torch.equal(loaded.t2d, head.t2d)


def test_heads_folder_round_trip_and_errors(trained, tmp_path):
    model, head = trained
    spec = head_config(model.config) | parse_settings({"draft_vocab": "64", "ttt_steps": "3"}, LAYERS, 64)
    save_heads(head, "eagle3", spec, tmp_path / "h", "tiny")
    _, loaded = load_heads(tmp_path / "h", kind="eagle3")
    assert torch.equal(loaded.d2t, head.d2t) and loaded.aux_layers == [0, 2, 3]
    target = NativeLlama.from_hf(model)
    via_cli = make_named("eagle3", target, None, {"heads": str(tmp_path / "h"), "top_k": "1"})
    direct = Eagle3Drafter.from_module(head, top_k=1)
    for drafter in (via_cli, direct):
        result = generate(target, PROMPTS[0], drafter, GenerationConfig(16, 3))
        assert result.token_ids == generate(target, PROMPTS[0], None, GenerationConfig(16)).token_ids
    with pytest.raises(SpecdraftError, match="needs --drafter-option heads"):
        make_named("eagle3", target, None, {})
    shallow = NativeLlama.from_hf(tiny_llama(1, layers=2))
    with pytest.raises(SpecdraftError, match="reads target layers"):
        generate(shallow, PROMPTS[0], direct, GenerationConfig(4, 3))


@pytest.mark.slow
def test_smollm2_fp32_greedy_equals_plain_decoding():
    """The real target in fp32 with a head on its aux layers [2, 15, 27] (the shipped one if there is one, else
    an initialised one): chain and tree output are plain greedy decoding's on built-in prompts."""
    from specdraft.models.registry import SHIPPED_HEADS, SMOLLM2, eos_token_ids, load_model, load_tokenizer
    from specdraft.prompts import BUILTIN_PROMPTS, encode_prompt

    target, tokenizer = load_model(SMOLLM2, torch.float32), load_tokenizer(SMOLLM2)
    if "smollm2-135m-instruct-eagle3" in SHIPPED_HEADS:
        _, head = load_heads("smollm2-135m-instruct-eagle3", kind="eagle3")
    else:
        head = _head(load_model(SMOLLM2, torch.float32, backend="hf").model, draft_vocab=8192)
    assert head.aux_layers == [2, 15, 27]
    config = GenerationConfig(32, 4, eos_token_ids=eos_token_ids(tokenizer, SMOLLM2))
    for prompt in BUILTIN_PROMPTS[::3]:
        ids = encode_prompt(tokenizer, prompt.text, chat=True)
        plain = generate(target, ids, None, config).token_ids
        for drafter in (Eagle3Drafter.from_module(head, top_k=1), Eagle3Drafter.from_module(head, top_k=4)):
            assert generate(target, ids, drafter, config).token_ids == plain, prompt.category


def test_batched_rows_draft_as_batch_one(trained):
    """Batched decoding hands each row's EAGLE-3 drafter the residual stream entering its three layers, as batch-1
    decoding does: every row's output and accepted lengths equal batch-1's (with the final-normed states instead,
    the drafts, and so the accepted lengths, differ)."""
    model, head = trained
    target = NativeLlama.from_hf(model)
    config = GenerationConfig(24, 4, speculation="fixed")
    alone = [generate(target, prompt, Eagle3Drafter.from_module(head, top_k=1, tree_nodes=4), config)
             for prompt in PROMPTS]
    batched = generate_batch(target, PROMPTS, lambda: Eagle3Drafter.from_module(head, top_k=1, tree_nodes=4), config)
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    assert [r.stats.accept_lengths for r in batched] == [r.stats.accept_lengths for r in alone]
    assert max(r.stats.block_efficiency for r in batched) > 1.5
