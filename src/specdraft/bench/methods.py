"""Benchmarked methods: each is an object with a ``name`` and ``answer(prompt_ids, config, generator) -> TurnResult``.

Method specs on the command line (``--methods ar,draft:PATH,prompt-lookup,hf,hf-assisted:PATH``) are looked up in
:data:`METHOD_KINDS` (plus every name in ``specdraft.drafters.NAMED_DRAFTERS``); the runner never branches on a name.

- ``ar``: plain decoding through specdraft's loop (the baseline; always run).
- ``draft:PATH``: a draft model (``specdraft.load_drafter(..., draft=PATH)``); ``draft:PATH;tree_branching=2;
  tree_nodes=12`` drafts a dynamic token tree.
- a ``NAMED_DRAFTERS`` name (``prompt-lookup``, ...): that drafter, optionally with options
  ``NAME:KEY=VALUE;KEY=VALUE`` (quote the semicolons in a shell).
- ``hf``: transformers' ``model.generate`` on the same weights and dtype.
- ``hf-assisted:PATH``: transformers' assisted generation with the draft model at PATH, with
  ``num_assistant_tokens`` = γ, schedule "constant" and ``assistant_confidence_threshold`` = 0.
- ``llama.cpp``: llama.cpp's plain decoding of the target's GGUF; ``llama.cpp-draft:DRAFT.gguf``,
  ``llama.cpp-eagle3:EAGLE3.gguf``, ``llama.cpp-dflash:DFLASH.gguf`` and ``llama.cpp-ngram:MODE``: llama.cpp's own
  speculative decoding with a draft model, EAGLE-3 heads, DFlash heads (a block per forward) or n-gram lookup, γ
  draft tokens unless the options say (``;n_max=2;p_min=0.75``;
  :mod:`specdraft.bench.llamacpp_spec`).
- ``vllm``, ``vllm-ngram``, ``vllm-draft:PATH``, ``vllm-eagle3:PATH``: vLLM's plain decoding, its n-gram lookup,
  an exported draft model, exported EAGLE-3 heads, γ draft tokens, one engine each (:mod:`specdraft.bench.vllm`).

With a sweep over num_draft_tokens, each speculative method becomes one variant per γ named ``NAME@γ=K``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from specdraft.decoding import PrefixCache, generate
from specdraft.drafters import NAMED_DRAFTERS, Drafter, facts_of, parse_options
from specdraft.drafters.combined import draft_model_of
from specdraft.drafters.loading import load_draft_model
from specdraft.drafters.registry import load_drafter
from specdraft.errors import SpecdraftError
from specdraft.models.native_llama import NativeLlama
from specdraft.models.registry import load_model
from specdraft.sequence import GenerationConfig, speculation_policy


@dataclass
class TurnResult:
    """What one method measured while answering one turn. None marks a quantity the method cannot measure."""

    token_ids: list[int]
    wall_time: float
    finish_reason: str | None = None
    decoding_steps: int | None = None  # target forward calls
    accept_lengths: list[int] | None = None  # tokens committed per target forward
    draft_seconds: float | None = None
    verify_seconds: float | None = None
    prefill_seconds: float | None = None  # the prompt's forward before the first step, inside wall_time
    draft_tokens_proposed: int | None = None
    draft_tokens_accepted: int | None = None
    accepted_per_position: list[int] | None = None
    reached_per_position: list[int] | None = None
    draft_length_counts: list[int] | None = None  # [n]: steps that verified n draft tokens
    engine_counters: dict | None = None  # another engine's own counters for this turn (vLLM's spec-decode metrics)


class Method(Protocol):
    """A benchmarked way of answering.

    ``num_draft_tokens`` is γ (None when the method drafts nothing); ``param_ratio`` is draft parameters / target
    parameters (0 for a training-free drafter, None when the method drafts nothing); ``base`` is the name before a
    sweep suffix; ``engine`` describes the build of another program that answers (llama.cpp), None for specdraft's
    and transformers' methods.
    """

    name: str
    base: str
    num_draft_tokens: int | None
    param_ratio: float | None
    engine: dict | None

    def answer(self, prompt_ids: Sequence[int], config: GenerationConfig, generator: torch.Generator) -> TurnResult:
        """Generate after ``prompt_ids`` (batch 1) under ``config`` (its num_draft_tokens is replaced by γ)."""
        ...


def count_parameters(model) -> int:
    """Unique parameters of a CausalLM (native module or transformers adapter)."""
    if isinstance(model, NativeLlama):
        return model.parameter_count
    module = model if hasattr(model, "parameters") else model.model
    return sum(p.numel() for p in module.parameters())


@dataclass
class SpecdraftMethod:
    """specdraft's decoding loop with a drafter (None: plain decoding, the ``ar`` baseline)."""

    name: str
    target: object
    drafter: Drafter | None
    num_draft_tokens: int | None = None
    param_ratio: float | None = None
    base: str = ""
    engine: dict | None = None
    speculation: str = "adaptive"  # specdraft.speculation: "adaptive" or "fixed"
    policy: object | None = field(default=None, repr=False)  # made on first use, learns across answers
    prefix_cache: PrefixCache | None = field(default=None, repr=False)  # this method's own, kept across answers

    def answer(self, prompt_ids: Sequence[int], config: GenerationConfig, generator: torch.Generator) -> TurnResult:
        if self.num_draft_tokens is not None:
            config = replace(config, num_draft_tokens=self.num_draft_tokens, speculation=self.speculation)
        if self.policy is None and self.drafter is not None:
            self.policy = speculation_policy(config, self.target, self.drafter)
        start = time.perf_counter()
        result = generate(self.target, prompt_ids, self.drafter, config, generator, policy=self.policy,
                          prefix_cache=self.prefix_cache)
        wall = time.perf_counter() - start
        s = result.stats
        return TurnResult(
            token_ids=result.token_ids, wall_time=wall, finish_reason=result.finish_reason,
            decoding_steps=s.target_forward_calls, accept_lengths=list(s.accept_lengths),
            draft_seconds=s.draft_seconds, verify_seconds=s.verify_seconds, prefill_seconds=s.prefill_seconds,
            draft_tokens_proposed=s.draft_tokens_proposed, draft_tokens_accepted=s.draft_tokens_accepted,
            accepted_per_position=list(s.accepted_per_position), reached_per_position=list(s.reached_per_position),
            draft_length_counts=list(s.draft_length_counts),
        )


