"""Block-quantized weights (Q4_0, Q4_1, Q8_0): packing, the int8 kernels, the quantized Llama, GGUF loading, and the
decoding guarantees on the quantized path (greedy speculative == plain, sampled output follows the target)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from specdraft.decoding import generate
from specdraft.drafters.combined import draft_model_drafter
from specdraft.drafters.draft_model import DraftModelDrafter
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.errors import SpecdraftError
from specdraft.models import quantized as Q
from specdraft.models import rowgemm
from specdraft.models.native_llama import NativeLlama
from specdraft.models.quantized_llama import KV_CACHE_DEFAULT, KV_CACHE_DTYPES, QuantizedLlama
from specdraft.sampling import SamplingConfig, warp
from specdraft.sequence import GenerationConfig
from toys import PatternDrafter, assert_follows, tiny_llama

pytestmark = pytest.mark.skipif(not rowgemm.available(), reason="no AVX2/F16C CPU or C++ compiler for the kernels")
KINDS = (Q.Q4_0, Q.Q4_1, Q.Q8_0)
PROMPT = list(range(3, 30))


def _reference(x: torch.Tensor, weight: Q.QuantizedWeight) -> torch.Tensor:
    """x (M, K) quantized per block of 32 as the kernel does, times the dequantized weight, in float64."""
    blocks = x.double().view(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    quants = torch.round(blocks / torch.where(scale == 0, 1, scale)).clamp(-127, 127)
    return (quants * scale).view_as(x) @ Q.dequantize(weight).double().T


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 16, 37])
def test_packed_blocks_dequantize_as_gguf_py_does(kind, rows):
    weight = torch.randn(rows, 96)
    blocks = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType(kind))
    expected = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(kind))
    packed = Q.pack_blocks(torch.from_numpy(blocks), kind, rows, 96)
    assert packed.packed.shape == (-(-rows // 16), 3, {2: 288, 3: 320, 8: 544}[kind])
    assert torch.equal(Q.dequantize(packed), torch.from_numpy(expected.copy()))
    ids = torch.tensor([[rows - 1, 0]])
    assert torch.equal(Q.rows(packed, ids)[0], torch.from_numpy(expected[[rows - 1, 0]].copy()))


@pytest.mark.parametrize("kind", KINDS)
def test_products_match_the_block_arithmetic_and_are_row_and_thread_invariant(kind):
    torch.manual_seed(0)
    weight = Q.quantize(torch.randn(40, 160), kind)
    x = torch.randn(21, 160)
    x[3] = 0.0  # an all-zero row quantizes with scale 0
    out = Q.linear(x, weight)
    assert out.shape == (21, 40) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _reference(x, weight), rtol=1e-5, atol=1e-4)
    alone = torch.cat([Q.linear(x[i : i + 1], weight) for i in range(21)])
    assert torch.equal(out, alone)  # k rows reproduce k 1-row products bit for bit
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(Q.linear(x, weight), out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(Q.linear(x.bfloat16(), weight), Q.linear(x.bfloat16().float(), weight))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("threads", [2, 3, 5])
def test_products_split_between_threads_match_one_thread(kind, threads):
    """Several rows on several threads: each thread starts on its own run of column groups and, once done, takes the
    last groups of the others' runs, so which thread computes a group changes from call to call; the result must not."""
    torch.manual_seed(2)
    weight = Q.quantize(torch.randn(16 * 37 + 5, 96), kind)  # 38 groups, the last partly empty
    x = torch.randn(7, 96) * 2
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = [Q.linear(x[:rows], weight) for rows in range(1, 8)]
        torch.set_num_threads(threads)
        for _ in range(5):
            for rows in range(1, 8):
                assert torch.equal(Q.linear(x[:rows], weight), expected[rows - 1]), rows
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", KINDS)
def test_every_tile_of_rows_reproduces_each_row_alone(kind):
    """1 to 13 rows: the kernels block rows in tiles of 1 to 6 (7 = 4 + 3, 13 = 5 + 4 + 4, ...); 40 columns leave the
    last group of 16 partly empty; K = 1024 streams 32 blocks, past the prefetch distance."""
    torch.manual_seed(1)
    weight = Q.quantize(torch.randn(40, 1024), kind)
    x = torch.randn(13, 1024) * torch.rand(13, 1) * 4
    alone = torch.cat([Q.linear(x[i : i + 1], weight) for i in range(13)])
    torch.testing.assert_close(alone.double(), _reference(x, weight), rtol=1e-5, atol=1e-3)
    for rows in range(2, 14):
        assert torch.equal(Q.linear(x[:rows], weight), alone[:rows]), rows


