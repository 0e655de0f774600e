"""GliDe with CaPE (Du et al. 2024, arXiv 2402.02082): the cross-attention over the target's cache, the training
unroll against drafting on the cache, learning on a toy target with the exact held-out τ equal to decoded τ, greedy
equality with plain decoding on the native, transformers and quantized paths, the sampled marginal, CaPE's
candidates, the capability that hands the drafter the target's cache, and the heads folder."""

import copy

import pytest
import torch
import torch.nn.functional as F

from specdraft.batching import generate_batch
from specdraft.decoding import generate
from specdraft.drafters.base import ReadsTargetCache, share_target_cache
from specdraft.drafters.draft_model import MODEL, SIBLING
from specdraft.drafters.glide import GlideDrafter, extra_candidates, parse_thresholds
from specdraft.drafters.registry import make_named
from specdraft.errors import SpecdraftError
from specdraft.heads import load_heads, save_heads
from specdraft.heads.glide import build_glide, cross_attention, glide_spec, num_parameters, unroll
from specdraft.models import rowgemm
from specdraft.models.base import ReadableKVCache
from specdraft.models.hf import HFCausalLM
from specdraft.models.native_llama import NativeLlama
from specdraft.sampling import SamplingConfig
from specdraft.sequence import GenerationConfig
from specdraft.training.data.batches import collate_distill
from specdraft.training.heads.glide import GLIDE
from specdraft.training.heads.train_heads import HEAD_KINDS
from specdraft.trees import depths
from toys import assert_follows, sample_second_tokens, second_token_marginal, tiny_llama

PROMPTS = [[5, 9, 3, 17, 9, 3, 22, 40], [7, 7, 31, 12], [50, 4, 18, 18, 33, 2, 61], [11, 23]]


def _head(model, seed: int = 0, **options):
    torch.manual_seed(seed)
    head = build_glide(glide_spec(model.config, {k: str(v) for k, v in options.items()}))
    GLIDE.init(head, model)
    return head


def _batch(model, prompts, new_tokens: int = 24):
    """The target's own greedy continuations of ``prompts``, collated as train-heads collates them."""
    target = NativeLlama.from_hf(model)
    items = [{"ids": torch.tensor(p + generate(target, p, None, GenerationConfig(new_tokens)).token_ids),
              "prompt_len": len(p)} for p in prompts]
    return collate_distill(items, pad_id=0)


@pytest.fixture(scope="module")
def trained():
    model = tiny_llama(0).requires_grad_(False)
    batch = _batch(model, PROMPTS)
    head = _head(model, ttt_steps=3)
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(120):
        loss, _ = GLIDE.loss(head, model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, head.eval(), batch


def test_sizes_options_and_registry():
    model = tiny_llama(0)
    head = _head(model, layers=2, glimpse_layer=0)
    d, hd, ffn = 32, 8, 64
    block = (4 + 2 * 2) * hd * d + 4 * hd * d + 3 * d * ffn + 3 * d + 2 * 4 * hd * d  # self, MLP, norms, cross q/o
    assert num_parameters(head) == 2 * block + d
    assert not any("embed" in k or "lm_head" in k for k in head.state_dict())  # the target's stay out
    assert head.glimpse_layer == 0 and head.train_settings == {"ttt_steps": 3, "decay": 0.8}
    assert _head(model).glimpse_layer == 1  # default: the target's last layer
    assert HEAD_KINDS["glide"] is GLIDE
    for bad, message in (({"layers": "0"}, "layers >= 1"), ({"glimpse_layer": "2"}, "glimpse_layer"),
                         ({"heads": "3"}, "unknown glide option heads"), ({"decay": "x"}, "decay a number")):
        with pytest.raises(SpecdraftError, match=message):
            glide_spec(model.config, bad)


def test_cross_attention_hand_checked():
    """One query head over one cached head: softmax(q.k / sqrt(hd)) v over the visible positions only, zero when
    nothing is visible (the first position has nothing to read)."""
    queries = torch.tensor([[[[1.0, 0.0]], [[0.0, 2.0]], [[1.0, 1.0]]]])  # (1, 3, 1, 2)
    keys = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])  # (1, 1, 2, 2)
    values = torch.tensor([[[[10.0, 0.0], [0.0, 10.0]]]])
    visible = torch.tensor([[False, False], [True, False], [True, True]])
    out = cross_attention(queries, keys, values, visible)  # (1, 3, 2)
    w = torch.softmax(torch.tensor([1.0, 1.0]) / 2**0.5, 0)
    torch.testing.assert_close(out[0], torch.tensor([[0.0, 0.0], [10.0, 0.0], [10 * w[0], 10 * w[1]]]))
    assert cross_attention(queries, keys[:, :, :0], values[:, :, :0], visible[:, :0]).abs().sum() == 0


