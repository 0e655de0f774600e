"""Batch-1 decoding, one loop for every drafter (gpt-fast's ``speculative_decode`` shape): the sequence's speculation
policy decides the step's draft (:meth:`specdraft.sequence.SequenceState.propose`),
:func:`specdraft.step.speculative_step` feeds it to the target in one forward, verifies it and rolls the cache back
to the accepted path, the sequence commits. The batched loop (:mod:`specdraft.batching`) is its peer: the same
sequence state, setup, prefill, step and commit, with several sequences in each forward.

With :class:`~specdraft.drafters.base.NoDrafter` every draft is empty and the same loop is plain autoregressive
decoding, so the baseline and speculative decoding share every line of bookkeeping.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from specdraft.drafters.base import Drafter, common_prefix
from specdraft.models.base import CausalLM
from specdraft.models.native_llama import StaticKVCache
from specdraft.sequence import GenerationConfig, GenerationResult, SequenceState, reads_prefix_exactly
from specdraft.speculation import SpeculationPolicy
from specdraft.step import STEP_ROOM, OneSequence, speculative_step


class PrefixCache:
    """A target's cache kept from one :func:`generate` call to the next, with the tokens whose keys and values it
    holds: a prompt that starts with some of them feeds only the rest (prefix caching, as vLLM's automatic prefix
    caching and llama.cpp's ``cache_prompt`` do): a chat template's system turn, or a conversation's earlier turns
    and answers. Used only where the target reads a prefix exactly (``reads_prefix_exactly``: the GGUF
    blocks' row-invariant forwards), so an answer is the same bit for bit with or without it; a drafter that reads the
    prompt's features (EAGLE, Medusa) has the whole prompt fed; elsewhere :func:`generate` ignores it. One per
    decoding loop that runs sequences one after another (not shared between threads)."""

    def __init__(self) -> None:
        self.cache: StaticKVCache | None = None
        self.ids = torch.empty(0, dtype=torch.long)  # (cache.length,) the tokens whose keys and values it holds

    def take(self, capacity: int) -> StaticKVCache | None:
        """The kept cache, with room for ``capacity`` positions (copied into a larger one where it has less), or
        None; it is no longer kept (a generation that fails leaves nothing behind)."""
        cache, self.cache = self.cache, None
        if cache is None:
            return None
        return cache if cache.capacity >= capacity else cache.resized(capacity)

    def shared(self, cache: StaticKVCache, prompt: torch.Tensor, features: bool = False) -> int:
        """Crop ``cache`` (the one :meth:`take` gave) to the longest prefix its tokens share with ``prompt``'s all
        but last, (L,), and return that length; 0 where the drafter reads the prompt's ``features``."""
        same = 0 if features else common_prefix(self.ids[: cache.length], prompt[:-1])
        cache.crop(same)
        return same

    def keep(self, cache: StaticKVCache, context: torch.Tensor) -> None:
        """Keep ``cache`` after a sequence ending with ``context`` (N,): its positions up to the context's end."""
        held = min(cache.length, context.shape[0])
        cache.crop(held)
        self.cache, self.ids = cache, context[:held].clone()


@torch.inference_mode()
def generate(
    target: CausalLM,
    prompt_ids: Sequence[int] | torch.Tensor,
    drafter: Drafter | None = None,
    config: GenerationConfig | None = None,
    generator: torch.Generator | None = None,
    tokenizer=None,
    policy: SpeculationPolicy | None = None,
    prefix_cache: PrefixCache | None = None,
) -> GenerationResult:
    """Generate from ``target`` after ``prompt_ids`` (batch 1), speculatively when a drafter is given.

    Lossless: greedy output equals plain greedy decoding token for token; sampled output follows the target's
    warped distribution exactly (Leviathan et al. 2023, Appendix A). ``tokenizer`` is needed only for stop strings.
    ``policy`` decides how much to propose each step (:mod:`specdraft.speculation`); by default one is made from
    ``config`` for this call (:func:`specdraft.sequence.speculation_policy`; pass one to carry what it learns across
    generations). ``prefix_cache``: where the last call with it left the target's cache; the prompt's tokens it
    shares are read from there, and the cache is kept there after this call (:class:`PrefixCache`).
    """
    reuse = prefix_cache is not None and reads_prefix_exactly(target)

    def new_cache(needed: int):
        capacity = min(needed + STEP_ROOM, target.max_context)
        kept = prefix_cache.take(capacity) if reuse else None
        return kept if kept is not None else target.new_cache(capacity)

    seq = SequenceState.start(target, prompt_ids, drafter, config, generator, tokenizer, policy, new_cache)
    cache = seq.cache  # room for tree and auxiliary slots beyond the answer
    one = OneSequence(target, cache, seq.features)
    seq.prefill(one, prefix_cache.shared(cache, seq.prompt, seq.features is not None) if reuse else 0)
    while seq.finish_reason is None:
        tick = time.perf_counter()
        draft = seq.propose(cache.length, cache.capacity - seq.context.shape[0])
        tock = time.perf_counter()
        (step,) = speculative_step(one, [seq.step_input(draft)])
        verified = time.perf_counter()
        seq.commit(draft, step, tock - tick, verified - tock)
    seq.finish(time.perf_counter())
    if reuse:
        prefix_cache.keep(cache, seq.context)
    return seq.result()
