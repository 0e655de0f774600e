"""A cost model of the machine: seconds per forward of a model against new tokens and context length.

Speculative decoding pays off only when a forward over k new tokens costs less than k 1-token forwards, and how
much less depends on the CPU (AVX2 or AVX-512, bf16 instructions or not), the dtype, the thread count and the
torch build. Nothing here assumes: :func:`measure` times the model's forward for each new-token count in
``sizes`` (1 for a plain step, 2..K+1 for a K-token chain, the tree sizes in use) at a few context lengths (short,
long, a long document: attention over the cache makes each extra new token dearer as the context grows),
the fastest of a few interleaved repeats (the least disturbed by other processes on a shared CPU), in seconds of
this process's CPU time when torch runs one thread (what a forward needs, whatever else the CPU is doing), else
of wall time. A point measured dearer than a larger one (more new tokens, or as many after more cached tokens) is
lowered to it (:func:`monotone`): the larger forward does all of the smaller one's work, and other processes only
ever add time. On a shared 2-core machine three repeats left, for example, 3 new tokens at 1.32x a step and 4 at
1.13x, which a policy would read as a 4-token verify being cheaper than a 3-token one.
The curve is measured once per model, dtype and machine and cached as JSON beside the converted checkpoints
(``<cache>/costs/``, written beside then renamed), keyed by the model's identity and :func:`machine` (CPU model,
ISA torch dispatches to, threads, torch version).

:class:`CostCurve.seconds` interpolates linearly between the measured sizes and contexts (beyond the largest, along
the last segment's slope), so a policy can price any draft (:mod:`specdraft.speculation`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdraft.errors import SpecdraftError
from specdraft.hardware import cpu_model
from specdraft.models import rowgemm
from specdraft.models.base import CausalLM

SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20)  # new tokens per forward: chains of up to 19 draft tokens, trees
CONTEXTS = (64, 512, 2048)  # context lengths measured; others are interpolated (beyond the last, its slope)
REPEATS = 3  # timed repeats per point (after one warm-up sweep); the fastest is kept
FORMAT = 6  # bumped when the measurement changes, so old cached curves are remeasured


def machine() -> dict:
    """What a forward's cost depends on besides the model: CPU model, the ISA torch dispatches to, threads, torch."""
    return {"cpu": cpu_model(), "isa": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
            "mkl_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS", "")}