@dataclass
class HFMethod:
    """transformers' ``generate``, plain or assisted (``assistant`` set). Target forward calls are counted with a
    forward pre-hook (decoding_steps); per-step accept lengths and the draft/verify split are not measurable."""

    name: str
    model: object  # a transformers PreTrainedModel
    assistant: object | None = None
    num_draft_tokens: int | None = None
    param_ratio: float | None = None
    base: str = ""
    engine: dict | None = None
    calls: int = field(default=0, repr=False)  # target forward calls of the current answer

    def __post_init__(self) -> None:
        self.model.register_forward_pre_hook(self._count)

    def _count(self, module, args) -> None:
        self.calls += 1

    def _kwargs(self, config: GenerationConfig, generator: torch.Generator) -> dict:
        eos = list(config.eos_token_ids) or None
        kwargs = {"max_new_tokens": config.max_new_tokens, "eos_token_id": eos,
                  "pad_token_id": eos[0] if eos else 0, "do_sample": not config.sampling.greedy}
        if not config.sampling.greedy:
            s = config.sampling
            kwargs |= {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p}
            torch.manual_seed(int(torch.randint(2**31 - 1, (1,), generator=generator)))  # transformers' global RNG
        if self.assistant is not None:
            gc = self.assistant.generation_config
            gc.num_assistant_tokens = self.num_draft_tokens
            gc.num_assistant_tokens_schedule = "constant"
            gc.assistant_confidence_threshold = 0.0
            kwargs["assistant_model"] = self.assistant
        return kwargs

    @torch.inference_mode()
    def answer(self, prompt_ids: Sequence[int], config: GenerationConfig, generator: torch.Generator) -> TurnResult:
        kwargs = self._kwargs(config, generator)
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.model.device)  # (1, N)
        self.calls = 0
        start = time.perf_counter()
        out = self.model.generate(ids, **kwargs)
        wall = time.perf_counter() - start
        tokens = out[0, ids.shape[1] :].tolist()
        reason = "eos" if tokens and tokens[-1] in config.eos_token_ids else "length"
        return TurnResult(token_ids=tokens, wall_time=wall, finish_reason=reason, decoding_steps=self.calls)