@pytest.mark.parametrize("kind", KINDS)
def test_the_avx2_and_vnni_kernels_agree_bit_for_bit(kind):
    if Q.mode() == 0:
        pytest.skip("this CPU (or torch's dispatch) has no AVX-512 VNNI")
    weight = Q.quantize(torch.randn(50, 128), kind)
    x = torch.randn(9, 128)
    op = torch.ops.specdraft_rowgemm.qlinear
    assert torch.equal(op(x, weight.packed, kind, 50, 0), op(x, weight.packed, kind, 50, 1))


def test_bad_shapes_are_clear_errors():
    with pytest.raises(SpecdraftError, match="multiple of 32"):
        Q.quantize(torch.randn(4, 40), Q.Q8_0)
    with pytest.raises(SpecdraftError, match="unsupported quantization type"):
        Q.pack_blocks(torch.zeros(4, 10, dtype=torch.uint8), 12, 4, 32)
    weight = Q.quantize(torch.randn(4, 64), Q.Q8_0)
    with pytest.raises(RuntimeError, match="does not match"):
        Q.linear(torch.randn(2, 32), weight)


def test_the_final_norm_is_rmsnorm_row_by_row_and_row_invariant():
    torch.manual_seed(0)
    x, weight = torch.randn(2, 37, 96) * 3, torch.randn(96)  # 74 rows: split between threads
    out = Q.rms_norm(x, weight, 1e-5)
    expected = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    assert out.shape == x.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    alone = torch.stack([torch.stack([Q.rms_norm(x[b, t], weight, 1e-5) for t in range(37)]) for b in range(2)])
    assert torch.equal(out, alone)  # each row's result is the row alone's, bit for bit
    with pytest.raises(RuntimeError, match="D values"):
        Q.rms_norm(x, torch.randn(95), 1e-5)


def _dense(seed: int = 0) -> NativeLlama:
    return NativeLlama.from_hf(tiny_llama(seed, std=0.1))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_llama_is_close_to_its_dense_model_and_row_invariant(scheme):
    dense = _dense()
    model = QuantizedLlama.from_dense(dense, scheme)
    assert model.dtype == torch.float32 and model.packing == {"int8": "q8_0+q8_0", "int4": "q4_1+q8_0"}[scheme]
    assert model.parameter_count == dense.parameter_count
    ids = torch.tensor([PROMPT])
    want = dense(ids, dense.new_cache(64))
    got = model(ids, cache := model.new_cache(64))
    assert (got - want).abs().max() < (0.05 if scheme == "int8" else 0.3) * want.abs().max()
    step = torch.tensor([[5, 9, 11, 4, 7]])
    together = model(step, cache)
    cache.crop(len(PROMPT))
    alone = torch.cat([model(step[:, i : i + 1], cache) for i in range(5)], dim=1)
    assert torch.equal(together, alone)