def test_unroll_equals_drafting_on_the_cache():
    """Depth i+1 from root t in the training unroll is what the drafter computes: the context up to t fed on the
    cache (each token reading the target's keys before it), then the chain's tokens one by one reading the keys
    before t. A wrong glimpse mask, position or self-attention mask breaks this."""
    model = tiny_llama(0)
    head = _head(model, seed=1).eval()
    ids = torch.tensor([[5, 9, 3, 17, 9, 3, 22, 40, 11]])
    with torch.no_grad():
        out = model.model(input_ids=ids, use_cache=True)
        kv = (out.past_key_values.layers[1].keys, out.past_key_values.layers[1].values)  # (1, K, 9, hd) each
        embeds = F.embedding(ids, model.get_input_embeddings().weight)
        steps = unroll(head, embeds, kv, 3)  # 3 x (1, 9, D)
        for root in (0, 3, 5):
            cache = head.new_cache(16)
            positions = torch.arange(root + 1)
            visible = torch.arange(9)[None, :] < positions[:, None]
            hidden = [head(embeds[:, : root + 1], kv, visible, cache)[0, -1]]
            for depth in (1, 2):  # the chain's tokens are the text's (teacher-forced)
                node = embeds[:, root + depth : root + depth + 1]
                hidden.append(head(node, kv, torch.arange(9)[None, :] < root, cache)[0, -1])
            for depth, h in enumerate(hidden):
                torch.testing.assert_close(h, steps[depth][0, root], atol=1e-5, rtol=1e-5)


def test_trained_head_exact_tau_equals_decoded_tau(trained):
    """Trained on the target's own continuations, the held-out exact τ (from the unroll) equals the τ greedy chain
    decoding measures at every γ, and is well above an untrained head's; output is plain decoding's."""
    model, head, batch = trained
    target = NativeLlama.from_hf(model)
    metrics = GLIDE.metrics(head, model, batch)
    untrained = GLIDE.metrics(_head(model, seed=5).eval(), model, batch)
    for gamma in (1, 2, 3, 4):
        tokens = forwards = 0
        for prompt in PROMPTS:
            result = generate(target, prompt, GlideDrafter.from_module(head, cape=""),
                              GenerationConfig(24, gamma, speculation="fixed"))
            assert result.token_ids == generate(target, prompt, None, GenerationConfig(24)).token_ids
            tokens, forwards = tokens + result.stats.new_tokens, forwards + result.stats.target_forward_calls
        assert metrics[f"greedy_tau@{gamma}"] == (float(tokens), forwards)
    exact, base = metrics["greedy_tau@4"], untrained["greedy_tau@4"]
    assert exact[0] / exact[1] > max(2.5, base[0] / base[1] + 1)
    assert metrics["heldout_top1_depth1"][0] / metrics["heldout_top1_depth1"][1] > 0.8


def _quantized(model):
    from specdraft.models.quantized_llama import QuantizedLlama

    return QuantizedLlama.from_dense(NativeLlama.from_hf(model), "int8")


