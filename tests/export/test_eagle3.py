"""The EAGLE-3 export: every field and tensor the engines read, and a from-scratch reference forward over the
exported tensors (engine names, split projections) that reproduces the head's first draft step."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specdraft.cli import main
from specdraft.errors import SpecdraftError
from specdraft.export.eagle3 import export_eagle3
from specdraft.heads import save_heads
from specdraft.heads.eagle import head_config
from specdraft.heads.eagle3 import build_eagle3
from specdraft.training.heads.eagle3 import parse_settings
from toys import save_tiny_checkpoint, tiny_llama


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x, positions, theta):
    """Llama's rotary embedding (half split) on (T, n, hd)."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)  # (hd/2,)
    angles = positions[:, None].float() * inv  # (T, hd/2)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _reference(w: dict, config: dict, aux: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
    """Target token ids of the greedy first draft at every position, as an engine computes them: (T,)."""
    eps, hd = config["rms_norm_eps"], config["head_dim"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    hidden = aux @ w["fc.weight"].T  # (T, D)
    x = torch.cat([_rms(embeds, w["midlayer.input_layernorm.weight"], eps),
                   _rms(hidden, w["midlayer.hidden_norm.weight"], eps)], dim=-1)  # (T, 2D)
    length, positions = x.shape[0], torch.arange(x.shape[0])
    q = _rotate((x @ w["midlayer.self_attn.q_proj.weight"].T).view(length, nh, hd), positions, config["rope_theta"])
    k = _rotate((x @ w["midlayer.self_attn.k_proj.weight"].T).view(length, nkv, hd), positions, config["rope_theta"])
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(length, nkv, hd)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / hd**0.5
    scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
    attended = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(length, nh * hd)
    h = hidden + attended @ w["midlayer.self_attn.o_proj.weight"].T
    m = _rms(h, w["midlayer.post_attention_layernorm.weight"], eps)
    h = h + (F.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T)) \
        @ w["midlayer.mlp.down_proj.weight"].T
    draft = (_rms(h, w["norm.weight"], eps) @ w["lm_head.weight"].T).argmax(-1)  # (T,) draft ids
    return draft + w["d2t"][draft]


def test_export_layout_and_reference_forward(tmp_path):
    model = tiny_llama(0, layers=4)
    spec = head_config(model.config) | parse_settings({"draft_vocab": "40"}, 4, 64)
    torch.manual_seed(0)
    ids = torch.randperm(64)[:40]
    head = build_eagle3(dict(spec), ids)
    save_heads(head, "eagle3", spec, tmp_path / "heads", "tiny")
    save_tiny_checkpoint(tmp_path / "target", seed=0, layers=4)
    assert main(["export", str(tmp_path / "heads"), "--format", "eagle3", "--out", str(tmp_path / "bf16"),
                 "--target", str(tmp_path / "target")]) == 0
    assert load_file(tmp_path / "bf16" / "model.safetensors")["fc.weight"].dtype == torch.bfloat16
    export_eagle3(tmp_path / "heads", tmp_path / "out", torch.float32)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert (config["vocab_size"], config["draft_vocab_size"], config["norm_before_residual"]) == (64, 40, False)
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [-1, 1, 2]
    w = load_file(tmp_path / "out" / "model.safetensors")
    assert w["fc.weight"].shape == (32, 96) and w["midlayer.self_attn.q_proj.weight"].shape == (32, 64)
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool and int(w["t2d"].sum()) == 40
    assert torch.equal(torch.arange(40) + w["d2t"], ids.sort().values)
    assert not any("embed" in name for name in w)
    aux, embeds = torch.randn(6, 96), torch.randn(6, 32)
    with torch.no_grad():
        out = head(head.fuse(aux[None]), embeds[None], head.new_cache(8))[0]  # (6, D)
        ours = head.draft_token_ids[head.logits(out).argmax(-1)]
    assert torch.equal(_reference(w, config, aux, embeds), ours)


def test_export_refuses_what_is_not_eagle3_heads_of_the_target(tmp_path):
    with pytest.raises(SpecdraftError, match="not a heads folder"):
        export_eagle3(tmp_path, tmp_path / "out")
    model = tiny_llama(0, layers=4)
    spec = head_config(model.config) | parse_settings({}, 4, 64)
    save_heads(build_eagle3(dict(spec)), "eagle3", spec, tmp_path / "heads", "tiny")
    save_tiny_checkpoint(tmp_path / "shallow", seed=0, layers=2)
    assert main(["export", str(tmp_path / "heads"), "--format", "eagle3", "--out", str(tmp_path / "o"),
                 "--target", str(tmp_path / "shallow")]) == 2
    assert not (tmp_path / "o").exists()