@pytest.mark.parametrize("kv", ["float16", "bfloat16", "float32"])
def test_a_kv_cache_format_is_the_models_own_arithmetic(kv, monkeypatch):
    """The cache format is fixed at build (SPECDRAFT_KV_CACHE): keys and values are stored rounded, the fused call
    and the layer-by-layer path write the same cache, a k-token forward reproduces k 1-token forwards bit for bit, and
    speculative greedy output equals plain output in that format."""
    monkeypatch.setenv("SPECDRAFT_KV_CACHE", kv)
    model = QuantizedLlama.from_dense(_dense(), "int4")
    monkeypatch.delenv("SPECDRAFT_KV_CACHE")
    assert model.kv_dtype == getattr(torch, kv)
    assert QuantizedLlama.from_dense(_dense(), "int4").kv_dtype == KV_CACHE_DTYPES[KV_CACHE_DEFAULT]
    ids = torch.tensor([PROMPT])
    cache = model.new_cache(64)
    assert cache.keys[0].dtype == getattr(torch, kv)
    prefill = model(ids, cache)  # fused calls (a short prompt into an empty cache is a row-wise step)
    reference = QuantizedLlama.from_dense(_dense(), "int4")
    assert (prefill - reference(ids, reference.new_cache(64))).abs().max() < 0.05 * prefill.abs().max()
    step = torch.tensor([[5, 9, 11, 4, 7]])
    together = model(step, cache)
    fused_keys = cache.keys[1][:, :, len(PROMPT) : len(PROMPT) + 5].clone()
    cache.crop(len(PROMPT))
    alone = torch.cat([model(step[:, i : i + 1], cache) for i in range(5)], dim=1)
    assert torch.equal(together, alone)
    cache.crop(len(PROMPT))
    kept, model._fused = model._fused, [None] * len(model.layers)
    try:
        model(step, cache)  # the layer-by-layer path writes the same rounded keys
    finally:
        model._fused = kept
    torch.testing.assert_close(cache.keys[1][:, :, len(PROMPT) : len(PROMPT) + 5], fused_keys, rtol=0, atol=0.02)
    plain = generate(model, PROMPT, None, GenerationConfig(32)).token_ids
    drafter = PatternDrafter(model, lambda step, i: (step * 7 + i * 3) % 5 == 0)
    assert generate(model, PROMPT, drafter, GenerationConfig(32, 4, speculation="fixed")).token_ids == plain
    monkeypatch.setenv("SPECDRAFT_KV_CACHE", "int3")
    with pytest.raises(SpecdraftError, match="SPECDRAFT_KV_CACHE"):
        QuantizedLlama.from_dense(_dense(), "int4")


@pytest.mark.parametrize("before", [0, 10])
def test_a_prefill_longer_than_a_step_writes_what_token_by_token_steps_would(before):
    """A forward of more than ROWS_MAX tokens (a long prompt, into an empty cache or after others) runs as fused
    calls over chunks of ROWS_MAX, so its logits and the keys and values it writes are those of 1-token steps, bit for
    bit; the layer-by-layer path (SDPA) is close to it."""
    model = QuantizedLlama.from_dense(_dense(), "int4")
    ids = torch.tensor([[(7 * i + 3) % 60 + 3 for i in range(before + 150)]])
    cache = model.new_cache(200)
    if before:
        model(ids[:, :before], cache)
    long = model(ids[:, before:], cache)  # (1, 150, V)
    stepped_cache = model.new_cache(200)
    if before:
        model(ids[:, :before], stepped_cache)
    stepped = torch.cat([model(ids[:, i : i + 1], stepped_cache) for i in range(before, before + 150)], dim=1)
    assert torch.equal(long, stepped)
    for index in range(len(model.layers)):
        assert torch.equal(cache.keys[index][:, :, : before + 150], stepped_cache.keys[index][:, :, : before + 150])
        assert torch.equal(cache.values[index][:, :, : before + 150],
                           stepped_cache.values[index][:, :, : before + 150])
    layered_cache = model.new_cache(200)
    kept, model._fused = model._fused, [None] * len(model.layers)
    try:
        if before:
            model(ids[:, :before], layered_cache)
        layered = model(ids[:, before:], layered_cache)
    finally:
        model._fused = kept
    torch.testing.assert_close(long, layered, rtol=1e-3, atol=1e-3)