@dataclass
class LlamaCppMethod:
    """llama.cpp answering through a ``llama-server`` (:mod:`specdraft.bench.llamacpp`); ``num_draft_tokens`` is γ
    when the server has a draft model."""

    name: str
    server: object  # a specdraft.bench.llamacpp.LlamaServer
    num_draft_tokens: int | None = None
    param_ratio: float | None = None
    base: str = ""
    cache_prompt: bool = False  # the server reuses its last prompt's shared prefix (llama-server's cache_prompt)

    @property
    def engine(self) -> dict:
        """The server's llama.cpp build (:func:`specdraft.bench.llamacpp_build.build_summary`)."""
        return self.server.build

    def answer(self, prompt_ids: Sequence[int], config: GenerationConfig, generator: torch.Generator) -> TurnResult:
        from specdraft.bench.llamacpp import completion_payload, turn_result

        seed = int(torch.randint(2**31 - 1, (1,), generator=generator))
        payload = completion_payload(prompt_ids, config, seed, self.cache_prompt)
        start = time.perf_counter()
        answer = self.server.complete(payload)
        wall = time.perf_counter() - start
        return turn_result(answer, wall, config.eos_token_ids, self.num_draft_tokens is not None, TurnResult)


@dataclass
class VllmMethod:
    """vLLM answering through its offline engine in a subprocess (:mod:`specdraft.bench.vllm`); ``num_draft_tokens``
    is γ when the engine speculates."""

    name: str
    worker: object  # a specdraft.engines.vllm.VllmEngine
    num_draft_tokens: int | None = None
    param_ratio: float | None = None
    base: str = ""

    @property
    def engine(self) -> dict:
        """The vLLM engine's version and settings, recorded with each answer."""
        return {"name": "vllm", "version": self.worker.version, "speculative": self.worker.settings.speculative,
                "dtype": self.worker.settings.dtype}

    def answer(self, prompt_ids: Sequence[int], config: GenerationConfig, generator: torch.Generator) -> TurnResult:
        from specdraft.bench.vllm import sampling_fields, turn_result

        seed = int(torch.randint(2**31 - 1, (1,), generator=generator))
        fields = sampling_fields(config.max_new_tokens, config.eos_token_ids, config.sampling, seed)
        start = time.perf_counter()
        answer = self.worker.generate([prompt_ids], [fields])
        wall = time.perf_counter() - start
        return turn_result(answer, wall, config.eos_token_ids, self.num_draft_tokens is not None, TurnResult)


@dataclass(frozen=True)
class BuildContext:
    """What a method builder needs: the loaded target, its tokenizer, dtype, and lazily the transformers copy."""

    target: object
    tokenizer: object
    target_name: str
    dtype: torch.dtype
    cache: dict = field(default_factory=dict)
    speculations: tuple[str, ...] = ("adaptive",)  # policies every speculative method runs with
    device: str = "cpu"  # where the models run
    prefix_cache: bool = True  # each specdraft method keeps its target cache across answers; llama.cpp cache_prompt

    def method(self, name: str, drafter: Drafter | None, k: int | None = None, ratio: float | None = None,
               base: str = "") -> SpecdraftMethod:
        """A specdraft method on the target, with its own prefix cache where the run keeps them."""
        return SpecdraftMethod(name, self.target, drafter, k, ratio, base or name,
                               prefix_cache=PrefixCache() if self.prefix_cache else None)

    def hf_target(self):
        """The target's weights as a transformers model (loaded once, shared by ``hf`` and ``hf-assisted``)."""
        if "hf" not in self.cache:
            self.cache["hf"] = load_model(self.target_name, self.dtype, backend="hf", device=self.device).model
        return self.cache["hf"]

    def param_ratio(self, draft_model) -> float:
        if "target_params" not in self.cache:
            self.cache["target_params"] = count_parameters(self.target)
        return count_parameters(draft_model) / self.cache["target_params"]


