"""Where a decode step's time goes: a whole k-token forward of the target against the sum of its kernels alone.

For the quantized path (the GGUF's own blocks) and, with ``--dense``, the dense bf16 path, at ``--context`` cached
tokens: the median time of a forward of k = 1, 2, 5, 9 new tokens (``forward``), of its weight products alone
(``products``: the same 4 products per layer and the LM head, called back to back on prepared inputs), of its
attention alone (``attention``), and what is left (``rest = forward - products - attention``: norms, rotary
embedding, cache writes, activation quantization, dispatch and Python). The ``verify / step`` column is what
adaptive speculation pays for a k-token verify in plain steps.

    python benchmarks/bench_step.py --threads 2 --reps 40 [--dense] [--context 64 512 2048] [--rows 1 5]
    python benchmarks/bench_step.py --threads 1 --cpu-time ...   # a shared machine: CPU time of the one thread
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


def _products(model, rows: int):
    """A closure running every weight product of one forward on ``rows`` prepared input rows."""
    config = model.config
    widths = {"qkv": config.hidden_size, "o": config.num_attention_heads * config.head_dim,
              "gate_up": config.hidden_size, "down": config.intermediate_size}
    if model.packing.startswith("q"):
        jobs = [(layer.quantized[name], torch.randn(rows, widths[name])) for layer in model.layers for name in widths]
        head = (model.head_quantized, torch.randn(rows, config.hidden_size))
        return lambda: [Q.linear(x, w) for w, x in (*jobs, head)]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=SMOLLM2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--context", type=int, nargs="+", default=[256], help="cached tokens (one or more)")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="new tokens per forward")
    parser.add_argument("--dense", action="store_true", help="also the dense bf16 path")
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


if __name__ == "__main__":
    main()
