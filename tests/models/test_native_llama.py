"""The native Llama against transformers' ``LlamaForCausalLM`` (the reference path), plus its cache and loaders.

Weights are re-drawn at unit scale (not transformers' 0.02 init) so that logits are O(1) and any error in
positions, masking, fusing or caching shows up far above the 1e-4 tolerance.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, LlamaConfig, LlamaForCausalLM

from specdraft.errors import SpecdraftError
from specdraft.models import rowgemm
from specdraft.models.base import CausalLM, KVCache
from specdraft.models.native_llama import NativeLlama, StaticKVCache, supports

ATOL = 1e-4
SMOLLM2 = Path("~/.cache/specdraft/smollm2-135m-instruct").expanduser()
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
CONFIGS = {
    "gqa": {},
    "mha_tied": {"num_key_value_heads": 4, "tie_word_embeddings": True},
    "head_dim_32": {"head_dim": 32},
    "mqa_biases": {"num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True},
    "llama3_rope": {"rope_parameters": LLAMA3_ROPE},
}


def _config(**overrides) -> LlamaConfig:
    """A tiny Llama: 2 layers, hidden 64, 4 heads / 2 KV heads (head_dim 16), 40-token context."""
    settings = {
        "vocab_size": 101,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 40,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }
    return LlamaConfig(**{**settings, **overrides})


def _hf_model(config: LlamaConfig, seed: int = 0) -> LlamaForCausalLM:
    """A transformers model with unit-scale random weights (activations and logits O(1))."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, parameter.shape[1] ** -0.5)
            elif name.endswith("bias"):
                parameter.normal_(0.0, 0.2)
            else:
                parameter.normal_(1.0, 0.2)
    return model


