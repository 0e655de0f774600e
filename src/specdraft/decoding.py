"""One decoding loop for every drafter (gpt-fast's ``speculative_decode`` shape): draft, one target forward over
the uncached tokens plus the draft, verify, commit, roll the cache back to the accepted prefix.

With :class:`~specdraft.drafters.base.NoDrafter` every draft is empty and the same loop is plain autoregressive
decoding, so the baseline and speculative decoding share every line of bookkeeping.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from specdraft.drafters.base import EMPTY_DRAFT, Draft, Drafter, NoDrafter, draft_kind
from specdraft.errors import SpecdraftError
from specdraft.models.base import CausalLM
from specdraft.sampling import SamplingConfig, check_finite, warp
from specdraft.speculation import SPECULATION, FixedPolicy, SpeculationPolicy, make_policy
from specdraft.stats import GenerationStats
from specdraft.stopping import Stopper
from specdraft.trees import chain_parents, depths, keep_nodes, verify_layout
from specdraft.verification import (
    VerifyResult,
    verify_greedy,
    verify_sampling,
    verify_tree_greedy,
    verify_tree_sampling,
)

_TREE_ROOM = 256  # cache slots beyond prompt + max_new_tokens for tree nodes and auxiliary tokens in flight


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings, validated on construction."""

    max_new_tokens: int = field(default=128, metadata={"help": "most tokens to generate"})
    num_draft_tokens: int = field(default=4, metadata={"help": "γ: draft tokens proposed per target forward (the "
                                                                "most, with adaptive speculation)"})
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eos_token_ids: tuple[int, ...] = field(default=(), metadata={"help": "ids that end generation (kept)"})
    stop_strings: tuple[str, ...] = field(default=(), metadata={"help": "texts that end generation (kept)"})
    speculation: str = field(default="adaptive", metadata={
        "help": "adaptive: each step proposes what maximises expected tokens/s on this machine; fixed: γ always"})

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise SpecdraftError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens}")
        if not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 1:
            raise SpecdraftError(f"num_draft_tokens must be an integer >= 1, got {self.num_draft_tokens}")
        if self.speculation not in SPECULATION:
            raise SpecdraftError(f"speculation must be one of {', '.join(SPECULATION)}, got {self.speculation!r}")


@dataclass
class GenerationResult:
    """Generated ids (prompt excluded), why generation ended, and the stats of this generation."""

    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats


def _check_inputs(prompt_ids: Sequence[int] | torch.Tensor, target: CausalLM, drafter: Drafter, max_new: int):
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()  # (N,)
    if prompt.numel() == 0:
        raise SpecdraftError("empty prompt: give at least one token")
    if int(prompt.min()) < 0 or int(prompt.max()) >= target.vocab_size:
        raise SpecdraftError(f"prompt token id out of range for the target vocabulary of {target.vocab_size}")
    for who, limit in (("target", target.max_context), ("draft", drafter.max_context)):
        if limit is not None and prompt.numel() + max_new > limit:
            raise SpecdraftError(
                f"prompt too long: {prompt.numel()} prompt tokens + max_new_tokens {max_new} exceed the {who} "
                f"model's context of {limit}"
            )
    if drafter.vocab_size is not None and drafter.vocab_size != target.vocab_size:
        raise SpecdraftError(
            f"vocabulary mismatch: target {target.name!r} has {target.vocab_size} logits, "
            f"drafter {drafter.name!r} has {drafter.vocab_size}"
        )
    return prompt


def _fit_tree(draft: Draft, max_depth: int, room: int, max_position: int) -> Draft:
    """Drop tree nodes deeper than ``max_depth`` or beyond ``room`` nodes, and an auxiliary branch that does not fit
    in the cache or past the model's last position. Node order keeps the result a tree."""
    aux = draft.aux
    too_far = aux is not None and aux.offsets.numel() > 0 and int(aux.offsets.max()) > max_position
    if aux is not None and (len(draft) + aux.tokens.shape[0] > room or too_far):
        aux = None
    parents = draft.parents if draft.parents is not None else chain_parents(len(draft))
    keep = (depths(parents) <= max_depth) & (torch.arange(len(draft)) < room)
    if bool(keep.all()):
        return replace(draft, parents=parents, aux=aux)
    kept, parents = keep_nodes(parents, keep)
    return replace(draft.select(kept, parents), aux=aux)


