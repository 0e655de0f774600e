"""Drafter architecture derived from the target; embedding initialisation from the target's table."""

import pytest
import torch
from transformers import LlamaForCausalLM

from specdraft.errors import SpecdraftError
from specdraft.training.drafter.init_drafter import (
    PRESETS,
    DrafterConfig,
    init_embeddings_from_target,
    project_embeddings,
)
from toys import tiny_llama


@pytest.fixture(scope="module")
def target_config():
    return tiny_llama(vocab_size=64, max_positions=256).config


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_keep_the_targets_vocabulary_and_special_ids(target_config, preset):
    config = DrafterConfig(preset=preset).llama_config(target_config)
    layers, hidden, heads, kv_heads, ffn = PRESETS[preset]
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (layers, hidden, heads)
    assert (config.num_key_value_heads, config.intermediate_size) == (kv_heads, ffn)
    assert 2 <= layers <= 4
    assert config.vocab_size == 64
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 0)
    assert config.tie_word_embeddings is True
    assert config.max_position_embeddings == 256  # min(target's 256, 2048)
    assert config.rope_parameters["rope_theta"] == target_config.rope_parameters["rope_theta"]
    model = LlamaForCausalLM(config)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_overrides_replace_preset_values_and_cap_positions(target_config):
    config = DrafterConfig(preset="base", num_layers=3, hidden_size=96, num_heads=3, num_kv_heads=1,
                           intermediate_size=200, max_positions=128).llama_config(target_config)
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (3, 96, 3)
    assert (config.num_key_value_heads, config.intermediate_size, config.head_dim) == (1, 200, 32)
    assert config.max_position_embeddings == 128


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"preset": "huge"}, "preset"),
    ({"num_layers": 0}, "num_layers"),
    ({"hidden_size": -4}, "hidden_size"),
    ({"hidden_size": 100, "num_heads": 3}, "hidden_size"),
    ({"num_heads": 4, "num_kv_heads": 3}, "num_kv_heads"),
    ({"max_positions": 0}, "max_positions"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(SpecdraftError, match=field):
        DrafterConfig(**kwargs)


def test_projection_shapes_and_same_width_copy():
    table = torch.randn(50, 32)
    assert torch.equal(project_embeddings(table, 32), table)
    assert project_embeddings(table, 16).shape == (50, 16)
    wide = project_embeddings(table, 40)
    assert wide.shape == (50, 40) and torch.all(wide[:, 32:] == 0)


def test_projection_keeps_the_geometry_of_a_low_rank_table():
    generator = torch.Generator().manual_seed(0)
    table = torch.randn(50, 3, generator=generator) @ torch.randn(3, 32, generator=generator)  # rank 3
    projected = project_embeddings(table, 3)  # (50, 3)
    gram, gram_projected = table @ table.T, projected @ projected.T
    scale = gram.trace() / gram_projected.trace()
    torch.testing.assert_close(gram_projected * scale, gram, rtol=1e-4, atol=1e-3)
    assert projected.pow(2).mean().sqrt() == pytest.approx(float(table.pow(2).mean().sqrt()), rel=1e-4)


def test_init_from_target_writes_the_tied_embeddings(target_config):
    drafter = LlamaForCausalLM(DrafterConfig(hidden_size=16, num_heads=2, num_kv_heads=1).llama_config(target_config))
    target_table = tiny_llama().get_input_embeddings().weight  # (64, 32)
    init_embeddings_from_target(drafter, target_table)
    torch.testing.assert_close(drafter.get_input_embeddings().weight, project_embeddings(target_table, 16))
    assert drafter.get_output_embeddings().weight is drafter.get_input_embeddings().weight
    with pytest.raises(SpecdraftError, match="vocabulary mismatch"):
        init_embeddings_from_target(drafter, torch.randn(65, 32))


def test_a_drafter_from_target_layers_computes_what_those_layers_compute():
    """The copy of layers 0 and 2 gives the logits of the target run through only those layers (the layer-skip
    path of NativeLlama), and the copy of every layer gives the target's own logits."""
    from specdraft.models.native_llama import NativeLlama
    from specdraft.training.drafter.init_drafter import drafter_from_target_layers

    target = tiny_llama(seed=3, layers=3)
    ids = torch.tensor([[1, 5, 9, 4, 7, 11]])
    native = NativeLlama.from_hf(target)
    for layers in ([0, 2], [0, 1, 2]):
        drafter = drafter_from_target_layers(target, layers)
        assert drafter.config.num_hidden_layers == len(layers) and target.config.num_hidden_layers == 3
        expected = native(ids, native.new_cache(16), layers=layers)  # (1, T, V)
        torch.testing.assert_close(drafter(ids).logits, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(drafter_from_target_layers(target, [0, 1, 2])(ids).logits, target(ids).logits)


@pytest.mark.parametrize("layers, message", [("1,0", "increasing"), ("", "increasing"), ("a", "increasing"),
                                             ("0,3", "out of range")])
def test_bad_layer_lists_are_refused(layers, message):
    from specdraft.training.drafter.init_drafter import InitDrafterConfig, drafter_from_target_layers

    with pytest.raises(SpecdraftError, match=message):
        config = InitDrafterConfig(target="t", out="o", layers=layers)
        drafter_from_target_layers(tiny_llama(layers=3), config.layer_indices())


def test_a_grown_drafter_computes_the_drafter_until_trained():
    """Block expansion: the target's layers appended with zeroed output projections leave the logits unchanged,
    every other weight of the new blocks is the target's, and one gradient step moves the new blocks' output
    projections (so they can learn) while the function changes only through them."""
    from specdraft.training.drafter.init_drafter import drafter_from_target_layers, grow_drafter

    target = tiny_llama(seed=3, layers=3)
    drafter = drafter_from_target_layers(target, [0])
    with torch.no_grad():  # a "trained" drafter: not the target's layer any more
        for p in drafter.model.layers.parameters():
            p.add_(0.05 * torch.randn_like(p))
    grown = grow_drafter(drafter, target, [1, 2])
    ids = torch.tensor([[1, 5, 9, 4, 7, 11]])
    assert grown.config.num_hidden_layers == 3 and drafter.config.num_hidden_layers == 1
    torch.testing.assert_close(grown(ids).logits, drafter(ids).logits)
    assert grown.model.layers[1].self_attn.o_proj.weight.abs().max() == 0
    torch.testing.assert_close(grown.model.layers[2].mlp.up_proj.weight, target.model.layers[2].mlp.up_proj.weight)
    torch.testing.assert_close(grown.model.layers[0].mlp.up_proj.weight, drafter.model.layers[0].mlp.up_proj.weight)
    grown.train()
    grown(ids, labels=ids).loss.backward()
    assert grown.model.layers[1].self_attn.o_proj.weight.grad.abs().max() > 0
    assert grown.model.layers[2].mlp.down_proj.weight.grad.abs().max() > 0
    with pytest.raises(SpecdraftError, match="out of range"):
        grow_drafter(drafter, target, [3])
    with pytest.raises(SpecdraftError, match="width"):
        grow_drafter(tiny_llama(hidden=16, layers=1), target, [0])
