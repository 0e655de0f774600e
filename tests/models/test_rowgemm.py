"""The row-product kernel: products and attention against torch's, and row invariance (each row of a k-row call
equals a 1-row call bit for bit), in fp32 and bf16 (attention also over fp16 and bf16 caches with fp32 queries)."""

import pytest
import torch
import torch.nn.functional as F

from specdraft.models import rowgemm

pytestmark = pytest.mark.skipif(not rowgemm.available(), reason="no AVX2 CPU or C++ compiler for the kernel")

SHAPES = [(48, 32), (10, 37), (3, 16), (96, 200), (33, 1)]  # (N, K): N not a multiple of the 16-column panels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear_and_each_row_alone(dtype: torch.dtype, shape: tuple[int, int], bias: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    n, k = shape
    weight = torch.randn(n, k, generator=generator).to(dtype)
    b = torch.randn(n, generator=generator).to(dtype) if bias else None
    packed = rowgemm.pack(weight)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17):  # tiles of up to 6 rows: 7 = 4 + 3, 8 = 4 + 4, 9 = 6 + 3
        x = torch.randn(1, rows, k, generator=generator).to(dtype)
        out = rowgemm.linear(x, packed, b, n)
        assert out.shape == (1, rows, n) and out.dtype == dtype
        expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), expected, atol=tol * k ** 0.5, rtol=tol)
        alone = torch.cat([rowgemm.linear(x[:, i : i + 1], packed, b, n) for i in range(rows)], dim=1)
        assert torch.equal(out, alone)


def test_linear_is_the_same_on_one_thread_and_two() -> None:
    """Threads split the panels, never a sum: the result does not depend on how many run."""
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(1000, 96, generator=generator).bfloat16()
    packed = rowgemm.pack(weight)
    x = torch.randn(5, 96, generator=generator).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = rowgemm.linear(x, packed, None, 1000)
        torch.set_num_threads(2)
        two = rowgemm.linear(x, packed, None, 1000)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


CACHES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16),
          (torch.float32, torch.bfloat16)]  # (queries, cache): a quantized model keeps fp32 queries, its own cache