def test_a_batched_forward_gives_each_row_its_batch_one_logits_and_cache_bit_for_bit():
    """The batched path's forwards (a ragged prefill with prompts longer than ROWS_MAX, then a ragged verify of a
    chain on some rows and a tree on another) run the fused layer per token as batch-1 steps do: every row's logits
    and the keys and values it writes equal its batch-1 forwards' bit for bit, whatever else is in the batch."""
    from specdraft.models.batched_llama import batched_forward, new_batched_cache

    model = QuantizedLlama.from_dense(_dense(), "int4")
    torch.manual_seed(0)
    prompts = [torch.randint(3, 64, (n,)) for n in (150, 70, 5)]
    steps = [torch.randint(3, 64, (n,)) for n in (4, 1, 3)]
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # row 2: a root and two children
    offsets = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 1, 2]])
    local = torch.ones(4, 4, dtype=torch.bool).tril().repeat(3, 1, 1)
    local[2, :3, :3] = tree
    cache = new_batched_cache(model, 4, 256)
    cache.crop(0, 0)
    padded = torch.stack([torch.cat([p, torch.full((150 - len(p),), 3)]) for p in prompts])  # (3, 150)
    filled = batched_forward(model, cache, padded, [len(p) for p in prompts], first_row=[1, 3, 0])  # (3, 150, V)
    fed = torch.stack([torch.cat([s, torch.full((4 - len(s),), 3)]) for s in steps])  # (3, 4)
    verified = batched_forward(model, cache, fed, [len(s) for s in steps], first_row=[1, 3, 0], offsets=offsets,
                               local_mask=local)  # (3, 4, V)
    for i, (prompt, step, row) in enumerate(zip(prompts, steps, [1, 3, 0], strict=True)):
        alone = model.new_cache(256)
        assert torch.equal(filled[i, : len(prompt)], model(prompt[None], alone)[0])
        if i == 2:
            positions = len(prompt) + offsets[i, : len(step)]
            want = model(step[None], alone, positions=positions, attention_mask=tree)[0]
        else:
            want = model(step[None], alone)[0]
        assert torch.equal(verified[i, : len(step)], want)
        end = len(prompt) + len(step)
        for index in range(len(model.layers)):
            assert torch.equal(cache.keys[index][row, :, :end], alone.keys[index][0, :, :end])
            assert torch.equal(cache.values[index][row, :, :end], alone.values[index][0, :, :end])