@pytest.mark.parametrize("kind", ["native", "hf", "quantized"])
def test_greedy_equals_plain_decoding(trained, kind):
    """fp32 targets (the quantized path's float16 cache is read widened): output is plain greedy output token for
    token, for several γ, CaPE settings and node caps, with the trained and an untrained head."""
    if kind == "quantized" and not rowgemm.available():
        pytest.skip("no kernels for the quantized path on this machine")
    model, head, _ = trained
    target = {"native": NativeLlama.from_hf, "hf": HFCausalLM, "quantized": _quantized}[kind](model)
    heads = [head, _head(model, seed=3).eval()]
    for prompt in PROMPTS[:2] + [[40], [3] * 9]:
        plain = generate(target, prompt, None, GenerationConfig(30)).token_ids
        for h, (gamma, cape, nodes) in zip(heads * 2, ((4, "0.6/0.3", 16), (2, "", 2), (5, "0.99/0.9/0.5", 8),
                                                       (6, "0.9", 30)), strict=True):
            drafter = GlideDrafter.from_module(h, cape=cape, max_nodes=nodes)
            assert generate(target, prompt, drafter, GenerationConfig(30, gamma)).token_ids == plain


def test_bfloat16_target_reads_its_cache(trained):
    """A dense bf16 target caches bf16 keys and values: the head runs in bf16 and reads them; drafts are accepted."""
    model, head, _ = trained
    target = NativeLlama.from_hf(model, dtype=torch.bfloat16)
    drafter = GlideDrafter.from_module(copy.deepcopy(head))
    result = generate(target, PROMPTS[0], drafter, GenerationConfig(24, 4, speculation="fixed"))
    assert drafter.head.dtype == torch.bfloat16 and result.stats.block_efficiency > 1.5


def test_cape_adds_candidates_where_the_draft_is_unsure(trained):
    """CaPE: a depth gets one candidate per threshold above its confidence, as leaves beside the chain token (the
    chain's runners-up, never equal to it), confidence and source per node, at most max_nodes nodes; the draft's
    cache keeps only the committed tokens."""
    model, head, _ = trained
    assert parse_thresholds("0.6/0.3") == parse_thresholds("0.6,0.3") == (0.6, 0.3) and parse_thresholds("") == ()
    assert [extra_candidates(c, (0.6, 0.3)) for c in (0.9, 0.6, 0.5, 0.1)] == [0, 0, 1, 2]
    for bad in ("0.3/0.6", "1.5", "x"):
        with pytest.raises(SpecdraftError, match="decreasing thresholds"):
            parse_thresholds(bad)
    target = NativeLlama.from_hf(model)
    context = torch.tensor(PROMPTS[1])
    drafter = GlideDrafter.from_module(head, cape="0.999/0.99/0.9")  # every depth below 0.999: at least one extra
    cache = target.new_cache(64)
    target.forward(context[None, :-1], cache)
    drafter.begin(target, cache)
    drafter.read_target_cache(cache)
    draft = drafter.propose(context, 4, SamplingConfig(), None)
    chain = draft.source == MODEL
    assert int(chain.sum()) == 4 and draft.q is None and int(depths(draft.parents).max()) == 4
    for node in (~chain).nonzero().flatten().tolist():
        parent = int(draft.parents[node])
        sibling = int(((draft.parents == parent) & chain).nonzero()[0])  # the chain token at that depth
        assert draft.tokens[node] != draft.tokens[sibling] and draft.confidence[node] <= draft.confidence[sibling]
        assert extra_candidates(float(draft.confidence[sibling]), drafter.thresholds) >= 1
    assert int((draft.source == SIBLING).sum()) == len(draft) - 4 >= 4
    assert drafter._cache.length == len(context)
    capped = GlideDrafter.from_module(head, cape="0.999/0.99/0.9", max_nodes=5)
    capped.begin(target, cache)
    capped.read_target_cache(cache)
    assert len(capped.propose(context, 4, SamplingConfig(), None)) == 5
    plain = GlideDrafter.from_module(head, cape="")
    plain.begin(target, cache)
    plain.read_target_cache(cache)
    assert plain.propose(context, 4, SamplingConfig(), None).parents is None  # no candidates: a chain


def test_sampled_marginal_matches_the_target(trained):
    """Sampling (temperature 1): point-mass candidates keep the output distribution the target's: the second token
    follows the exact marginal (chi-square), and drafts are accepted."""
    model, head, _ = trained
    target = NativeLlama.from_hf(model)
    prompt, sampling = PROMPTS[0], SamplingConfig(1.0)
    counts, accepted = sample_second_tokens(target, prompt, GlideDrafter.from_module(head), sampling, trials=1000)
    assert_follows(counts, second_token_marginal(model, prompt, sampling), 1000)
    assert accepted > 100