def _tree_step(target: CausalLM, cache, context: torch.Tensor, draft: Draft, config: GenerationConfig, generator,
               want_hidden: dict | None = None):
    """One target forward over the uncached tail, the tree and the auxiliary branch; verify the tree; keep only the
    accepted path in the cache. Returns the verification result (with the auxiliary logits)."""
    start, tail = cache.length, context[cache.length :]  # tail: (T0,), its last token is the root
    aux = draft.aux
    offsets, mask = verify_layout(tail.shape[0], draft.parents, aux)  # (T,), (T, T)
    fed = [tail, draft.tokens] + ([aux.tokens] if aux is not None else [])
    out = target.forward(torch.cat(fed).unsqueeze(0), cache, positions=start + offsets, attention_mask=mask,
                         **(want_hidden or {}))
    logits, hidden = (out[0][0], out[1][0]) if want_hidden else (out[0], None)  # (T, V), (T, D)
    check_finite(logits, "target")
    rows = logits[tail.shape[0] - 1 : tail.shape[0] + len(draft)]  # (N + 1, V): root, then every node
    if config.sampling.greedy:
        result = verify_tree_greedy(draft.tokens, draft.parents, rows)
    else:
        result = verify_tree_sampling(draft.tokens, draft.parents, draft.q, warp(rows, config.sampling), generator)
    first_node = start + tail.shape[0]
    cache.compact(first_node, [first_node + node for node in result.accepted_nodes])
    if aux is not None:
        result = replace(result, aux_logits=logits[tail.shape[0] + len(draft) :])
    if hidden is not None:
        rows = list(range(tail.shape[0])) + [tail.shape[0] + node for node in result.accepted_nodes]
        result = replace(result, hidden=hidden[rows])  # (T0 + m, D)
    return result, draft.tokens[list(result.accepted_nodes)].tolist()


def _prefill(target: CausalLM, cache, prompt: torch.Tensor, want_hidden: dict | None) -> torch.Tensor | None:
    """Feed all of the prompt but its last token, on the causal path, before the first step (as gpt-fast does):
    every step then feeds one uncached token and its draft, and a tree step never runs its masked forward over a
    long prompt. Returns the prompt's hidden states (L - 1, D) when the drafter reads them, else None."""
    if prompt.shape[0] < 2:
        return None
    out = target.forward(prompt[:-1].unsqueeze(0), cache, logits_to_keep=1, **(want_hidden or {}))
    return out[1][0] if want_hidden else None


def _hidden_request(drafter: Drafter) -> dict | None:
    """The forward arguments that return the features a drafter reads (``needs_hidden``): the final-normed hidden
    states, or the inputs of the layers in its ``hidden_layers`` (EAGLE-3); None when it reads none."""
    if not getattr(drafter, "needs_hidden", False):
        return None
    layers = getattr(drafter, "hidden_layers", None)
    return {"return_hidden": True} | ({"hidden_layers": tuple(layers)} if layers else {})


def _verify(draft, logits: torch.Tensor, sampling: SamplingConfig, generator) -> VerifyResult:
    """Greedy exact match, or speculative sampling on p warped once."""
    if sampling.greedy:
        return verify_greedy(draft.tokens, logits)
    return verify_sampling(draft.tokens, draft.q, warp(logits, sampling), generator)