def _reference(model: LlamaForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits of the whole sequence in one uncached forward, (B, T, V)."""
    with torch.no_grad():
        return model(input_ids, use_cache=False).logits.float()


def _ids(batch: int, length: int, vocab: int = 101, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))  # (B, T)


def _feed(native: NativeLlama, cache: StaticKVCache, input_ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Forward ``input_ids`` in consecutive chunks of the given lengths; concatenated logits (B, T, V)."""
    assert sum(chunks) == input_ids.shape[1]
    outputs, start = [], 0
    for size in chunks:
        outputs.append(native(input_ids[:, start : start + size], cache))
        start += size
    return torch.cat(outputs, dim=1)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize(
    "chunks",
    [[12], [8, 1, 1, 1, 1], [8, 4], [1, 1, 2, 5, 2, 1]],
    ids=["prefill", "prefill_then_steps", "prefill_then_chunk", "mixed_from_empty"],
)
@pytest.mark.parametrize("variant", CONFIGS)
@pytest.mark.parametrize("prepack", [False, True], ids=["eager", "prepacked"])
def test_cached_forwards_match_transformers(variant: str, chunks: list[int], batch: int, prepack: bool) -> None:
    model = _hf_model(_config(**CONFIGS[variant]))
    native = NativeLlama.from_hf(model)
    if prepack:
        native.prepack()
    input_ids = _ids(batch, sum(chunks))
    cache = native.new_cache(32, batch_size=batch)
    logits = _feed(native, cache, input_ids, chunks)
    assert logits.shape == (batch, sum(chunks), 101) and logits.dtype == torch.float32
    assert cache.length == sum(chunks)
    torch.testing.assert_close(logits, _reference(model, input_ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", CONFIGS)
def test_checkpoint_tensors_give_back_the_transformers_weights(variant: str) -> None:
    model = _hf_model(_config(**CONFIGS[variant]))
    tensors = NativeLlama.from_hf(model).checkpoint_tensors()
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    assert sorted(tensors) == sorted(expected)
    assert all(torch.equal(tensors[key], expected[key]) for key in expected)


@pytest.mark.parametrize("variant", ["gqa", "head_dim_32"])
def test_crop_then_reforward_matches_transformers(variant: str) -> None:
    model = _hf_model(_config(**CONFIGS[variant]))
    native = NativeLlama.from_hf(model)
    prompt, draft, replacement = _ids(2, 10, seed=1), _ids(2, 4, seed=2), _ids(2, 3, seed=3)
    cache = native.new_cache(32, batch_size=2)
    native(prompt, cache)
    draft_logits = native(draft, cache)
    cache.crop(11)  # keep the first draft token, reject the other three
    logits = native(replacement, cache)
    assert cache.length == 14
    expected = _reference(model, torch.cat([prompt, draft[:, :1], replacement], dim=1))[:, 11:]
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    assert (logits - draft_logits[:, 1:]).abs().max() > 0.1  # the stale slots really were overwritten


def test_prepack_packs_fp32_weights_where_a_kernel_is_available() -> None:
    from specdraft.models import packed, rowgemm

    native = NativeLlama.from_hf(_hf_model(_config()))
    can = packed.enabled() or rowgemm.available()
    assert native.prepack() == can
    assert all(bool(layer.packed) == can for layer in native.layers)


@pytest.mark.skipif(not rowgemm.available(), reason="no AVX2 CPU or C++ compiler for the row kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_kernels_make_a_k_token_forward_equal_k_steps_bit_for_bit(dtype: torch.dtype) -> None:
    """With ``rows`` packing, a chain of 5 and a tree verify reproduce 1-token forwards exactly (bf16 too)."""
    native = NativeLlama.from_hf(_hf_model(_config()), dtype=dtype)
    assert native.prepack("rows") and native.packing == "rows"
    ids = _ids(1, 16, seed=4)
    cache = native.new_cache(32)
    native(ids[:, :10], cache)
    chain = native(ids[:, 10:15], cache)  # (1, 5, V)
    cache.crop(10)
    steps = torch.cat([native(ids[:, 10 + i : 11 + i], cache) for i in range(5)], dim=1)
    assert torch.equal(chain, steps)
    cache.crop(10)  # a tree: node 2 is a sibling of node 1, node 3 a child of node 1
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    tree = native(ids[:, 10:14], cache, positions=10 + torch.tensor([0, 1, 1, 2]), attention_mask=mask)
    cache.crop(10)
    path = torch.cat([native(ids[:, 10:12], cache), native(ids[:, 13:14], cache)], dim=1)
    assert torch.equal(tree[:, [0, 1, 3]], path)


def test_bf16_is_close_to_fp32_reference() -> None:
    model = _hf_model(_config())
    native = NativeLlama.from_hf(model, dtype=torch.bfloat16)
    input_ids = _ids(1, 12)
    cache = native.new_cache(16)
    logits = _feed(native, cache, input_ids, [8, 4])
    assert native.dtype == torch.bfloat16 and cache.keys[0].dtype == torch.bfloat16
    assert logits.dtype == torch.float32
    reference = _reference(model, input_ids)
    assert (logits - reference).abs().max() < 0.15
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9


def test_from_hf_keeps_the_model_dtype_and_implements_the_protocols() -> None:
    model = _hf_model(_config())
    native = NativeLlama.from_hf(model)
    cache = native.new_cache(8)
    assert isinstance(native, CausalLM) and isinstance(cache, KVCache)
    assert (native.vocab_size, native.max_context, native.dtype) == (101, 40, torch.float32)
    assert native.config is model.config and len(native.layers) == 2
    assert (cache.length, cache.capacity) == (0, 8)


@pytest.mark.parametrize("tied", [False, True])
def test_save_pretrained_round_trip(tmp_path: Path, tied: bool) -> None:
    model = _hf_model(_config(tie_word_embeddings=tied))
    model.save_pretrained(tmp_path)
    native = NativeLlama.from_pretrained(tmp_path)
    assert native.name == tmp_path.name
    input_ids = _ids(1, 9)
    logits = _feed(native, native.new_cache(16), input_ids, [6, 3])
    torch.testing.assert_close(logits, _reference(model, input_ids), atol=ATOL, rtol=0)


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    model = _hf_model(_config())
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (tmp_path / "model.safetensors").exists()
    native = NativeLlama.from_pretrained(tmp_path, name="tiny")
    input_ids = _ids(1, 7)
    torch.testing.assert_close(native(input_ids, native.new_cache(8)), _reference(model, input_ids), atol=ATOL, rtol=0)
    assert native.name == "tiny"


def test_cache_created_in_inference_mode_works_outside_it() -> None:
    native = NativeLlama.from_hf(_hf_model(_config()))
    with torch.inference_mode():
        cache = native.new_cache(8)
        native(_ids(1, 3), cache)
    native(_ids(1, 2), cache)
    assert cache.length == 5


def _saved_checkpoint(folder: Path) -> Path:
    _hf_model(_config()).save_pretrained(folder)
    return folder / "model.safetensors"


def test_missing_folder_is_reported(tmp_path: Path) -> None:
    with pytest.raises(SpecdraftError, match=r"checkpoint folder not found: .*nowhere"):
        NativeLlama.from_pretrained(tmp_path / "nowhere")


def test_missing_config_is_reported(tmp_path: Path) -> None:
    _saved_checkpoint(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(SpecdraftError, match=r"no config\.json"):
        NativeLlama.from_pretrained(tmp_path)


def test_missing_weights_are_reported(tmp_path: Path) -> None:
    _saved_checkpoint(tmp_path).unlink()
    with pytest.raises(SpecdraftError, match=re.escape(f"corrupt checkpoint {tmp_path}: no model.safetensors")):
        NativeLlama.from_pretrained(tmp_path)


def test_deleted_tensor_is_reported(tmp_path: Path) -> None:
    weights = _saved_checkpoint(tmp_path)
    tensors = load_file(weights)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(
        SpecdraftError, match=re.escape(f"{tmp_path}: missing tensor model.layers.1.self_attn.k_proj.weight")
    ):
        NativeLlama.from_pretrained(tmp_path)


def test_wrongly_shaped_tensor_is_reported(tmp_path: Path) -> None:
    weights = _saved_checkpoint(tmp_path)
    tensors = load_file(weights)
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(95, 64)
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(SpecdraftError, match=r"up_proj.weight has shape \(95, 64\), config expects \(96, 64\)"):
        NativeLlama.from_pretrained(tmp_path)


def test_truncated_weights_file_is_reported(tmp_path: Path) -> None:
    weights = _saved_checkpoint(tmp_path)
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(SpecdraftError, match=r"corrupt checkpoint .*model\.safetensors"):
        NativeLlama.from_pretrained(tmp_path)


def test_non_llama_config_is_rejected(tmp_path: Path) -> None:
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(SpecdraftError, match="model_type is 'gpt2', not 'llama'"):
        NativeLlama.from_pretrained(tmp_path)


def test_unsupported_llama_feature_is_rejected() -> None:
    model = _hf_model(_config(hidden_act="gelu"))
    with pytest.raises(SpecdraftError, match="hidden_act 'gelu'"):
        NativeLlama.from_hf(model)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (_config(), True),
        (_config(rope_parameters=LLAMA3_ROPE), True),
        (_config(hidden_act="gelu"), False),
        (_config(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}), False),
        (_config(rope_parameters={**LLAMA3_ROPE, "partial_rotary_factor": 0.5}), False),
        (GPT2Config(n_layer=1, n_embd=32, n_head=2), False),
    ],
    ids=["default_rope", "llama3_rope", "gelu", "linear_rope", "partial_rotary", "gpt2"],
)
def test_supports(config, expected: bool) -> None:
    assert supports(config) is expected


def test_writing_past_capacity_raises_and_keeps_the_cache() -> None:
    native = NativeLlama.from_hf(_hf_model(_config()))
    cache = native.new_cache(6)
    native(_ids(1, 4), cache)
    with pytest.raises(SpecdraftError, match="capacity 6"):
        native(_ids(1, 3), cache)
    assert cache.length == 4
    native(_ids(1, 2), cache)
    assert cache.length == 6
    with pytest.raises(SpecdraftError, match="capacity 6"):
        cache.advance(1)


def test_cache_larger_than_the_context_is_refused() -> None:
    native = NativeLlama.from_hf(_hf_model(_config()))
    with pytest.raises(SpecdraftError, match=r"capacity must be in 1 \.\. 40"):
        native.new_cache(41)


def test_batch_mismatch_is_refused() -> None:
    native = NativeLlama.from_hf(_hf_model(_config()))
    with pytest.raises(SpecdraftError, match="batch 2"):
        native(_ids(1, 3), native.new_cache(8, batch_size=2))


@pytest.mark.parametrize("length", [-1, 4])
def test_bad_crop_raises(length: int) -> None:
    cache = StaticKVCache(2, 1, 2, 8, 16, torch.float32)
    cache.advance(3)
    with pytest.raises(SpecdraftError, match=re.escape(f"length 3 to {length}")):
        cache.crop(length)
    assert cache.length == 3


def test_crop_moves_only_the_length() -> None:
    cache = StaticKVCache(1, 1, 1, 8, 4, torch.float32)
    cache.write(0, 0, torch.ones(1, 3, 1, 4), torch.ones(1, 3, 1, 4))
    cache.advance(3)
    cache.crop(1)
    assert cache.length == 1 and cache.keys[0][0, 0, :3].sum() == 12  # nothing cleared or copied
    cache.crop(0)
    assert cache.length == 0


@pytest.mark.slow
@pytest.mark.skipif(not (SMOLLM2 / "config.json").is_file(), reason=f"no converted SmolLM2 checkpoint at {SMOLLM2}")
def test_smollm2_matches_transformers() -> None:
    model = LlamaForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32).eval()
    native = NativeLlama.from_pretrained(SMOLLM2)
    input_ids = _ids(1, 20, vocab=native.vocab_size)
    logits = _feed(native, native.new_cache(32), input_ids, [14, 1, 1, 4])
    torch.testing.assert_close(logits, _reference(model, input_ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_logits_to_keep_returns_the_last_rows_and_the_same_cache(backend: str) -> None:
    from specdraft.models.hf import HFCausalLM

    hf = _hf_model(_config())
    model = NativeLlama.from_hf(hf) if backend == "native" else HFCausalLM(hf)
    ids = torch.tensor([[5, 9, 3, 17, 40, 2, 8]])
    full_cache, kept_cache = model.new_cache(16), model.new_cache(16)
    full = model.forward(ids, full_cache)  # (1, 7, V)
    kept = model.forward(ids, kept_cache, logits_to_keep=2)  # (1, 2, V)
    assert kept.shape == (1, 2, 101) and torch.allclose(kept, full[:, -2:], atol=1e-5)
    step = torch.tensor([[11]])
    assert torch.allclose(model.forward(step, kept_cache), model.forward(step, full_cache), atol=1e-5)
    if backend == "native":
        logits, hidden = model.forward(ids, model.new_cache(8), return_hidden=True, logits_to_keep=1)
        assert logits.shape == (1, 1, 101) and hidden.shape == (1, 7, 64)  # hidden states are never cut