def test_the_target_cache_is_shared_through_the_capability(trained):
    """The drafter states ReadsTargetCache; decoding hands it the cache, which exposes layer_kv; batched decoding,
    whose cache it cannot read, refuses it with a clear error; a cache that does not match the context is refused."""
    model, head, _ = trained
    target = NativeLlama.from_hf(model)
    drafter = GlideDrafter.from_module(head)
    assert isinstance(drafter, ReadsTargetCache)
    cache = target.new_cache(32)
    assert isinstance(cache, ReadableKVCache) and isinstance(HFCausalLM(model).new_cache(8), ReadableKVCache)
    target.forward(torch.tensor([PROMPTS[0]]), cache)
    keys, values = cache.layer_kv(-1)
    assert keys.shape == values.shape == (1, 2, len(PROMPTS[0]), 8)
    with pytest.raises(SpecdraftError, match="does not expose"):
        share_target_cache(drafter, object())
    with pytest.raises(SpecdraftError, match="through the target's KV cache, which batched decoding does not share"):
        generate_batch(target, [PROMPTS[0]], [drafter], GenerationConfig(8, 3))
    drafter.begin(target, cache)
    with pytest.raises(SpecdraftError, match="read_target_cache"):
        drafter.propose(torch.tensor(PROMPTS[0]), 3, SamplingConfig(), None)
    drafter.read_target_cache(cache)
    with pytest.raises(SpecdraftError, match="every context token but the last"):
        drafter.propose(torch.tensor(PROMPTS[0]), 3, SamplingConfig(), None)  # the cache holds the root too
    share_target_cache(object(), None)  # other drafters: nothing to do


def test_heads_folder_round_trip_and_cli_factory(trained, tmp_path):
    model, head, _ = trained
    folder = save_heads(head, "glide", glide_spec(model.config, {"ttt_steps": "3"}), tmp_path / "heads", "tiny0")
    target = NativeLlama.from_hf(model)
    loaded = make_named("glide", target, None, {"heads": str(folder), "cape": "0.5", "max_nodes": "6"})
    assert isinstance(loaded, GlideDrafter) and loaded.thresholds == (0.5,) and loaded.max_nodes == 6
    _, again = load_heads(folder, kind="glide")
    for name, tensor in head.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], tensor)
    config = GenerationConfig(20, 4, speculation="fixed")
    same = GlideDrafter.from_module(head, cape="0.5", max_nodes=6)
    assert generate(target, PROMPTS[0], loaded, config).stats.accept_lengths == \
        generate(target, PROMPTS[0], same, config).stats.accept_lengths
    with pytest.raises(SpecdraftError, match="heads=PATH"):
        make_named("glide", target, None, {})
    deeper = NativeLlama.from_hf(tiny_llama(1, layers=3))
    with pytest.raises(SpecdraftError, match="2-layer target"):
        generate(deeper, PROMPTS[0], loaded, config)


def test_int8_draft_head_keeps_output_and_bad_option_is_refused(trained, tmp_path):
    """quantize=int8 rounds only the draft's LM head rows: output stays plain greedy decoding's."""
    from specdraft.models import quantized

    model, head, _ = trained
    folder = save_heads(head, "glide", glide_spec(model.config, {"ttt_steps": "3"}), tmp_path / "heads", "tiny0")
    target = NativeLlama.from_hf(model)
    drafter = make_named("glide", target, None, {"heads": str(folder), "quantize": "int8"})
    config = GenerationConfig(20, 4, speculation="fixed")
    for prompt in PROMPTS:
        assert generate(target, prompt, drafter, config).token_ids == generate(target, prompt, None, config).token_ids
    assert (drafter._vocab.packed is not None) == quantized.available()
    with pytest.raises(SpecdraftError, match="quantize must be none or int8"):
        make_named("glide", target, None, {"heads": str(folder), "quantize": "int4x"})