def model_identity(model: CausalLM) -> dict:
    """The model's name, class, dtype and shape (two models alike in all of these cost the same)."""
    config = getattr(model, "config", None) or getattr(getattr(model, "model", None), "config", None)
    shape = {key: getattr(config, key, None) for key in ("num_hidden_layers", "hidden_size", "intermediate_size",
                                                          "num_attention_heads", "num_key_value_heads")}
    packed = getattr(model, "packing", "none")  # the kernel kind: its curve differs (specdraft.models.packed)
    blocks = packed.startswith("q")  # block-quantized weights (specdraft.models.quantized): the same kernels
    kernels = {"kernels": rowgemm.build_id()} if packed == "rows" or blocks else {}  # a rebuilt kernel: measured again
    kv = getattr(model, "kv_dtype", None)  # a quantized model's KV cache format: the attention's cost depends on it
    cache = {"kv_cache": str(kv).removeprefix("torch.")} if kv is not None else {}
    return {"name": model.name, "class": type(model).__name__, "dtype": str(model.dtype).removeprefix("torch."),
            "vocab_size": model.vocab_size, "prepacked": packed, **shape, **kernels, **cache}


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one forward (the fastest of the repeats, made :func:`monotone`): ``table[c][s]`` for
    ``contexts[c]`` cached tokens and ``sizes[s]`` new ones."""

    sizes: tuple[int, ...]
    contexts: tuple[int, ...]
    table: tuple[tuple[float, ...], ...]
    model: dict
    machine: dict
    measured_seconds: float = 0.0  # how long the calibration took
    clock: str = "wall"  # "cpu": this process's CPU time (one thread), "wall": elapsed time

    def __post_init__(self) -> None:
        object.__setattr__(self, "_at_size", {})  # new_tokens -> each context's seconds (not a field)

    def seconds(self, new_tokens: int, context: int = 0) -> float:
        """Predicted seconds of a forward over ``new_tokens`` after ``context`` cached tokens: each context's row
        interpolated at ``new_tokens`` (kept: the policy asks for the same few sizes every step), then across the
        contexts."""
        rows = self._at_size.get(new_tokens)
        if rows is None:
            rows = self._at_size[new_tokens] = [_interpolate(self.sizes, row, new_tokens) for row in self.table]
        return max(1e-9, _interpolate(self.contexts, rows, context))

    def ratios(self, context: int | None = None) -> list[float]:
        """Each size's cost over a 1-token step's, at ``context`` (default the shortest measured)."""
        context = self.contexts[0] if context is None else context
        one = self.seconds(1, context)
        return [self.seconds(size, context) / one for size in self.sizes]

    def to_dict(self) -> dict:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> CostCurve:
        try:
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')} is not {FORMAT}")
            curve = cls(tuple(data["sizes"]), tuple(data["contexts"]), tuple(tuple(r) for r in data["table"]),
                        dict(data["model"]), dict(data["machine"]), float(data.get("measured_seconds", 0.0)),
                        str(data.get("clock", "wall")))
            if len(curve.table) != len(curve.contexts) or any(len(r) != len(curve.sizes) for r in curve.table):
                raise ValueError("table shape does not match sizes and contexts")
        except (KeyError, TypeError, ValueError) as exc:
            raise SpecdraftError(f"corrupt cost curve: {exc}") from None
        return curve


def _interpolate(xs: Sequence[int], ys: Sequence[float], x: float, extrapolate: bool = True) -> float:
    """Piecewise-linear y(x) through (xs, ys); below xs[0] the first value, beyond xs[-1] the last slope (or value)."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + (max(slope, 0.0) * (x - xs[-1]) if extrapolate else 0.0)
    for i in range(1, len(xs)):
        x0, y0, x1, y1 = xs[i - 1], ys[i - 1], xs[i], ys[i]
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


@torch.inference_mode()
def measure(model: CausalLM, sizes: Sequence[int] = SIZES, contexts: Sequence[int] = CONTEXTS,
            repeats: int = REPEATS, seed: int = 0) -> CostCurve:
    """Time ``model.forward`` over each of ``sizes`` new tokens after each of ``contexts`` cached (random) tokens.

    One prefill of the longest context; each point crops the cache back to its context, so every forward sees the
    same keys. Sizes are swept in turn ``repeats`` times after a warm-up sweep (interleaved, so drift in a shared
    CPU's load spreads over all sizes) and the fastest is kept: other processes only ever add time.
    """
    started = time.perf_counter()
    cpu = torch.get_num_threads() == 1
    clock = time.process_time if cpu else time.perf_counter
    sizes = [size for size in sizes if size < model.max_context] or [1]
    limit = model.max_context - max(sizes)
    contexts = sorted({max(1, min(c, limit)) for c in contexts})
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.vocab_size, (1, contexts[-1] + max(sizes)), generator=generator)  # (1, L)
    cache = model.new_cache(contexts[-1] + max(sizes))
    model.forward(ids[:, : contexts[-1]], cache, logits_to_keep=1)
    table = []
    for context in reversed(contexts):  # longest first: a cropped cache cannot grow back without a forward
        times: dict[int, list[float]] = {size: [] for size in sizes}
        for sweep in range(repeats + 1):
            for size in sizes:
                cache.crop(context)
                tick = clock()
                model.forward(ids[:, context : context + size], cache)
                if sweep:
                    times[size].append(clock() - tick)
        table.insert(0, tuple(min(times[size]) for size in sizes))
    return CostCurve(tuple(sizes), tuple(contexts), monotone(table), model_identity(model), machine(),
                     time.perf_counter() - started, "cpu" if cpu else "wall")


