"""Quantized products on this CPU: specdraft's block kernels against torch's own int4/int8 CPU ops and dense bf16.

Every weight product of one SmolLM2-135M forward (30 layers of qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536, then the 49152x576 LM head), for M = 1 row (a plain step) and M = 5 rows (a 4-token verify),
interleaved, median of ``--reps``. For each path it also says whether it is row-invariant (5 rows together equal the
5 rows one at a time, bit for bit), which lossless speculative decoding needs, and how far it is from the exact
product of the same blocks:

- ``specdraft q4_1+q8_0``: ``quantized.linear`` on Q4_1 layers and a Q8_0 head (int8 activations per block of 32).
- ``torch int4pack``: ``aten._weight_int4pack_mm_for_cpu`` with the same Q4_1 blocks as 4-bit weights, group 32,
  scale d and zero m + 8d (w = (q - 8) d + zero); bf16 activations; the head stays bf16 dense.
- ``torch int8pack``: ``aten._weight_int8pack_mm`` (int8 weights, one scale per output channel: not GGUF's blocks);
  bf16 activations.
- ``torch _int_mm``: ``torch._int_mm`` (oneDNN's int8 x int8 -> int32 product, VNNI where the CPU has it) with the
  activations quantized per row and one weight scale per output channel (not GGUF's blocks), what torchao's
  dynamic-int8 configs run.
- ``bf16 rows`` and ``bf16 F.linear``: the dense bf16 weights through specdraft's row kernel and through oneDNN.
- ``--compile``: ``torch.compile`` (inductor's C++ code) of Q4_1 dequantization fused with the product, on the
  gate_up and head shapes only (each shape compiles for tens of seconds).

    python benchmarks/bench_quant_libs.py --threads 2 --reps 20 [--compile]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from specdraft.hardware import cpu_capability, cpu_model
from specdraft.models import packed as packing
from specdraft.models import quantized as Q

LAYER_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD = (49152, 576)
LAYERS = 30


def _q4_1_parts(weight: torch.Tensor):
    """The Q4_1 blocks of ``weight`` as (packed for specdraft, quants (N, K) int32, d (N, K/32), m (N, K/32))."""
    import gguf
    import numpy as np

    n, k = weight.shape
    raw = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q4_1).reshape(n, k // 32, 20)
    d = torch.from_numpy(np.ascontiguousarray(raw[..., 0:2]).view(np.float16)[..., 0].astype(np.float32))
    m = torch.from_numpy(np.ascontiguousarray(raw[..., 2:4]).view(np.float16)[..., 0].astype(np.float32))
    qs = torch.from_numpy(np.ascontiguousarray(raw[..., 4:])).to(torch.int32)  # (N, K/32, 16)
    q = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(n, k)  # quants 0-15 of k and k + 16 in one byte
    packed = Q.pack_blocks(torch.from_numpy(raw.reshape(n, -1)), Q.Q4_1, n, k)
    return packed, q, d, m


def _int4pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor):
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    zeros = m + 8 * d  # (q - 8) d + zero = q d + m
    scales_zeros = torch.stack([d.T, zeros.T], dim=-1).contiguous().to(torch.bfloat16)  # (K/32, N, 2)
    return packed, scales_zeros


def median_ms(fn, reps: int) -> float:
    """The median wall time of ``reps`` calls of ``fn``, in ms."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def build(seed: int = 0):
    torch.manual_seed(seed)
    shapes = {**LAYER_SHAPES, "head": HEAD}
    weights = {name: torch.randn(*shape) * 0.05 for name, shape in shapes.items()}
    names = ("specdraft", "int4pack", "int8pack", "int_mm", "rows", "onednn")
    paths: dict[str, dict] = {name: {} for name in names}
    for name, w in weights.items():
        packed, q, d, m = _q4_1_parts(w)
        paths["specdraft"][name] = Q.quantize(w, Q.Q8_0) if name == "head" else packed
        bf16 = Q.dequantize(packed).bfloat16() if name != "head" else w.bfloat16()
        paths["int4pack"][name] = ("dense", bf16) if name == "head" else ("int4",) + _int4pack(q, d, m)
        scale = w.abs().amax(1) / 127
        paths["int8pack"][name] = (torch.round(w / scale[:, None]).to(torch.int8), scale.bfloat16())
        paths["int_mm"][name] = (paths["int8pack"][name][0].T.contiguous(), scale)
        paths["rows"][name] = (bf16, packing.pack(bf16, "rows"))
        paths["onednn"][name] = bf16
    return paths


