"""The benchmark's configuration: one validated dataclass, built by ``specdraft bench`` or by hand."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from specdraft.bench.methods import parse_methods
from specdraft.bench.questions import BUILTIN, CATEGORY_TO_SUBTASK, SUBTASKS
from specdraft.drafters import NAMED_DRAFTERS
from specdraft.errors import SpecdraftError
from specdraft.models.registry import DTYPE_CHOICES, QUANTIZE, SMOLLM2
from specdraft.sampling import SamplingConfig
from specdraft.sequence import GenerationConfig
from specdraft.speculation import SPECULATION

SWEEPABLE = ("num_draft_tokens",)


def default_methods() -> tuple[str, ...]:
    """``ar`` and every drafter chosen by name."""
    return ("ar", *NAMED_DRAFTERS)


@dataclass(frozen=True)
class BenchConfig:
    """Everything that determines a benchmark run's answers (``out`` says only where they go)."""

    out: str = field(metadata={"help": "output folder: run.json, answers/<method>.jsonl, summary.*, plots"})
    target: str = field(default=SMOLLM2, metadata={"help": "target model: built-in name, folder or cached hub id"})
    methods: tuple[str, ...] = field(default_factory=default_methods, metadata={"help": "method specs; ar is added"})
    questions: str = field(default=BUILTIN,
                           metadata={"help": "Spec-Bench-format JSONL file, 'builtin', or 'sharegpt-heldout'"})
    categories: tuple[str, ...] | None = field(default=None, metadata={"help": "subtasks (or categories) to keep"})
    per_category: int | None = field(default=None, metadata={"help": "first N questions of each subtask"})
    max_new_tokens: int = field(default=128, metadata={"help": "most tokens per turn"})
    num_draft_tokens: int = field(default=4, metadata={"help": "γ for every speculative method (without a sweep)"})
    sweep: tuple[int, ...] | None = field(default=None, metadata={"help": "γ values to sweep (num_draft_tokens=...)"})
    repeats: int = field(default=1, metadata={"help": "timing repeats per (question, method)"})
    dtype: str = field(default="auto", metadata={
        "help": "auto (a GGUF target's own blocks, else bfloat16), float32 or bfloat16 (dense target and drafters)"})
    quantize: str = field(default="auto", metadata={"help": "target weights: auto, none, gguf, int8 or int4"})
    device: str = field(default="cpu", metadata={"help": "where the target and draft models run (cpu, cuda:N)"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy"})
    top_k: int = field(default=0, metadata={"help": "0 = off"})
    top_p: float = field(default=1.0, metadata={"help": "1 = off"})
    seed: int = field(default=0, metadata={"help": "each answer's generator is seeded with this"})
    speculation: tuple[str, ...] = field(default=("adaptive",), metadata={
        "help": "policies every speculative method runs with (adaptive, fixed); NAME+fixed names the fixed one"})
    prefix_cache: bool = field(default=True, metadata={
        "help": "each method keeps its cache across answers and reads the prefix a prompt shares with the last one "
                "(specdraft's PrefixCache where exact, llama-server's cache_prompt)"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "methods", tuple(parse_methods(self.methods)))
        if self.dtype not in DTYPE_CHOICES or self.quantize not in QUANTIZE:
            raise SpecdraftError(f"dtype must be one of {', '.join(DTYPE_CHOICES)} and quantize one of "
                                 f"{', '.join(QUANTIZE)}, got {self.dtype!r} and {self.quantize!r}")
        GenerationConfig(self.max_new_tokens, self.num_draft_tokens, self.sampling)  # validates all three
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise SpecdraftError(f"repeats must be an integer >= 1, got {self.repeats}")
        if self.per_category is not None and (not isinstance(self.per_category, int) or self.per_category < 1):
            raise SpecdraftError(f"per_category must be an integer >= 1, got {self.per_category}")
        if self.sweep is not None and (not self.sweep or any(not isinstance(k, int) or k < 1 for k in self.sweep)):
            raise SpecdraftError(f"sweep num_draft_tokens values must be integers >= 1, got {self.sweep}")
        if not self.speculation or set(self.speculation) - set(SPECULATION):
            raise SpecdraftError(f"speculation must list some of {', '.join(SPECULATION)}, got {self.speculation}")
        unknown = sorted(set(self.categories or ()) - set(CATEGORY_TO_SUBTASK))
        if unknown:
            raise SpecdraftError(f"unknown category {', '.join(unknown)}; subtasks: {', '.join(SUBTASKS)}")

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p)

    @property
    def gammas(self) -> tuple[int, ...]:
        """The γ values each speculative method runs at."""
        return self.sweep or (self.num_draft_tokens,)

    def identity(self) -> dict:
        """The fields a resumed run must share with the run it continues (all but ``out``)."""
        fields = asdict(self)
        del fields["out"]
        if fields["device"] == "cpu":  # runs made before the option stay resumable
            del fields["device"]
        return {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}


def parse_sweep(text: str) -> tuple[int, ...]:
    """``num_draft_tokens=1,2,3`` -> (1, 2, 3), de-duplicated, in the order given."""
    key, sep, values = text.partition("=")
    if not sep or key.strip() not in SWEEPABLE:
        raise SpecdraftError(f"--sweep must look like num_draft_tokens=1,2,4, got {text!r}")
    try:
        gammas = tuple(dict.fromkeys(int(v) for v in values.split(",") if v.strip()))
    except ValueError:
        raise SpecdraftError(f"--sweep values must be integers, got {values!r}") from None
    if not gammas or min(gammas) < 1:
        raise SpecdraftError(f"--sweep num_draft_tokens values must be integers >= 1, got {values!r}")
    return gammas


def parse_list(text: str | None) -> tuple[str, ...] | None:
    """Comma-separated names, or None for an empty/missing value."""
    items = tuple(s.strip() for s in (text or "").split(",") if s.strip())
    return items or None