@torch.inference_mode()
def generate(
    target: CausalLM,
    prompt_ids: Sequence[int] | torch.Tensor,
    drafter: Drafter | None = None,
    config: GenerationConfig | None = None,
    generator: torch.Generator | None = None,
    tokenizer=None,
    policy: SpeculationPolicy | None = None,
) -> GenerationResult:
    """Generate from ``target`` after ``prompt_ids`` (batch 1), speculatively when a drafter is given.

    Lossless: greedy output equals plain greedy decoding token for token; sampled output follows the target's
    warped distribution exactly (Leviathan et al. 2023, Appendix A). ``tokenizer`` is needed only for stop strings.
    ``policy`` decides how much to propose each step (:mod:`specdraft.speculation`); by default one is made from
    ``config.speculation`` for this call (pass one to carry what it learns across generations).
    """
    config = config or GenerationConfig()
    drafter = drafter or NoDrafter()
    if policy is None:
        plain = isinstance(drafter, NoDrafter)
        policy = FixedPolicy(0) if plain else make_policy(target, config.speculation, config.num_draft_tokens)
    prompt = _check_inputs(prompt_ids, target, drafter, config.max_new_tokens)
    stopper = Stopper(config.max_new_tokens, config.eos_token_ids, config.stop_strings, tokenizer)
    needed = prompt.numel() + config.max_new_tokens
    cache = target.new_cache(min(needed + _TREE_ROOM, target.max_context))  # room for tree and auxiliary slots
    drafter.begin(target, cache)
    want_hidden = _hidden_request(drafter)  # Medusa / EAGLE read the target's features
    context, generated, stats, reason = prompt, [], GenerationStats(), None
    start = time.perf_counter()
    prefill_hidden = _prefill(target, cache, prompt, want_hidden)  # (L - 1, D) or None
    stats.prefill_seconds = time.perf_counter() - start
    while reason is None:
        tick = time.perf_counter()
        kind = draft_kind(drafter, context, config.sampling)
        num_draft = policy.budget(context.shape[0], config.max_new_tokens - len(generated) - 1, kind)
        draft = drafter.propose(context, num_draft, config.sampling, generator) if num_draft > 0 else EMPTY_DRAFT
        draft = policy.trim(draft, context.shape[0], context.shape[0] - cache.length, time.perf_counter() - tick,
                            config.sampling.greedy)
        tock = time.perf_counter()
        if draft.is_tree:
            room = cache.capacity - context.shape[0]
            draft = _fit_tree(draft, num_draft, room, target.max_context - 1 - context.shape[0])
            result, accepted = _tree_step(target, cache, context, draft, config, generator, want_hidden)
        else:
            if len(draft) > num_draft:
                draft = draft.select(torch.arange(num_draft), None)
            fed = torch.cat([context[cache.length :], draft.tokens])  # (T,) uncached tokens, then the draft
            out = target.forward(fed.unsqueeze(0), cache, **(want_hidden or {}))
            logits = (out[0] if want_hidden else out)[0, -(len(draft) + 1) :]  # (γ + 1, V)
            check_finite(logits, "target")
            result = _verify(draft, logits, config.sampling, generator)
            if want_hidden:  # features of the tail and the accepted draft tokens: (T0 + m, D)
                result = replace(result, hidden=out[1][0, : fed.shape[0] - len(draft) + result.num_accepted])
            cache.crop(context.shape[0] + result.num_accepted)
            accepted = draft.tokens[: result.num_accepted].tolist()
        verified = time.perf_counter()
        if prefill_hidden is not None:  # the drafter sees the prompt's features with the first step's
            result, prefill_hidden = replace(result, hidden=torch.cat([prefill_hidden, result.hidden])), None
        new = accepted + [result.next_token]
        keep, reason = stopper.scan(generated, new)
        generated += new[:keep]
        context = torch.cat([context, torch.tensor(new[:keep], dtype=torch.long)])
        drafter.observe(result)
        policy.observe(draft, result, tock - tick, verified - tock)
        stats.record_step(result, keep, draft_s=tock - tick, verify_s=verified - tock)
    stats.decode_seconds = time.perf_counter() - start
    return GenerationResult(generated, reason, stats)
