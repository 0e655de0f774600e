"""llama.cpp's ``draft-dflash`` computes what the DFlash heads compute: the first block llama.cpp drafts for a
prompt (its debug log's top candidates; ``llama-speculative-simple`` prefills all but the prompt's last token, which
anchors that block) equals the block a plain PyTorch forward of the same heads drafts (the
forward of the shared layout, written here as the oracle: fused target features -> context K/V, a non-causal block
``[last token, MASK ...]`` through Qwen3 layers, the target's head), with the weights rounded to bf16 as the
``--gguf-type bf16`` export stores them. The target's features come from transformers' fp32 forward of the
converted SmolLM2, llama.cpp's from the Q4_1 GGUF it was converted from, so the check allows a near-tie to flip.
Skipped unless llama.cpp is built."""

import re
import subprocess

import pytest
import torch
import torch.nn.functional as F

from specdraft.models.registry import SMOLLM2

pytestmark = pytest.mark.engines
PROMPTS = ("Why is the sky blue?", "Write a haiku about the sea.", "What is 12 times 7?")
N_MAX = 5


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX rotary embedding of x (T, heads, hd) at positions pos (T,)."""
    hd = x.shape[-1]
    freqs = pos[:, None].double() / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)  # (T, hd/2)
    cos, sin = torch.cat([freqs.cos()] * 2, -1)[:, None].float(), torch.cat([freqs.sin()] * 2, -1)[:, None].float()
    half = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * cos + half * sin


def dflash_block_logits(w: dict, spec: dict, features: torch.Tensor, table: torch.Tensor, head: torch.Tensor,
                        last: int) -> torch.Tensor:
    """Logits (N_MAX, V) of draft rows 1..N_MAX for context features (n, k*H) and the block [last, MASK...]."""
    eps, theta, hd = spec["rms_norm_eps"], spec["rope_theta"], spec["head_dim"]
    nh, nkv, n = spec["num_attention_heads"], spec["num_key_value_heads"], features.shape[0]
    g = _rms(features @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # (n, H)
    tokens = torch.tensor([last] + [spec["mask_token_id"]] * N_MAX)
    x = table[tokens]  # (1 + N_MAX, H); the mask row is the trained vector
    ctx_pos, pos = torch.arange(n), torch.arange(n, n + 1 + N_MAX)
    for layer in range(spec["num_layers"]):
        p = {k.split(".", 2)[2]: v for k, v in w.items() if k.startswith(f"layers.{layer}.")}

        def kv(h, positions, p=p):
            k = _rms((h @ p["self_attn.k_proj.weight"].T).view(-1, nkv, hd), p["self_attn.k_norm.weight"], eps)
            return _rope(k, positions, theta), (h @ p["self_attn.v_proj.weight"].T).view(-1, nkv, hd)

        k_ctx, v_ctx = kv(g, ctx_pos)  # no input_layernorm on the features
        h = _rms(x, p["input_layernorm.weight"], eps)
        q = _rope(_rms((h @ p["self_attn.q_proj.weight"].T).view(-1, nh, hd), p["self_attn.q_norm.weight"], eps),
                  pos, theta)
        k_blk, v_blk = kv(h, pos)
        k, v = torch.cat([k_ctx, k_blk]), torch.cat([v_ctx, v_blk])  # (n + 1 + N_MAX, nkv, hd)
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(nh // nkv, 0),
                                              v.transpose(0, 1).repeat_interleave(nh // nkv, 0))  # non-causal
        x = x + attn.transpose(0, 1).reshape(len(tokens), nh * hd) @ p["self_attn.o_proj.weight"].T
        h = _rms(x, p["post_attention_layernorm.weight"], eps)
        gate, up = h @ p["mlp.gate_proj.weight"].T, h @ p["mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ p["mlp.down_proj.weight"].T
    return _rms(x, w["norm.weight"], eps)[1:] @ head.T  # (N_MAX, V)


def _llama_cpp_first_block(binary, target_gguf, draft_gguf, prompt: str) -> list[int]:
    done = subprocess.run([str(binary), "-m", str(target_gguf), "-md", str(draft_gguf), "--spec-type", "draft-dflash",
                           "--spec-draft-n-max", str(N_MAX), "--temp", "0", "--top-k", "1", "-n", "2", "-t", "2",
                           "-lv", "5", "-p", prompt], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.findall(r"draft candidate\s+0, pos\s+(\d+):\s+(\d+)", done.stdout + done.stderr)
    assert [int(p) for p, _ in found[:N_MAX]] == list(range(N_MAX)), found[:N_MAX]
    return [int(t) for _, t in found[:N_MAX]]


def test_llama_cpps_first_dflash_block_equals_the_pytorch_forward(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash_toys import dflash_spec, write_dflash_heads
    from specdraft.bench.llamacpp import find_binary
    from specdraft.errors import SpecdraftError
    from specdraft.export import ExportConfig, export
    from specdraft.models.gguf_files import target_gguf_file
    from specdraft.models.registry import load_tokenizer, resolve
    from specdraft.prompts import encode_prompt

    try:
        binary = find_binary("llama-speculative-simple")
    except SpecdraftError as exc:
        pytest.skip(str(exc))
    spec = dflash_spec(AutoConfig.from_pretrained(resolve(SMOLLM2)), 2, 8, (1, 14, 27), mask_token_id=49151)
    heads = write_dflash_heads(tmp_path / "heads", spec, SMOLLM2, seed=1)
    gguf = export(ExportConfig(str(heads), "dflash-gguf", str(tmp_path / "d.gguf"), gguf_type="bf16",
                               gguf_output_type="bf16"))
    w = {k: v.float().bfloat16().float() for k, v in load_file(str(heads / "heads.safetensors")).items()}
    target = AutoModelForCausalLM.from_pretrained(resolve(SMOLLM2), dtype=torch.float32).eval()
    head = target.lm_head.weight.detach().bfloat16().float()  # (V, H), tied
    table = head.clone()
    table[spec["mask_token_id"]] = w["mask_embedding"]
    tokenizer = load_tokenizer(SMOLLM2)
    same = total = 0
    for prompt in PROMPTS:
        ids = encode_prompt(tokenizer, prompt, chat=True)
        with torch.no_grad():
            out = target(torch.tensor([ids]), output_hidden_states=True)
        # llama-speculative-simple prefills all but the last prompt token, which anchors the first block
        features = torch.cat([out.hidden_states[i + 1][0, :-1] for i in spec["target_layer_ids"]], -1)  # (n-1, 3H)
        last = ids[-1]
        with torch.no_grad():
            ours = dflash_block_logits(w, spec, features, table, head, last).argmax(-1).tolist()
        theirs = _llama_cpp_first_block(binary, target_gguf_file(SMOLLM2), gguf, tokenizer.decode(ids))
        same += sum(a == b for a, b in zip(ours, theirs, strict=True))
        total += N_MAX
    assert same >= total - 1, (same, total)