@pytest.mark.parametrize(("dtype", "cache"), CACHES)
def test_attention_matches_sdpa_and_each_query_alone(dtype: torch.dtype, cache: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    batch, steps, heads, kv_heads, head_dim, start = 2, 5, 4, 2, 16, 11
    slots = start + steps
    cache_k = torch.randn(batch, kv_heads, 40, head_dim, generator=generator).to(cache)  # a cache with spare room
    cache_v = torch.randn(batch, kv_heads, 40, head_dim, generator=generator).to(cache)
    keys, values = cache_k[:, :, :slots], cache_v[:, :, :slots]  # (B, K, S, hd) strided views
    queries = torch.randn(batch, steps, heads, head_dim, generator=generator).to(dtype)  # (B, T, H, hd)
    mask = torch.arange(slots)[None, :] <= start + torch.arange(steps)[:, None]  # (T, S) causal
    out = rowgemm.attention(queries, keys, values, mask)
    assert out.shape == (batch, steps, heads * head_dim) and out.dtype == dtype
    expected = F.scaled_dot_product_attention(queries.float().transpose(1, 2), keys.float(), values.float(),
                                              attn_mask=mask, enable_gqa=True).transpose(1, 2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.reshape(out.shape), atol=tol, rtol=tol)
    for t in range(steps):  # query t alone, seeing exactly its slots
        seen = start + t + 1
        alone = rowgemm.attention(queries[:, t : t + 1], keys[:, :, :seen], values[:, :, :seen], None)
        assert torch.equal(out[:, t : t + 1], alone)


@pytest.mark.parametrize(("dtype", "cache"), CACHES)
def test_attention_of_a_tree_node_equals_its_path_alone(dtype: torch.dtype, cache: torch.dtype) -> None:
    """A tree node sees the context and its ancestors (holes where its cousins sit): its output equals the same
    query alone over the context and its path laid out contiguously, as plain decoding of that path would have it."""
    generator = torch.Generator().manual_seed(2)
    heads, kv_heads, head_dim, start = 6, 2, 64, 37  # 37 context slots: the tree's slots straddle 8-lane blocks
    parents = [-1, 0, 0, 1, 2, 3, 3, 5, 4, 8, 9, 1]  # 12 nodes
    nodes = len(parents)
    keys = torch.randn(1, kv_heads, start + nodes, head_dim, generator=generator).to(cache)
    values = torch.randn(1, kv_heads, start + nodes, head_dim, generator=generator).to(cache)
    queries = torch.randn(1, nodes, heads, head_dim, generator=generator).to(dtype)
    mask = torch.zeros(nodes, start + nodes, dtype=torch.bool)
    mask[:, :start] = True
    paths = []
    for node in range(nodes):
        path, at = [], node
        while at >= 0:
            path.insert(0, at)
            at = parents[at]
        paths.append(path)
        mask[node, [start + i for i in path]] = True
    out = rowgemm.attention(queries, keys, values, mask)
    for node, path in enumerate(paths):
        slots = list(range(start)) + [start + i for i in path]
        alone = rowgemm.attention(queries[:, node : node + 1], keys[:, :, slots], values[:, :, slots], None)
        assert torch.equal(out[:, node : node + 1], alone), node


def test_the_avx2_emulation_keeps_the_256_bit_kernel_and_rows_for_bf16():
    """Under the AVX2 emulation variables a fresh process runs the 256-bit kernel and packs bf16 for it."""
    import os
    import subprocess
    import sys

    code = ("import torch; from specdraft.models import packed, rowgemm; "
            "print(rowgemm.mode(), packed.pack(torch.zeros(8, 16, dtype=torch.bfloat16)).kind)")
    env = os.environ | {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["0", "rows"]


@pytest.mark.parametrize("cache", [torch.float32, torch.float16])
def test_attention_is_the_same_on_one_thread_and_two(cache: torch.dtype) -> None:
    """Rows of a KV head split between threads (or run together in one pass over its cache) compute the same."""
    generator = torch.Generator().manual_seed(3)
    steps, heads, kv_heads, head_dim, start = 5, 9, 3, 64, 203
    keys = torch.randn(1, kv_heads, start + steps, head_dim, generator=generator).to(cache)
    values = torch.randn(1, kv_heads, start + steps, head_dim, generator=generator).to(cache)
    queries = torch.randn(1, steps, heads, head_dim, generator=generator)
    mask = torch.ones(steps, start + steps, dtype=torch.bool).tril(start)  # (T, S) causal
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(rowgemm.attention(queries, keys, values, mask))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def _tree_mask(parents: list[int], start: int) -> tuple[torch.Tensor, list[list[int]]]:
    """(T, start + T) bool: each node sees the context and its ancestors; and each node's path from the root."""
    nodes = len(parents)
    mask = torch.zeros(nodes, start + nodes, dtype=torch.bool)
    mask[:, :start] = True
    paths = []
    for node in range(nodes):
        path, at = [], node
        while at >= 0:
            path.insert(0, at)
            at = parents[at]
        paths.append(path)
        mask[node, [start + i for i in path]] = True
    return mask, paths


@pytest.mark.parametrize("cache", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("start", [5, 64, 101])  # the block of 64 slots: less than one, exactly one, not a multiple
@pytest.mark.parametrize("threads", [1, 2])
def test_attention_tiles_of_every_row_count_equal_each_query_alone(cache: torch.dtype, start: int,
                                                                   threads: int) -> None:
    """SmolLM2's grouping (9 heads on 3 KV heads, hd 64): 1..13 new queries, as a chain (causal) and as a tree, are
    split into tiles of 3, 2 and 1 rows by score and of one query's heads by value; each equals the query alone."""
    generator = torch.Generator().manual_seed(4)
    heads, kv_heads, head_dim = 9, 3, 64
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for steps in range(1, 14):
            slots = start + steps
            keys = torch.randn(1, kv_heads, slots, head_dim, generator=generator).to(cache)
            values = torch.randn(1, kv_heads, slots, head_dim, generator=generator).to(cache)
            queries = torch.randn(1, steps, heads, head_dim, generator=generator)
            causal = torch.ones(steps, slots, dtype=torch.bool).tril(start)
            out = rowgemm.attention(queries, keys, values, causal)
            expected = F.scaled_dot_product_attention(queries.transpose(1, 2), keys.float(), values.float(),
                                                      attn_mask=causal, enable_gqa=True).transpose(1, 2)
            torch.testing.assert_close(out, expected.reshape(out.shape), atol=1e-5, rtol=1e-5)
            for t in range(steps):
                alone = rowgemm.attention(queries[:, t : t + 1], keys[:, :, : start + t + 1],
                                          values[:, :, : start + t + 1], None)
                assert torch.equal(out[:, t : t + 1], alone), (steps, t)
            parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, steps)]
            mask, paths = _tree_mask(parents, start)
            out = rowgemm.attention(queries, keys, values, mask)
            for node, path in enumerate(paths):
                seen = list(range(start)) + [start + i for i in path]
                alone = rowgemm.attention(queries[:, node : node + 1], keys[:, :, seen], values[:, :, seen], None)
                assert torch.equal(out[:, node : node + 1], alone), (steps, node)
    finally:
        torch.set_num_threads(saved)
