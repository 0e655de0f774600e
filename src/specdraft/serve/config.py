"""Settings of ``specdraft serve``, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdraft.errors import SpecdraftError
from specdraft.serve.online_config import OnlineDistillConfig


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
    num_draft_tokens: int = field(default=4, metadata={"help": "γ: draft tokens per target forward"})
    max_batch: int = field(default=8, metadata={"help": "sequences decoded together"})
    max_draft_batch: int = field(default=0, metadata={"help": "draft only in steps of at most this many sequences; "
                                                               "0 = always"})
    batch_speculation: str = field(default="adaptive", metadata={"help": "adaptive: steps of several sequences draft "
                                                                         "only where that measured faster; always"})
    max_queue: int = field(default=64, metadata={"help": "waiting sequences beyond the batch; more answer 429"})
    max_prompt_tokens: int = field(default=1024, metadata={"help": "longest prompt accepted"})
    max_tokens: int = field(default=512, metadata={"help": "largest max_tokens accepted"})
    max_n: int = field(default=4, metadata={"help": "most completions per request (n)"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on"})
    online_distill: OnlineDistillConfig | None = field(default=None, metadata={"help": "online distillation, or None"})

    def __post_init__(self) -> None:
        if self.draft and self.drafter:
            raise SpecdraftError("give either a draft model or a training-free drafter, not both")
        for name in ("num_draft_tokens", "max_batch", "max_prompt_tokens", "max_tokens", "max_n"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise SpecdraftError(f"{name} must be an integer >= 1, got {getattr(self, name)}")
        if self.max_queue < 0 or self.max_draft_batch < 0:
            raise SpecdraftError(f"max_queue and max_draft_batch must be >= 0, got {self.max_queue}, "
                                 f"{self.max_draft_batch}")
        if self.batch_speculation not in ("adaptive", "always"):
            raise SpecdraftError(f"batch_speculation must be adaptive or always, got {self.batch_speculation!r}")
        if self.online_distill is not None and not self.draft:
            raise SpecdraftError("--online-distill trains a draft model: give one with --draft "
                                 f"({self.drafter or 'no drafter'} cannot be trained)")
        if not 0 <= self.port <= 65535:
            raise SpecdraftError(f"port must be in 0 .. 65535, got {self.port}")

    @property
    def model_id(self) -> str:
        return self.served_model_name or self.target
