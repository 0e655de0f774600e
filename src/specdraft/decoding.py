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

from specdraft.drafters.base import Drafter
from specdraft.models.base import CausalLM
from specdraft.sequence import GenerationConfig, GenerationResult, SequenceState
from specdraft.speculation import SpeculationPolicy
from specdraft.step import STEP_ROOM, OneSequence, speculative_step


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
    ``config`` for this call (:func:`specdraft.sequence.speculation_policy`; pass one to carry what it learns across
    generations).
    """
    seq = SequenceState.start(target, prompt_ids, drafter, config, generator, tokenizer, policy,
                              lambda needed: target.new_cache(min(needed + STEP_ROOM, target.max_context)))
    cache = seq.cache  # room for tree and auxiliary slots beyond the answer
    one = OneSequence(target, cache, seq.features)
    seq.prefill(one)
    while seq.finish_reason is None:
        tick = time.perf_counter()
        draft = seq.propose(cache.length, cache.capacity - seq.context.shape[0])
        tock = time.perf_counter()
        (step,) = speculative_step(one, [seq.step_input(draft)])
        verified = time.perf_counter()
        seq.commit(draft, step, tock - tick, verified - tock)
    seq.finish(time.perf_counter())
    return seq.result()
