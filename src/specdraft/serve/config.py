"""Settings of ``specdraft serve``, validated on construction (before any model loads)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specdraft.batching import MAX_TREE_NODES
from specdraft.drafters import NAMED_DRAFTERS, facts_of
from specdraft.errors import SpecdraftError
from specdraft.sampling import SamplingConfig
from specdraft.sequence import SPECULATION_HELP, GenerationConfig
from specdraft.serve.online_config import OnlineDistillConfig

TREE_SIZE_OPTIONS = ("tree_nodes", "max_nodes")  # drafter options that size a token tree


@dataclass(frozen=True)
class ServeConfig:
    """What the server loads and the limits it enforces."""

    target: str = field(metadata={"help": "target model (built-in name, folder or cached hub id)"})
    draft: str | None = field(default=None, metadata={"help": "draft model, or None"})
    drafter: str | None = field(default=None, metadata={"help": "training-free drafter name, or None"})
    drafter_options: tuple[tuple[str, str], ...] = field(default=(), metadata={"help": "drafter KEY=VALUE options"})
    dtype: str = field(default="auto", metadata={"help": "auto, float32 or bfloat16 (registry.choose_precision)"})
    quantize: str = field(default="auto", metadata={"help": "target weights: auto, none, gguf, int8 or int4"})
    served_model_name: str | None = field(default=None, metadata={"help": "model id clients ask for (default target)"})
    num_draft_tokens: int = field(default=4, metadata={"help": "γ: draft tokens per target forward (the most, with "
                                                                "adaptive speculation)"})
    speculation: str = field(default="adaptive", metadata={"help": SPECULATION_HELP})
    grammar_draft: bool = field(default=True, metadata={"help": "propose the tokens a request's grammar forces "
                                                                 "(response_format, a required or named tool_choice) "
                                                                 "as draft tokens; False: the drafter's alone"})
    max_batch: int = field(default=8, metadata={"help": "sequences decoded together"})
    prefix_cache: bool = field(default=True, metadata={"help": "a prompt reads the positions it shares with a running "
                                                                "or finished sequence's KV cache (where exact)"})
    max_draft_batch: int = field(default=0, metadata={"help": "draft only in steps of at most this many sequences; "
                                                               "0 = at every batch size"})
    max_queue: int = field(default=64, metadata={"help": "waiting sequences beyond the batch; more answer 429"})
    max_prompt_tokens: int = field(default=1024, metadata={"help": "longest prompt accepted"})
    max_tokens: int = field(default=512, metadata={"help": "largest max_tokens accepted"})
    max_n: int = field(default=4, metadata={"help": "most completions per request (n)"})
    max_body_bytes: int = field(default=1 << 20, metadata={"help": "largest request body; larger ones answer 413"})
    max_prompt_chars: int = field(default=0, metadata={"help": "most characters of prompt text, checked before "
                                                                 "tokenising; 0 = 32 x max_prompt_tokens"})
    shutdown_grace: float = field(default=5.0, metadata={"help": "seconds in-flight requests get after SIGTERM; "
                                                                 "the process exits within them"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on"})
    online_distill: OnlineDistillConfig | None = field(default=None, metadata={"help": "online distillation, or None"})

    def __post_init__(self) -> None:
        if self.draft and self.drafter:
            raise SpecdraftError("give either a draft model or a training-free drafter, not both")
        self.generation(1)  # num_draft_tokens, speculation and max_draft_batch, checked where every loop checks them
        if self.drafter in NAMED_DRAFTERS and not facts_of(NAMED_DRAFTERS[self.drafter]).batchable:
            raise SpecdraftError(f"the {self.drafter} drafter reads or drafts through the target's KV cache, which "
                                 "the server's batched decoding does not share; use it with specdraft generate")
        for name in ("max_batch", "max_prompt_tokens", "max_tokens", "max_n", "max_body_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise SpecdraftError(f"{name} must be an integer >= 1, got {getattr(self, name)}")
        if self.max_queue < 0 or self.max_prompt_chars < 0:
            raise SpecdraftError(f"max_queue and max_prompt_chars must be >= 0, got {self.max_queue}, "
                                 f"{self.max_prompt_chars}")
        self._check_tree_sizes()
        if not (isinstance(self.shutdown_grace, (int, float)) and math.isfinite(self.shutdown_grace)
                and 0 < self.shutdown_grace <= 3600):
            raise SpecdraftError(f"shutdown_grace must be in (0, 3600] seconds, got {self.shutdown_grace}")
        if self.online_distill is not None and not self.draft:
            raise SpecdraftError("--online-distill trains a draft model: give one with --draft "
                                 f"({self.drafter or 'no drafter'} cannot be trained)")
        if not 0 <= self.port <= 65535:
            raise SpecdraftError(f"port must be in 0 .. 65535, got {self.port}")

    def _check_tree_sizes(self) -> None:
        """Tree sizes a batched step can hold: a larger tree would be cut silently at every step."""
        for key, value in self.drafter_options:
            if key not in TREE_SIZE_OPTIONS:
                continue
            try:
                size = int(value)
            except ValueError:
                raise SpecdraftError(f"drafter option {key} must be an integer, got {value!r}") from None
            if not 0 <= size <= MAX_TREE_NODES:
                raise SpecdraftError(f"drafter option {key} must be in 0 .. {MAX_TREE_NODES} in batched decoding (the "
                                     f"server), got {size}")

    def generation(self, max_tokens: int, sampling: SamplingConfig | None = None, eos_token_ids: tuple[int, ...] = (),
                   stop_strings: tuple[str, ...] = ()) -> GenerationConfig:
        """A request's decoding settings: its own, and the server's speculation (the same vocabulary as
        ``specdraft generate``, ``bench`` and ``demo``)."""
        return GenerationConfig(max_tokens, self.num_draft_tokens, sampling or SamplingConfig(), eos_token_ids,
                                stop_strings, self.speculation, self.max_draft_batch, grammar_draft=self.grammar_draft)

    @property
    def model_id(self) -> str:
        return self.served_model_name or self.target

    @property
    def prompt_char_limit(self) -> int:
        """Most characters of prompt text a request may carry (checked before tokenising)."""
        return self.max_prompt_chars or 32 * self.max_prompt_tokens
