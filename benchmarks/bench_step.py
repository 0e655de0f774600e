"""Where a decode step's time goes: a whole k-token forward of the target against the sum of its kernels alone.

For the quantized path (the GGUF's own blocks) and, with ``--dense``, the dense bf16 path, at ``--context`` cached
tokens: the median time of a forward of k = 1, 2, 5, 9 new tokens (``forward``), of its weight products alone
(``products``: the same 4 products per layer and the LM head, called back to back on prepared inputs), of its
attention alone (``attention``), and what is left (``rest = forward - products - attention``: norms, rotary
embedding, cache writes, activation quantization, dispatch and Python). The ``verify / step`` column is what
adaptive speculation pays for a k-token verify in plain steps.

    python benchmarks/bench_step.py --threads 2 --reps 40 [--dense] [--context 64 512 2048] [--rows 1 5]
    python benchmarks/bench_step.py --threads 1 --cpu-time ...   # a shared machine: CPU time of the one thread
    python benchmarks/bench_step.py --bounds --context 64 512 2048 --rows 1 5

``--bounds`` also sets the quantized path's products and attention against this machine's two bounds: memory (the
bytes a forward reads, over the read bandwidth a sum over 512 MB measures on the same threads) and arithmetic (each
product's multiply-adds at the rate the same kernel reaches on a weight of a few MB it has just read, so that it comes
from the caches, net of a call's fixed cost: :func:`macs_per_ns`). A k-token product that overlapped its weight stream
with its arithmetic perfectly would take the larger of the two; one that did them one after the other, their sum. The
products are called one by one from Python, as ``products`` above; the column beside them takes off what as many calls
of a one-group product cost.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdraft.hardware import cpu_capability, cpu_model
from specdraft.models import packed as packing
from specdraft.models import quantized as Q
from specdraft.models import rowgemm
from specdraft.models.registry import SMOLLM2, load_model

ROWS = (1, 2, 5, 9)


CLOCK = time.perf_counter  # --cpu-time: time.thread_time


def median_ms(fn, reps: int) -> float:
    """The median time of ``reps`` calls of ``fn`` on CLOCK, in ms."""
    times = []
    for _ in range(reps):
        start = CLOCK()
        fn()
        times.append(CLOCK() - start)
    return statistics.median(times) * 1e3


def _weights(model) -> list[Q.QuantizedWeight]:
    """Every weight one forward multiplies: the four products of each layer, then the LM head."""
    return [layer.quantized[name] for layer in model.layers for name in ("qkv", "o", "gate_up", "down")] + \
        [model.head_quantized]


def _products(model, rows: int):
    """A closure running every weight product of one forward on ``rows`` prepared input rows."""
    config = model.config
    widths = {"qkv": config.hidden_size, "o": config.num_attention_heads * config.head_dim,
              "gate_up": config.hidden_size, "down": config.intermediate_size}
    if model.packing.startswith("q"):
        jobs = [(weight, torch.randn(rows, weight.in_features)) for weight in _weights(model)]
        return lambda: [Q.linear(x, w) for w, x in jobs]
    dtype = model.dtype
    jobs = [(getattr(layer, f"{name}_weight"), layer.packed.get(name), torch.randn(rows, widths[name], dtype=dtype))
            for layer in model.layers for name in widths]
    head = (model.lm_head_weight, model.packed_head, torch.randn(rows, config.hidden_size, dtype=dtype))
    return lambda: [packing.linear(x, w, None, p) for w, p, x in (*jobs, head)]


def _attention(model, cache, rows: int):
    """A closure attending ``rows`` new queries over the cache in every layer, as a row-wise step does."""
    config = model.config
    dtype = torch.float32 if cache.keys[0].dtype == torch.float16 else cache.keys[0].dtype  # fp16 caches: fp32 rows
    queries = torch.randn(1, rows, config.num_attention_heads, config.head_dim, dtype=dtype)
    end = cache.length + rows
    views = [(k[:, :, :end], v[:, :, :end]) for k, v in zip(cache.keys, cache.values, strict=True)]
    mask = torch.ones(rows, end, dtype=torch.bool).tril(cache.length)
    return lambda: [rowgemm.attention(queries, k, v, mask) for k, v in views]


def measure(model, context: int, reps: int, rows_list: tuple[int, ...] = ROWS) -> list[str]:
    cache = model.new_cache(context + 64)
    model(torch.randint(0, model.vocab_size, (1, context)), cache)
    lines = []
    step = None
    with torch.inference_mode():
        for rows in rows_list:
            ids = torch.randint(0, model.vocab_size, (1, rows))

            def forward():
                model(ids, cache)  # noqa: B023
                cache.crop(context)

            forward()
            whole = median_ms(forward, reps)
            products = median_ms(_products(model, rows), reps)
            attention = median_ms(_attention(model, cache, rows), reps)
            step = step or whole
            lines.append(f"| {model.packing} | {context} | {rows} | {whole:.2f} | {products:.2f} | {attention:.2f} | "
                         f"{whole - products - attention:.2f} | {whole / step:.2f} |")
    return lines


def read_bandwidth(reps: int = 7, megabytes: int = 512) -> float:
    """Bytes a second a sum over ``megabytes`` of memory reads on torch's threads (median of ``reps``): more than
    any of these CPUs' L3 holds, so it comes from memory."""
    buffer = torch.ones(megabytes << 20, dtype=torch.uint8).view(torch.int64)
    seconds = median_ms(buffer.sum, reps) / 1e3
    return buffer.numel() * 8 / seconds