def _variants(base: str, gammas: Sequence[int], sweep: bool, make: Callable[[str, int], Method],
              speculations: Sequence[str] = ("adaptive",)) -> list[Method]:
    """One method per γ (named ``BASE@γ=K`` in a sweep) and per speculation policy (``BASE+fixed`` when more than
    one policy runs; the adaptive one keeps the plain name)."""
    methods = []
    for k in gammas:
        for speculation in speculations:
            suffix = f"+{speculation}" if len(speculations) > 1 and speculation != "adaptive" else ""
            name = (f"{base}@γ={k}" if sweep else base) + suffix
            method = make(name, k)
            if isinstance(method, SpecdraftMethod):
                method.speculation = speculation
            methods.append(method)
    return methods


def _build_ar(ctx: BuildContext, spec: str, arg: str | None, gammas, sweep) -> list[Method]:
    return [ctx.method(spec, None)]


def _build_draft(ctx: BuildContext, spec: str, arg: str | None, gammas, sweep) -> list[Method]:
    path, _, options = arg.partition(";")  # draft:PATH;tree_branching=2;tree_nodes=12
    drafter = load_drafter(ctx.target, ctx.tokenizer, draft=path, dtype=ctx.dtype, options=parse_options(options))
    ratio = ctx.param_ratio(draft_model_of(drafter).model)
    return _variants(spec, gammas, sweep, lambda name, k: ctx.method(name, drafter, k, ratio, spec), ctx.speculations)


def _build_training_free(ctx: BuildContext, spec: str, arg: str | None, gammas, sweep) -> list[Method]:
    name = spec.partition(":")[0]
    if ctx.device != "cpu" and facts_of(NAMED_DRAFTERS[name]).cpu_only:
        raise SpecdraftError(f"method {name!r} drafts on the CPU beside a CPU target; run the bench with --device cpu")
    drafter = load_drafter(ctx.target, ctx.tokenizer, drafter=name, options=parse_options(arg))
    return _variants(spec, gammas, sweep, lambda name, k: ctx.method(name, drafter, k, 0.0, spec), ctx.speculations)


def _build_hf(ctx: BuildContext, spec: str, arg: str | None, gammas, sweep) -> list[Method]:
    return [HFMethod(spec, ctx.hf_target(), base=spec)]


def _build_hf_assisted(ctx: BuildContext, spec: str, arg: str | None, gammas, sweep) -> list[Method]:
    wrapped = load_draft_model(ctx.target, ctx.tokenizer, arg, ctx.dtype, backend="hf")  # the checks of draft:PATH
    assistant, model = wrapped.model, ctx.hf_target()
    ratio = count_parameters(assistant) / count_parameters(model)
    return _variants(spec, gammas, sweep, lambda name, k: HFMethod(name, model, assistant, k, ratio, spec))


def _build_llama_cpp(ctx: BuildContext, spec: str, arg: str | None, gammas, sweep) -> list[Method]:
    from specdraft.bench.llamacpp import LlamaServer
    from specdraft.models.gguf_files import target_gguf_file

    return [LlamaCppMethod(spec, LlamaServer(target_gguf_file(ctx.target_name)), base=spec,
                           cache_prompt=ctx.prefix_cache)]


def _build_llama_cpp_spec(ctx: BuildContext, spec: str, arg: str | None, gammas, sweep) -> list[Method]:
    """llama.cpp-draft, llama.cpp-eagle3, llama.cpp-dflash, llama.cpp-ngram: one llama-server per setting (per γ
    where the options leave n_max to γ)."""
    from specdraft.bench.llamacpp import LlamaServer, draft_param_ratio
    from specdraft.bench.llamacpp_spec import check_draft_file, fixed_length, parse_speculation
    from specdraft.models.gguf_files import target_gguf_file

    kind, target = spec.partition(":")[0], target_gguf_file(ctx.target_name)
    first = parse_speculation(kind, arg, gammas[0])
    ratio = 0.0
    if first.draft is not None:
        check_draft_file(first, target, spec)
        ratio = draft_param_ratio(first.draft, target)

    def make(name: str, k: int) -> Method:
        speculation = parse_speculation(kind, arg, k)
        return LlamaCppMethod(name, LlamaServer(target, speculation), speculation.num_draft_tokens, ratio, spec,
                              cache_prompt=ctx.prefix_cache)

    return [make(spec, gammas[0])] if fixed_length(kind, arg) else _variants(spec, gammas, sweep, make)


