"""One sequence's decoding, the same whether it runs alone (:mod:`specdraft.decoding`) or in a batch
(:mod:`specdraft.batching`): its settings (:class:`GenerationConfig`), its checks, its speculation policy
(:func:`speculation_policy`, the one place that chooses one), and its state (:class:`SequenceState`): setup
(:meth:`SequenceState.start`), prefill, each step's draft (:meth:`SequenceState.propose`), commit, result.

A loop only decides where a sequence's positions live (a cache of its own, or a row of a batched cache, both seen
through a :class:`specdraft.step.StepTarget`) and how many sequences share each forward; everything a sequence does
between two forwards is here, once (vLLM V1's per-request state, one scheduler step for batch 1 and batch N).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from specdraft.costs import cost_curve
from specdraft.drafters.base import (
    Draft,
    Drafter,
    NoDrafter,
    TargetFeatures,
    facts_of,
    share_target_cache,
    target_features,
)
from specdraft.drafters.grammar_draft import GrammarDrafter
from specdraft.errors import SpecdraftError
from specdraft.grammar import grammar_cut
from specdraft.models.base import CausalLM, KVCache
from specdraft.sampling import (
    ClosesAtBudget,
    DraftChecker,
    ForcesTokens,
    ForkingProcessor,
    LogitsProcessor,
    SamplingConfig,
)
from specdraft.speculation import SPECULATION, AdaptivePolicy, FixedPolicy, SpeculationPolicy, StepBounds, propose
from specdraft.stats import GenerationStats
from specdraft.step import STEP_ROOM, StepInput, StepResult, StepTarget
from specdraft.stopping import Stopper
from specdraft.trees import keep_nodes

MAX_NUM_DRAFT_TOKENS = STEP_ROOM // 2 - 1  # the largest γ: a step's draft and its padding fit in STEP_ROOM slots

SPECULATION_HELP = ("adaptive (default): each step proposes the draft that maximises expected tokens/s under this "
                    "machine's measured costs, down to none, at the batch size it runs in (sampled text is exact in "
                    "distribution, but draft lengths follow timings, so a seed replays it only with fixed); fixed: "
                    "always num_draft_tokens")


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings, validated on construction; the same for batch-1 decoding, batches, the bench and the
    server."""

    max_new_tokens: int = field(default=128, metadata={"help": "most tokens to generate"})
    num_draft_tokens: int = field(default=4, metadata={
        "help": f"γ: draft tokens proposed per target forward (the most, with adaptive speculation), at most "
                f"{MAX_NUM_DRAFT_TOKENS}"})
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eos_token_ids: tuple[int, ...] = field(default=(), metadata={"help": "ids that end generation (kept)"})
    stop_strings: tuple[str, ...] = field(default=(), metadata={"help": "texts that end generation (kept)"})
    speculation: str = field(default="adaptive", metadata={"help": SPECULATION_HELP})
    max_draft_batch: int = field(default=0, metadata={
        "help": "draft only in steps that decode at most this many sequences together, plainly in fuller ones "
                "(as vLLM's speculative_disable_by_batch_size); 0 = at every batch size"})
    logits_processor: LogitsProcessor | None = field(default=None, metadata={
        "help": "changes the target's logits before warping at every verified position (logit bias, penalties); "
                "None = none"})
    grammar_draft: bool = field(default=False, metadata={
        "help": "propose the tokens a grammar forces (logits_processor) as draft tokens, before or inside the "
                "drafter's draft; verified like any draft"})

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise SpecdraftError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens}")
        if not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 1:
            raise SpecdraftError(f"num_draft_tokens must be an integer >= 1, got {self.num_draft_tokens}")
        if self.num_draft_tokens > MAX_NUM_DRAFT_TOKENS:
            raise SpecdraftError(f"num_draft_tokens must be at most {MAX_NUM_DRAFT_TOKENS} (what one step's cache "
                                 f"room holds), got {self.num_draft_tokens}")
        if self.speculation not in SPECULATION:
            raise SpecdraftError(f"speculation must be one of {', '.join(SPECULATION)}, got {self.speculation!r}")
        if not isinstance(self.max_draft_batch, int) or self.max_draft_batch < 0:
            raise SpecdraftError(f"max_draft_batch must be an integer >= 0 (0 = always draft), got "
                                 f"{self.max_draft_batch}")