def macs_per_ns(kind: int, rows: int, reps: int) -> float:
    """Multiply-adds a nanosecond of the block kernel for ``rows`` rows on weights of ``kind`` read from the caches:
    the difference between products with 3,072 and 1,024 output columns of 1,536 inputs (up to 5 MB as Q8_0), so
    that a call's fixed cost (dispatch, quantizing the rows, starting the threads) cancels; medians of 5 ``reps``
    calls each, after one that loads the weight."""
    x = torch.randn(rows, 1536)
    times = []
    for columns in (1024, 3072):
        weight = Q.quantize(torch.randn(columns, 1536) * 0.05, kind)
        Q.linear(x, weight)
        times.append(median_ms(lambda: Q.linear(x, weight), 5 * reps))  # noqa: B023
    return rows * 2048 * 1536 / (max(times[1] - times[0], 1e-6) * 1e6)


def bounds(model, contexts: list[int], rows_list: tuple[int, ...], reps: int) -> list[str]:
    """The products' and the attention's measured times against their memory and arithmetic bounds (module
    docstring), in ms."""
    if not model.packing.startswith("q"):
        return []
    bandwidth = read_bandwidth()
    weights = _weights(model)
    weight_bytes = sum(w.nbytes for w in weights)
    config = model.config
    kv_width = config.num_key_value_heads * config.head_dim
    lines = [f"\nread bandwidth {bandwidth / 1e9:.1f} GB/s; a forward reads {weight_bytes / 1e6:.1f} MB of blocks "
             f"({weight_bytes / bandwidth * 1e3:.2f} ms) plus its KV cache",
             "", "| tokens | products ms | less the calls' fixed cost | memory ms | arithmetic ms | max (overlapped) "
             "| sum (serial) |", "|---|---|---|---|---|---|---|"]
    tiny = Q.quantize(torch.randn(16, config.hidden_size) * 0.05, Q.Q4_1)  # one group: a call's fixed cost
    with torch.inference_mode():
        for rows in rows_list:
            rates = {kind: macs_per_ns(kind, rows, reps) for kind in {w.kind for w in weights}}
            arithmetic = sum(rows * w.out_features * w.in_features / rates[w.kind] for w in weights) / 1e6
            memory = weight_bytes / bandwidth * 1e3
            products = median_ms(_products(model, rows), reps)
            x = torch.randn(rows, config.hidden_size)
            fixed = len(weights) * median_ms(lambda: Q.linear(x, tiny), 5 * reps)  # noqa: B023
            lines.append(f"| {rows} | {products:.2f} | {products - fixed:.2f} | {memory:.2f} | {arithmetic:.2f} | "
                         f"{max(memory, arithmetic):.2f} | {memory + arithmetic:.2f} |")
        lines += ["", "| cached | tokens | attention ms | KV bytes ms (memory) |", "|---|---|---|---|"]
        for context in contexts:
            cache = model.new_cache(context + 64)
            model(torch.randint(0, model.vocab_size, (1, context)), cache)
            kv_bytes = 2 * context * kv_width * cache.keys[0].element_size() * config.num_hidden_layers
            for rows in rows_list:
                attention = median_ms(_attention(model, cache, rows), reps)
                lines.append(f"| {context} | {rows} | {attention:.2f} | {kv_bytes / bandwidth * 1e3:.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=SMOLLM2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--context", type=int, nargs="+", default=[256], help="cached tokens (one or more)")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="new tokens per forward")
    parser.add_argument("--dense", action="store_true", help="also the dense bf16 path")
    parser.add_argument("--bounds", action="store_true",
                        help="also the quantized products and attention against the memory and arithmetic bounds")
    parser.add_argument("--cpu-time", action="store_true",
                        help="this thread's CPU time, not wall time (--threads 1 only; steadier on a shared machine)")
    args = parser.parse_args()
    if args.cpu_time:
        if args.threads != 1:
            parser.error("--cpu-time needs --threads 1 (other threads' work is not counted)")
        global CLOCK
        CLOCK = time.thread_time
    torch.set_num_threads(args.threads)
    print(f"# {cpu_model()}, torch {torch.__version__} ({cpu_capability()}), {args.threads} threads, "
          f"{'/'.join(map(str, args.context))} cached tokens, "
          f"{'CPU' if args.cpu_time else 'wall'} time; int8 kernel {'AVX-512 VNNI' if Q.mode() else 'AVX2'}")
    models = [load_model(args.target, quantize="gguf")]
    if args.dense:
        models.append(load_model(args.target, torch.bfloat16))
    print("\n| weights | cached | tokens | forward ms | products ms | attention ms | rest ms | verify / step |")
    print("|---|---|---|---|---|---|---|---|")
    for model in models:
        for context in args.context:
            print("\n".join(measure(model, context, args.reps, tuple(args.rows))), flush=True)
    if args.bounds:
        print("\n".join(bounds(models[0], args.context, tuple(args.rows), args.reps)), flush=True)


if __name__ == "__main__":
    main()