def monotone(table: Sequence[Sequence[float]]) -> tuple[tuple[float, ...], ...]:
    """``table[c][s]`` (contexts, then sizes, both increasing) with each point lowered to the cheapest point at
    least as large in both: non-decreasing along sizes and along contexts. Larger forwards do more work, so a point
    measured dearer than a larger one was disturbed; the larger one bounds it."""
    rows = [list(row) for row in table]
    for row in rows:  # along sizes, from the largest down
        for s in range(len(row) - 2, -1, -1):
            row[s] = min(row[s], row[s + 1])
    for c in range(len(rows) - 2, -1, -1):  # along contexts, from the longest down (each row stays non-decreasing)
        rows[c] = [min(a, b) for a, b in zip(rows[c], rows[c + 1], strict=True)]
    return tuple(tuple(row) for row in rows)


def costs_dir() -> Path:
    """Where cost curves are cached: ``<specdraft cache>/costs`` (beside the converted checkpoints)."""
    from specdraft.models.registry import cache_dir

    return Path(os.environ.get("SPECDRAFT_COSTS_DIR") or cache_dir() / "costs")


def curve_path(model: CausalLM, folder: Path | None = None) -> Path:
    """The cache file of ``model``'s curve on this machine (named by the model and a hash of its whole key)."""
    key = json.dumps({"model": model_identity(model), "machine": machine(), "format": FORMAT}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(model.name))[-60:]
    return (folder or costs_dir()) / f"{stem}-{digest}.json"


_MEMORY: dict[str, CostCurve] = {}


def cost_curve(model: CausalLM, refresh: bool = False, folder: Path | None = None,
               log: Callable[[str], None] | None = None) -> CostCurve:
    """``model``'s curve on this machine: from memory, else the cache file, else measured (seconds) and saved.

    A corrupt cache file is remeasured and replaced; ``refresh`` always remeasures.
    """
    path = curve_path(model, folder)
    if not refresh and str(path) in _MEMORY:
        return _MEMORY[str(path)]
    curve = None if refresh else _read(path)
    if curve is None:
        if log:
            log(f"measuring forward cost of {model.name} ({model_identity(model)['dtype']}) on this CPU ...")
        curve = measure(model)
        _write(path, curve)
        if log:
            log(f"  measured in {curve.measured_seconds:.1f} s, saved to {path}")
    _MEMORY[str(path)] = curve
    return curve


def _read(path: Path) -> CostCurve | None:
    try:
        return CostCurve.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, SpecdraftError):
        return None


def _write(path: Path, curve: CostCurve) -> None:
    """Write beside, then rename: a reader never sees half a file, and a failure leaves the old one."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps(curve.to_dict(), indent=1))
        os.replace(partial, path)
    except OSError:
        pass  # a read-only cache: the curve is still used from memory


def describe(curve: CostCurve) -> list[str]:
    """Lines for ``specdraft calibrate``: ms per forward and the ratio to a 1-token step, per size and context."""
    kv = f", KV cache {curve.model['kv_cache']}" if "kv_cache" in curve.model else ""
    lines = [f"{curve.model['name']} ({curve.model['dtype']}, prepacked {curve.model['prepacked']}{kv}) on "
             f"{curve.machine['cpu']} ({curve.machine['isa']}, {curve.machine['threads']} threads, torch "
             f"{curve.machine['torch']}; {curve.clock} clock)",
             f"{'new tokens':>10}" + "".join(f"{f'ms @ctx {c}':>14}{'x step':>8}" for c in curve.contexts)]
    for i, size in enumerate(curve.sizes):
        cells = "".join(f"{row[i] * 1e3:>14.2f}{row[i] / row[0]:>8.2f}" for row in curve.table)
        lines.append(f"{size:>10}{cells}")
    return lines