@dataclass
class GenerationResult:
    """Generated ids (prompt excluded), why generation ended, the stats of this generation, and whether a grammar
    closed the answer early to keep it complete within ``max_new_tokens`` (:mod:`specdraft.grammar`)."""

    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats
    closed_at_budget: bool = False


def speculation_policy(config: GenerationConfig, target: CausalLM | None, drafter: Drafter | None = None,
                       log: Callable[[str], None] | None = None) -> SpeculationPolicy:
    """The speculation policy ``config`` asks for, the one place that makes one: none drafted without a drafter;
    ``fixed``: γ every step (:class:`~specdraft.speculation.FixedPolicy`); ``adaptive``: the draft that maximises
    expected tokens/s (:class:`~specdraft.speculation.AdaptivePolicy`), priced by ``target``'s cost curve on this
    machine (measured once, then cached; ``log`` hears about a measurement) at the batch size of each step. Both
    stop drafting in steps of more than ``config.max_draft_batch`` sequences, when that is set."""
    if drafter is None or isinstance(drafter, NoDrafter):
        return FixedPolicy(0)
    if config.speculation == "fixed":
        return FixedPolicy(config.num_draft_tokens, config.max_draft_batch)
    if target is None:
        raise SpecdraftError("adaptive speculation prices each step by the target's measured costs: give the target")
    return AdaptivePolicy(cost_curve(target, log=log), config.num_draft_tokens, max_sequences=config.max_draft_batch,
                          one_forward_draft=facts_of(drafter).one_forward_draft)


def check_inputs(prompt_ids: Sequence[int] | torch.Tensor, target: CausalLM, drafter: Drafter, max_new: int,
                 capacity: int | None = None) -> torch.Tensor:
    """The prompt as a (N,) long tensor, after checking it and the drafter against the target (a clear error for an
    empty prompt, an id out of range, a context too long for the target, the drafter or the caller's ``capacity``,
    a vocabulary mismatch)."""
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()  # (N,)
    if prompt.numel() == 0:
        raise SpecdraftError("empty prompt: give at least one token")
    if int(prompt.min()) < 0 or int(prompt.max()) >= target.vocab_size:
        raise SpecdraftError(f"prompt token id out of range for the target vocabulary of {target.vocab_size}")
    limits = (("the target model's", target.max_context), ("the draft model's", drafter.max_context),
              ("the batch's", capacity))
    for who, limit in limits:
        if limit is not None and prompt.numel() + max_new > limit:
            raise SpecdraftError(f"prompt too long: {prompt.numel()} prompt tokens + max_new_tokens {max_new} exceed "
                                 f"{who} context of {limit}")
    if drafter.vocab_size is not None and drafter.vocab_size != target.vocab_size:
        raise SpecdraftError(
            f"vocabulary mismatch: target {target.name!r} has {target.vocab_size} logits, "
            f"drafter {drafter.name!r} has {drafter.vocab_size}"
        )
    return prompt


def reads_prefix_exactly(target: CausalLM) -> bool:
    """Whether ``target``'s cache kept from an earlier sequence can serve a later prompt's shared start with the
    answer unchanged bit for bit (the GGUF blocks' row-invariant prefill and steps): where both decoding loops keep
    and read prefixes (:class:`specdraft.decoding.PrefixCache`, :class:`specdraft.batching.BatchDecoder`)."""
    return bool(getattr(target, "reads_prefix_exactly", False))