def test_the_fused_layer_call_equals_the_layer_by_layer_path_closely():
    model = QuantizedLlama.from_dense(_dense(), "int8")
    ids = torch.tensor([PROMPT])
    cache = model.new_cache(64)
    model(ids, cache)
    step = torch.tensor([[5, 9, 11]])
    fused = model(step, cache)
    cache.crop(len(PROMPT))
    kept, model._fused = model._fused, [None] * len(model.layers)
    try:
        layered = model(step, cache)
    finally:
        model._fused = kept
    torch.testing.assert_close(fused, layered, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_one_call_runs_every_layer_as_the_calls_one_by_one_do(scheme):
    model = QuantizedLlama.from_dense(_dense(), scheme)
    stack = Q.FusedStack.of(model._fused)
    assert stack is not None and len(stack.weights) == 4 * len(model.layers)
    one, each = model.new_cache(64), model.new_cache(64)
    model(torch.tensor([PROMPT]), one)
    model(torch.tensor([PROMPT]), each)
    start = len(PROMPT)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and two children
    three = torch.tensor([[5, 9, 11]])
    for tokens, local in ((torch.tensor([[5]]), None), (three, None), (three, tree)):
        step = model._step(start, tokens.shape[1]) if local is None else \
            model._tree_step(start, tokens.shape[1], start + torch.tensor([0, 1, 1]), local)
        mask = None if step.mask is None else step.mask[: tokens.shape[1]]  # (T, S)
        hidden = model.embed_tokens(tokens)  # (1, T, D)
        together = Q.fused_layers(hidden, stack, one.keys, one.values, start, step.cos, step.sin, mask)
        alone = hidden
        for index, layer in enumerate(model._fused):
            alone = Q.fused_layer(alone, layer, each.keys[index], each.values[index], start, step.cos, step.sin, mask)
        assert torch.equal(together, alone)
        for index in range(len(model.layers)):
            assert torch.equal(one.keys[index], each.keys[index]) and torch.equal(one.values[index], each.values[index])


def test_a_decode_step_makes_one_call_for_its_layers(monkeypatch):
    model = QuantizedLlama.from_dense(_dense(), "int8")
    cache = model.new_cache(64)
    model(torch.tensor([PROMPT]), cache)
    expected = model(torch.tensor([[5, 9]]), cache)
    cache.crop(len(PROMPT))

    def refuse(*args, **kwargs):
        raise AssertionError("a layer called alone")

    monkeypatch.setattr(Q, "fused_layer", refuse)
    assert torch.equal(model(torch.tensor([[5, 9]]), cache), expected)
    kept, model._fused = model._fused, [None, *model._fused[1:]]  # a layer not fused: the layers go one by one
    try:
        assert Q.FusedStack.of(model._fused) is None
        cache.crop(len(PROMPT))
        with pytest.raises(AssertionError, match="alone"):
            model(torch.tensor([[5, 9]]), cache)
    finally:
        model._fused = kept


def test_quantized_tables_serve_drafters_and_exports():
    dense = _dense()
    model = QuantizedLlama.from_dense(dense, "int8")
    assert model.embed_weight.shape == dense.embed_weight.shape and model.embed_weight.dtype == torch.float32
    assert model.embed_weight is model.embed_weight  # made once
    tensors = model.checkpoint_tensors()
    assert set(tensors) == set(dense.checkpoint_tensors())
    ids = torch.tensor([[3, 4, 5]])
    torch.testing.assert_close(model.embed_tokens(ids)[0], model.embed_weight[ids[0]])
    with pytest.raises(SpecdraftError, match="quantized weights"):
        model.load_checkpoint_tensors(tensors, "x")


@pytest.mark.parametrize("speculation", ["adaptive", "fixed"])
def test_greedy_speculative_equals_plain_on_the_quantized_path(speculation):
    target = QuantizedLlama.from_dense(_dense(), "int4")
    plain = generate(target, PROMPT, None, GenerationConfig(48)).token_ids
    draft = NativeLlama.from_hf(tiny_llama(1, std=0.1))
    for drafter in (DraftModelDrafter(draft), draft_model_drafter(draft, siblings=1), PromptLookupDrafter(),
                    DraftModelDrafter(QuantizedLlama.from_dense(draft, "int8")),
                    PatternDrafter(target, lambda step, i: (step * 7 + i * 3) % 5 == 0)):
        config = GenerationConfig(48, 4, speculation=speculation)
        assert generate(target, PROMPT, drafter, config).token_ids == plain


def test_a_one_token_prompt_decodes_the_same_speculatively():
    """A one-token prompt is not prefilled: its first forward is a plain step or a whole verify from an empty cache,
    both on the row-wise path."""
    target = QuantizedLlama.from_dense(_dense(), "int4")
    for prompt in ([7], [7, 9]):
        plain = generate(target, prompt, None, GenerationConfig(24)).token_ids
        drafter = PatternDrafter(target, lambda step, i: (step * 7 + i * 3) % 5 == 0)
        assert generate(target, prompt, drafter, GenerationConfig(24, 4, speculation="fixed")).token_ids == plain


def test_sampled_output_follows_the_quantized_targets_distribution():
    """Speculative sampling on the quantized target: the second token's marginal is the target's own (chi-square)."""
    target = QuantizedLlama.from_dense(NativeLlama.from_hf(tiny_llama(0, std=0.05)), "int4")
    sampling = SamplingConfig(1.0, top_k=12)
    prompt = PROMPT[:8]
    p1 = warp(target(torch.tensor([prompt]), target.new_cache(16))[0, -1], sampling)  # (V,)
    p2 = torch.stack([warp(target(torch.tensor([prompt + [t]]), target.new_cache(16))[0, -1], sampling)
                      for t in range(target.vocab_size)])  # (V, V)
    marginal = p1 @ p2
    drafter = DraftModelDrafter(NativeLlama.from_hf(tiny_llama(1, std=0.05)))
    counts, trials = {}, 600
    for seed in range(trials):
        generator = torch.Generator().manual_seed(seed)
        result = generate(target, prompt, drafter, GenerationConfig(2, 3, sampling, speculation="fixed"), generator)
        counts[result.token_ids[1]] = counts.get(result.token_ids[1], 0) + 1
    assert_follows(_Counts(counts), marginal, trials)


class _Counts(dict):
    def __missing__(self, key):
        return 0


def _write_gguf(path, dense: NativeLlama, layer_kind: int, table_kind: int) -> None:
    """A llama GGUF of ``dense``'s weights as llama.cpp's converter writes it (q and k rows permuted)."""
    config = dense.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)

    def put(name, tensor, kind, heads=None):
        array = tensor.detach().float().numpy()
        if heads is not None:  # llama.cpp's rotary permutation
            array = array.reshape(heads, 2, array.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(array.shape)
        if kind is None:
            writer.add_tensor(name, np.ascontiguousarray(array))
        else:
            blocks = gguf.quants.quantize(array, gguf.GGMLQuantizationType(kind))
            writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType(kind))

    tensors = dense.checkpoint_tensors()
    put("token_embd.weight", tensors["model.embed_tokens.weight"], table_kind)
    put("output.weight", tensors["lm_head.weight"], table_kind)
    put("output_norm.weight", tensors["model.norm.weight"], None)
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for hf, ours in names.items():
            heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(hf)
            put(f"blk.{i}.{ours}.weight", tensors[prefix + f"self_attn.{hf}.weight"], layer_kind, heads)
        for hf in ("gate", "up", "down"):
            put(f"blk.{i}.ffn_{hf}.weight", tensors[prefix + f"mlp.{hf}_proj.weight"], layer_kind)
        put(f"blk.{i}.attn_norm.weight", tensors[prefix + "input_layernorm.weight"], None)
        put(f"blk.{i}.ffn_norm.weight", tensors[prefix + "post_attention_layernorm.weight"], None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_loads_its_own_blocks_in_transformers_row_order_and_caches_the_pack(tmp_path):
    dense = _dense()
    _write_gguf(tmp_path / "model.gguf", dense, Q.Q4_1, Q.Q8_0)
    cache_folder = tmp_path / "cache"
    model = QuantizedLlama.from_gguf(tmp_path / "model.gguf", dense.config, "tiny", cache_folder)
    expected = QuantizedLlama.from_dense(dense, "int4")  # the same blocks, made without the permutation
    got, want = model.checkpoint_tensors(), expected.checkpoint_tensors()
    assert all(torch.equal(got[name], want[name]) for name in want)
    cached = list(cache_folder.glob("quantized-*.safetensors"))
    assert len(cached) == 1 and not list(cache_folder.glob("*.tmp"))
    again = QuantizedLlama.from_gguf(tmp_path / "model.gguf", dense.config, "tiny", cache_folder)
    ids = torch.tensor([PROMPT])
    assert torch.equal(again(ids, again.new_cache(64)), model(ids, model.new_cache(64)))


def test_unsupported_gguf_tensors_are_refused_by_name(tmp_path):
    dense = _dense()
    _write_gguf(tmp_path / "model.gguf", dense, gguf.GGMLQuantizationType.F16, Q.Q8_0)
    with pytest.raises(SpecdraftError, match=r"blk\.0\.attn_q\.weight is F16"):
        QuantizedLlama.from_gguf(tmp_path / "model.gguf", dense.config, "tiny")


def test_a_quantized_draft_model_drafts_from_block_rows_of_its_vocabulary(tmp_path, monkeypatch):
    """``quantize=int8`` on a draft model: its draft-vocabulary rows are multiplied as blocks (rounded once), and the
    target's greedy output is unchanged."""
    from specdraft.drafters.loading import quantize_draft

    target = QuantizedLlama.from_dense(_dense(), "int4")
    plain = generate(target, PROMPT, None, GenerationConfig(32)).token_ids
    draft = quantize_draft(NativeLlama.from_hf(tiny_llama(1, std=0.1)), "int8")
    keep = torch.arange(0, 64, 2)
    rows = draft.lm_head_weight[keep].contiguous()
    hidden = torch.randn(3, 32)
    first = draft.lm_head(hidden, rows)
    assert first.shape == (3, 32) and draft.lm_head(hidden, rows).equal(first)  # the same blocks, made once
    torch.testing.assert_close(first, hidden @ rows.T, rtol=0.05, atol=0.05)
    fresh = quantize_draft(NativeLlama.from_hf(tiny_llama(1, std=0.1)), "int8")
    rounded = []
    monkeypatch.setattr(Q, "quantize", lambda *args, real=Q.quantize: rounded.append(1) or real(*args))
    drafter = DraftModelDrafter(fresh, keep=keep)
    assert len(rounded) == 1  # the vocabulary's rows became blocks when the drafter was made, not in its first draft
    assert generate(target, PROMPT, drafter, GenerationConfig(32, 4)).token_ids == plain
    assert len(rounded) == 1
    with pytest.raises(SpecdraftError, match="quantize must be one of"):
        quantize_draft(NativeLlama.from_hf(tiny_llama(1)), "int3")
    with pytest.raises(SpecdraftError, match="dense Llama-family"):
        quantize_draft(draft, "int8")


def test_precision_rules(tmp_path):
    """auto takes a GGUF target's own blocks unless --dtype is given; other targets stay dense; drafters follow
    --dtype, or the CPU's fast dtype beside quantized weights."""
    from specdraft.hardware import fast_dtype
    from specdraft.models.registry import SMOLLM2, choose_precision

    fast = torch.bfloat16 if fast_dtype().bf16 else torch.float32
    folder = tmp_path / "plain"
    folder.mkdir()
    assert choose_precision(SMOLLM2) == ("gguf", torch.float32, fast)
    assert choose_precision(SMOLLM2, "bfloat16") == (None, torch.bfloat16, torch.bfloat16)
    assert choose_precision(SMOLLM2, "bfloat16", "gguf") == ("gguf", torch.float32, torch.bfloat16)
    assert choose_precision(str(folder), dense_default=torch.bfloat16) == (None, torch.bfloat16, torch.bfloat16)
    assert choose_precision(str(folder), quantize="int4") == ("int4", torch.float32, fast)
    (folder / "model.gguf").write_bytes(b"")
    assert choose_precision(str(folder)).quantize == "gguf"
    with pytest.raises(SpecdraftError, match="needs a GGUF target"):
        choose_precision(str(tmp_path), quantize="gguf")
    with pytest.raises(SpecdraftError, match="quantize must be one of"):
        choose_precision(SMOLLM2, quantize="int3")


def test_a_folder_default_quantize_falls_back_to_dense_where_the_kernels_cannot_run(tmp_path, monkeypatch):
    """A draft folder's ``quantize`` default is skipped where the int8 kernels cannot run; asked for, it is an
    error there."""
    import json

    from specdraft.drafters import loading, registry
    from toys import save_tiny_checkpoint

    target = NativeLlama.from_hf(tiny_llama(0))
    folder = save_tiny_checkpoint(tmp_path / "draft", seed=1, layers=1)
    (folder / "drafter_options.json").write_text(json.dumps({"quantize": "int8"}))
    from toys import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    assert isinstance(registry.load_drafter(target, tokenizer, draft=str(folder)).model, QuantizedLlama)
    monkeypatch.setattr(loading, "_can_quantize", lambda: False)
    assert not isinstance(registry.load_drafter(target, tokenizer, draft=str(folder)).model, QuantizedLlama)
    with pytest.raises(SpecdraftError, match="int8 kernels"):
        registry.load_drafter(target, tokenizer, draft=str(folder), options={"quantize": "int8"})