def _build_vllm(ctx: BuildContext, spec: str, arg: str | None, gammas, sweep) -> list[Method]:
    from specdraft.bench.vllm import SPEC_METHODS, parameter_count, speculative_config, start_engine
    from specdraft.models.registry import resolve

    kind, target = spec.partition(":")[0], str(resolve(ctx.target_name))
    if SPEC_METHODS[kind] is None:
        return [VllmMethod(spec, start_engine(target, ctx.dtype, kind, None, None), base=spec)]
    speculative_config(kind, arg, 1)  # the path and options, checked before any engine starts
    ratio = 0.0 if kind == "vllm-ngram" else parameter_count(arg) / parameter_count(target)
    return _variants(spec, gammas, sweep, lambda name, k: VllmMethod(
        name, start_engine(target, ctx.dtype, kind, arg, k), k, ratio, spec))


def _check_llama_cpp_spec(kind: str, arg: str | None) -> object:
    from specdraft.bench.llamacpp_spec import parse_speculation

    return parse_speculation(kind, arg)


@dataclass(frozen=True)
class MethodKind:
    """How to build one kind of method; ``needs_path``: the spec is ``KIND:PATH``."""

    build: Callable[..., list[Method]]
    needs_path: bool = False
    takes_options: bool = False  # training-free drafters: NAME:KEY=VALUE;KEY=VALUE
    check: Callable[[str, str | None], object] | None = None  # checks NAME and ARG before any method is built


METHOD_KINDS: dict[str, MethodKind] = {
    "ar": MethodKind(_build_ar),
    "draft": MethodKind(_build_draft, needs_path=True),
    "hf": MethodKind(_build_hf),
    "hf-assisted": MethodKind(_build_hf_assisted, needs_path=True),
    "llama.cpp": MethodKind(_build_llama_cpp),
    "llama.cpp-draft": MethodKind(_build_llama_cpp_spec, needs_path=True, check=_check_llama_cpp_spec),
    "llama.cpp-eagle3": MethodKind(_build_llama_cpp_spec, needs_path=True, check=_check_llama_cpp_spec),
    "llama.cpp-dflash": MethodKind(_build_llama_cpp_spec, needs_path=True, check=_check_llama_cpp_spec),
    "llama.cpp-ngram": MethodKind(_build_llama_cpp_spec, takes_options=True, check=_check_llama_cpp_spec),
    "vllm": MethodKind(_build_vllm),
    "vllm-ngram": MethodKind(_build_vllm, takes_options=True),
    "vllm-draft": MethodKind(_build_vllm, needs_path=True),
    "vllm-eagle3": MethodKind(_build_vllm, needs_path=True),
}
BASELINE = "ar"


def _kind(spec: str) -> tuple[MethodKind, str | None]:
    name, _, arg = spec.partition(":")
    kind = METHOD_KINDS.get(name) or (MethodKind(_build_training_free, takes_options=True)
                                      if name in NAMED_DRAFTERS else None)
    if kind is None:
        known = [*METHOD_KINDS, *NAMED_DRAFTERS]
        raise SpecdraftError(f"unknown method {spec!r}; known: {', '.join(known)} "
                             "(draft, hf-assisted, llama.cpp-draft, llama.cpp-eagle3, llama.cpp-dflash, vllm-draft and "
                             "vllm-eagle3 take :PATH, llama.cpp-ngram a :MODE)")
    if kind.needs_path and not arg:
        raise SpecdraftError(f"method {name!r} needs a draft model: {name}:PATH")
    if not kind.needs_path and not kind.takes_options and arg:
        raise SpecdraftError(f"method {name!r} takes no argument, got {spec!r}")
    if kind.check is not None:
        kind.check(name, arg or None)
    return kind, arg or None


def parse_methods(text: str | Sequence[str]) -> list[str]:
    """Validated method specs, ``ar`` first (added when missing), duplicates dropped."""
    specs = [s.strip() for s in (text.split(",") if isinstance(text, str) else text) if s.strip()]
    for spec in specs:
        _kind(spec)
    return list(dict.fromkeys([BASELINE, *specs]))


def build_methods(ctx: BuildContext, specs: Sequence[str], gammas: Sequence[int], sweep: bool) -> list[Method]:
    """Build every method once; a speculative method yields one variant per γ in ``gammas``."""
    methods: list[Method] = []
    for spec in parse_methods(specs):
        kind, arg = _kind(spec)
        methods += kind.build(ctx, spec, arg, gammas, sweep)
    return methods