@dataclass(eq=False)
class SequenceState:
    """One sequence being decoded: its settings, drafter, policy and generator, what it has generated so far, and
    where it is (``row`` of a batch, 0 alone). Made by :meth:`start`; compared by identity."""

    prompt: torch.Tensor  # (L,)
    config: GenerationConfig
    drafter: Drafter
    policy: SpeculationPolicy  # how much it drafts each step
    generator: torch.Generator | None
    stopper: Stopper
    cache: KVCache  # what the drafter's ``begin`` got for the target's cache
    max_context: int  # the target's positions
    context: torch.Tensor  # (N,) prompt and committed tokens
    features: TargetFeatures | None = None  # the target features its drafter reads, if any
    generated: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    finish_reason: str | None = None
    prompt_features: torch.Tensor | None = None  # (L - 1, D) until the first step hands them to the drafter
    started: float = 0.0
    row: int = 0
    tag: object = None  # the caller's handle (a request, an index)
    error: Exception | None = None  # why this sequence alone failed (finish_reason "error"); a batch went on
    processor: LogitsProcessor | None = None  # the config's logits processor, this sequence's own fork of it

    @classmethod
    def start(cls, target: CausalLM, prompt_ids: Sequence[int] | torch.Tensor, drafter: Drafter | None,
              config: GenerationConfig | None, generator: torch.Generator | None, tokenizer,
              policy: SpeculationPolicy | None, new_cache: Callable[[int], KVCache],
              capacity: int | None = None) -> SequenceState:
        """Set a sequence up: check its prompt and drafter against the target (and ``capacity``, a batch's
        positions per row), its stopper, its policy (``policy``, else :func:`speculation_policy` of ``config``),
        then the drafter's ``begin`` with ``new_cache(positions needed)``: the sequence's own cache, or a stand-in
        for a batch row. A drafter that reads the target's cache gets read access to it (or a clear error)."""
        config = config or GenerationConfig()
        drafter = drafter or NoDrafter()
        prompt = check_inputs(prompt_ids, target, drafter, config.max_new_tokens, capacity)
        stopper = Stopper(config.max_new_tokens, config.eos_token_ids, config.stop_strings, tokenizer)
        processor = config.logits_processor
        if isinstance(processor, ForkingProcessor):  # a grammar matcher per sequence, closed within its budget
            processor = processor.fork(config.max_new_tokens)
        if config.grammar_draft and isinstance(processor, ForcesTokens):  # shares the sequence's matcher
            drafter = GrammarDrafter(drafter, processor, prompt.numel(), config.eos_token_ids)
        policy = policy if policy is not None else speculation_policy(config, target, drafter)
        cache = new_cache(prompt.numel() + config.max_new_tokens)
        drafter.begin(target, cache)
        share_target_cache(drafter, cache)  # GliDe reads the target's keys and values
        return cls(prompt, config, drafter, policy, generator, stopper, cache, target.max_context, prompt,
                   target_features(drafter), processor=processor)  # Medusa / EAGLE read the target's features

    def prefill(self, target: StepTarget, cached: int = 0) -> None:
        """Feed all of the prompt but its last token, on the causal path, before the first step (as gpt-fast does):
        every step then feeds one uncached token and its draft, and a tree step never runs its masked forward over
        a long prompt. Keeps the prompt's features for the first step when the drafter reads them. ``cached``: the
        prompt's first tokens already in the cache (a kept prefix, :class:`specdraft.decoding.PrefixCache`), not fed
        again (never with a drafter that reads the prompt's features)."""
        self.started = time.perf_counter()
        self.stats.prompt_tokens_cached = cached
        if self.prompt.shape[0] - 1 > cached:
            self.prompt_features = target.prefill(self.row, self.prompt[cached:-1])  # (L - 1 - cached, D) or None
        self.stats.prefill_seconds = time.perf_counter() - self.started

    def propose(self, cached: int, room: int, sequences: int = 1) -> Draft:
        """This step's draft, decided by the policy (:func:`specdraft.speculation.propose`): ``cached`` of the
        context's tokens are in the target's cache, ``room`` nodes fit beside the uncached tail, ``sequences``
        share the step's forward."""
        length = self.context.shape[0]
        bounds = StepBounds(self.config.max_new_tokens - len(self.generated) - 1, room,
                            self.max_context - 1 - length, sequences)
        draft = propose(self.policy, self.drafter, self.context, cached, bounds, self.config.sampling,
                        self.generator)
        return self._cut_refused(draft)

    def _cut_refused(self, draft: Draft) -> Draft:
        """``draft`` without what the processor forbids outright (a grammar), where dropping it is exact
        (:func:`specdraft.grammar.grammar_cut`)."""
        if len(draft) == 0 or self.processor is None or not isinstance(self.processor, DraftChecker):
            return draft
        allowed = self.processor.allowed_nodes(self.context[self.prompt.shape[0]:], draft.tokens, draft.parents)
        keep = grammar_cut(allowed, draft.parents, self.config.sampling.greedy or draft.q is None)  # (n,)
        if bool(keep.all()):
            return draft
        if draft.parents is None:
            return draft.select(keep.nonzero().flatten(), None)
        kept, parents = keep_nodes(draft.parents, keep)
        return draft.select(kept, parents)

    def step_input(self, draft: Draft) -> StepInput:
        """This sequence's part of a step that verifies ``draft``."""
        return StepInput(self.context, draft, self.config.sampling, self.generator, self.processor,
                         self.prompt.shape[0])

    def commit(self, draft: Draft, step: StepResult, draft_seconds: float, verify_seconds: float) -> list[int]:
        """Take the verified step: the tokens up to EOS, a stop string or ``max_new_tokens`` join the context, the
        drafter, the policy and the stats learn of the step. Returns the tokens committed."""
        result = step.result
        if self.prompt_features is not None and result.hidden is not None:  # the drafter sees the prompt's features
            result = replace(result, hidden=torch.cat([self.prompt_features, result.hidden]))  # with the first step's
            self.prompt_features = None
        keep, self.finish_reason = self.stopper.scan(self.generated, step.tokens)
        new = step.tokens[:keep] + self._certain_stop(step.tokens[:keep])
        self.generated += new
        self.context = torch.cat([self.context, torch.tensor(new, dtype=torch.long)])
        self.drafter.observe(result)
        self.policy.observe(draft, result, draft_seconds, verify_seconds)
        self.stats.record_step(result, len(new), draft_s=draft_seconds, verify_s=verify_seconds)
        return new

    def _certain_stop(self, new: list[int]) -> list[int]:
        """With the grammar drafter, the stop token its grammar leaves as the only token after ``new`` ([] when
        there is none, or the sequence has ended): p there is a point mass on it, so the sequence ends now, as
        decoding it would, without the target forward that would only confirm it."""
        if self.finish_reason is not None or not self.config.grammar_draft or \
                not isinstance(self.processor, ForcesTokens):
            return []
        generated = torch.tensor(self.generated + new, dtype=torch.long)  # (G,)
        stop = self.processor.certain_stop(generated)
        if stop is None:
            return []
        keep, self.finish_reason = self.stopper.scan(self.generated + new, [stop])
        return [stop][:keep]

    def finish(self, now: float) -> None:
        """The sequence has ended (finished, failed or abandoned) at ``now`` (``time.perf_counter``)."""
        self.stats.decode_seconds = now - self.started

    def result(self) -> GenerationResult:
        return GenerationResult(list(self.generated), self.finish_reason or "length", self.stats,
                                self.closed_at_budget())

    def closed_at_budget(self) -> bool:
        """Whether the processor closed the answer early to keep it complete within the budget (a grammar)."""
        return isinstance(self.processor, ClosesAtBudget) and self.processor.closed_at_budget(
            torch.tensor(self.generated, dtype=torch.long))


__all__ = ["MAX_NUM_DRAFT_TOKENS", "SPECULATION_HELP", "GenerationConfig", "GenerationResult", "SequenceState",
           "check_inputs", "speculation_policy"]