def forward(path: str, store: dict, xs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every product of one forward (30 layers, then the head) on ``path``; the outputs of the last layer and head."""
    out = {}
    for layer in range(LAYERS + 1):
        for name in (("head",) if layer == LAYERS else LAYER_SHAPES):
            x, w = xs[name], store[name]
            if path == "specdraft":
                out[name] = Q.linear(x, w)
            elif path == "int4pack":
                out[name] = (F.linear(x.bfloat16(), w[1]) if w[0] == "dense" else
                             torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), w[1], 32, w[2]))
            elif path == "int8pack":
                out[name] = torch.ops.aten._weight_int8pack_mm(x.bfloat16(), w[0], w[1])
            elif path == "int_mm":
                row_scale = x.abs().amax(-1, keepdim=True) / 127  # (M, 1)
                quants = torch.round(x / row_scale).to(torch.int8)
                out[name] = torch._int_mm(quants, w[0]).float() * row_scale * w[1]
            elif path == "rows":
                out[name] = packing.linear(x.bfloat16(), w[0], None, w[1])
            else:
                out[name] = F.linear(x.bfloat16(), w)
    return out


def row_invariant(path: str, store: dict, rows: int = 5) -> bool:
    xs = {name: torch.randn(rows, shape[1]) for name, shape in {**LAYER_SHAPES, "head": HEAD}.items()}
    together = forward(path, store, xs)
    alone = [forward(path, store, {n: x[i : i + 1] for n, x in xs.items()}) for i in range(rows)]
    return all(torch.equal(together[n], torch.cat([a[n] for a in alone])) for n in together)


def compiled_rows(reps: int) -> list[str]:
    """inductor's fused Q4_1 dequantize + product, on two shapes (compile time dominates: say it)."""
    lines = []

    def product(x, q, d, m):
        w = q.view(q.shape[0], -1, 32).to(torch.float32) * d[..., None] + m[..., None]  # (N, K/32, 32)
        return x @ w.view(q.shape[0], -1).T.to(x.dtype)

    fn = torch.compile(product, dynamic=False)
    for name, shape in (("gate_up", LAYER_SHAPES["gate_up"]), ("head", HEAD)):
        w = torch.randn(*shape) * 0.05
        packed, q, d, m = _q4_1_parts(w)
        q8 = q.to(torch.uint8)
        for rows in (1, 5):
            x = torch.randn(rows, shape[1])
            start = time.perf_counter()
            fn(x, q8, d, m)
            compile_s = time.perf_counter() - start
            ms = median_ms(lambda: fn(x, q8, d, m), reps)  # noqa: B023
            ours = median_ms(lambda: Q.linear(x, packed), reps)  # noqa: B023
            lines.append(f"| compile {name} {shape[0]}x{shape[1]} | {rows} | {ms:.3f} | specdraft {ours:.3f} | "
                         f"compile {compile_s:.0f} s |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile's fused dequantize+product")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {cpu_model()}, torch {torch.__version__} ({cpu_capability()}), {args.threads} threads; "
          f"specdraft kernel {'AVX-512 VNNI' if Q.mode() else 'AVX2'}")
    paths = build()
    names = {"specdraft": "specdraft q4_1+q8_0", "int4pack": "torch int4pack (bf16 head)",
             "int8pack": "torch int8pack (per-channel)", "int_mm": "torch _int_mm (per-row x per-channel)",
             "rows": "bf16 rows kernel", "onednn": "bf16 F.linear (oneDNN)"}
    inputs = {rows: {n: torch.randn(rows, s[1]) for n, s in {**LAYER_SHAPES, "head": HEAD}.items()} for rows in (1, 5)}
    times: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        for _ in range(3):  # interleaved rounds
            for path in paths:
                for rows in (1, 5):
                    ms = median_ms(lambda: forward(path, paths[path], inputs[rows]), args.reps)  # noqa: B023
                    times.setdefault((path, rows), []).append(ms)
        print("\n| path | 1 row ms | 5 rows ms | 5 / 1 | row-invariant |\n|---|---|---|---|---|")
        for path in paths:
            one, five = min(times[(path, 1)]), min(times[(path, 5)])
            print(f"| {names[path]} | {one:.2f} | {five:.2f} | {five / one:.2f} | {row_invariant(path, paths[path])} |")
        if args.compile:
            print("\n| product | rows | ms | specdraft ms | note |\n|---|---|---|---|---|")
            print("\n".join(compiled_rows(args.reps)))


if __name__ == "__main__":
    main()
