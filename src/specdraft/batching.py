"""Batched speculative decoding: several sequences share every target forward, each accepting its own number of
draft tokens (ragged), each with its own cache row, positions, drafter, speculation policy, sampling settings and
generator.

The peer of batch-1 decoding (:mod:`specdraft.decoding`), over the same step (:mod:`specdraft.step`) and the same
per-sequence state (:class:`~specdraft.sequence.SequenceState`: setup, prefill, the step's draft, commit). One step
of :class:`BatchDecoder` is that loop's step for every active sequence at once: each sequence's policy decides its
draft (a chain, a token tree, or nothing: plain decoding is the same loop with empty drafts) knowing how many
sequences share the forward, so adaptive speculation stops drafting where the batch already fills the machine; and
:func:`specdraft.step.speculative_step` feeds the uncached tail and the draft of every row in one ragged forward
(:class:`BatchRows`, :func:`specdraft.models.batched_llama.batched_forward`) and verifies each row on its own
logits, so every row is lossless exactly as batch-1 decoding is (Leviathan et al. 2023, Alg. 1; SpecInfer, Miao et
al. 2024, for trees). Sequences join (:meth:`BatchDecoder.add`, which prefills the prompt) and leave
(:meth:`BatchDecoder.remove`) between steps: continuous batching as in Orca (Yu et al. 2022). Where the target
reads a prefix exactly, a joining prompt reads the positions it shares with a running row, or with a free row that
keeps a finished sequence's cache (a conversation's earlier turns and answers), and feeds only the rest: prefix
caching, as vLLM's automatic prefix caching does by blocks, here by whole rows.

Drafters keep per-generation state, so every sequence has its own drafter instance. A drafter that reads or drafts
through the target's own KV cache (GliDe, layer-skip; ``DrafterFacts.batchable`` False) cannot share the batched
cache and is refused with a clear error.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable, Sequence

import torch

from specdraft.batch_drafting import DraftBatcher, batcher_of
from specdraft.drafters.base import Draft, Drafter, TargetFeatures, common_prefix, facts_of
from specdraft.errors import SpecdraftError
from specdraft.models.base import CausalLM
from specdraft.models.batched_llama import BatchedKVCache, batched_forward, new_batched_cache, supports_batching
from specdraft.sequence import GenerationConfig, GenerationResult, SequenceState, reads_prefix_exactly
from specdraft.speculation import SpeculationPolicy
from specdraft.step import STEP_ROOM, Layout, speculative_step
from specdraft.trees import chain_parents


class _UnsharedCache:
    """What a drafter's ``begin`` gets for the target's cache in batched decoding: using it is an error."""

    def __getattr__(self, name: str):
        raise SpecdraftError("this drafter drafts on the target's KV cache, which batched decoding does not share; "
                             "use it at batch size 1 (specdraft generate)")


class CacheRow:
    """One row of a :class:`~specdraft.models.batched_llama.BatchedKVCache`, seen as a batch-1 KV cache."""

    def __init__(self, cache: BatchedKVCache, row: int) -> None:
        self.cache, self.row = cache, row

    @property
    def length(self) -> int:
        return self.cache.lengths[self.row]

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    def crop(self, length: int) -> None:
        self.cache.crop(self.row, length)

    def compact(self, start: int, slots: list[int]) -> None:
        self.cache.compact(self.row, start, slots)


class BatchRows:
    """A step's target over rows 0 .. n-1 of a batched cache (:class:`specdraft.step.StepTarget`): one ragged forward
    returns every row's logits, and the target features of the rows whose drafter reads them (``features``)."""

    def __init__(self, target: CausalLM, cache: BatchedKVCache, features: Sequence[TargetFeatures | None]) -> None:
        self.target, self.cache, self.features = target, cache, list(features)

    def prefill(self, row: int, tokens: torch.Tensor) -> torch.Tensor | None:
        _, hidden = features_forward(self.target, self.cache, tokens[None], [tokens.shape[0]], row,
                                     [self.features[row]], want_logits=False)
        return hidden[0]  # (T, D or k*D), None when the drafter reads no features

    def cached(self, row: int) -> int:
        return self.cache.lengths[row]

    def row_cache(self, row: int) -> CacheRow:
        return CacheRow(self.cache, row)

    def forward(self, layouts: Sequence[Layout]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        sizes = [layout.tokens.shape[0] for layout in layouts]
        input_ids, offsets, mask = _pad(layouts)
        logits, hidden = features_forward(self.target, self.cache, input_ids, sizes, 0, self.features,
                                          offsets=offsets, local_mask=mask)
        return [(logits[i, :size], None if hidden[i] is None else hidden[i][:size]) for i, size in enumerate(sizes)]


def features_forward(target: CausalLM, cache: BatchedKVCache, input_ids: torch.Tensor, sizes: list[int],
                     first_row: int, features: Sequence[TargetFeatures | None], **kwargs
                     ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """One ragged forward (:func:`batched_forward`) that also returns each row's target features as its drafter
    reads them: the final-normed states (Medusa, EAGLE), the residual stream entering its ``layers`` concatenated
    (EAGLE-3), or None. Rows with different layers share one forward: every layer any row reads is tapped."""
    taps = sorted({layer for f in features if f is not None for layer in f.layers})
    want = any(f is not None for f in features)
    out = batched_forward(target, cache, input_ids, sizes, first_row, return_hidden=want, hidden_layers=taps,
                          **kwargs)
    if not want:
        return out, [None] * len(features)
    logits, states = out
    final, tapped = states if taps else (states, None)  # (n, T, D), (n, T, len(taps)*D)
    width = final.shape[-1]
    rows = []
    for i, feature in enumerate(features):
        if feature is None:
            rows.append(None)
        elif not feature.layers:
            rows.append(final[i])  # (T, D)
        else:
            slots = [taps.index(layer) for layer in feature.layers]
            rows.append(torch.cat([tapped[i, :, s * width:(s + 1) * width] for s in slots], dim=-1))  # (T, k*D)
    return logits, rows


MAX_TREE_NODES = STEP_ROOM - 2  # a token tree keeps at most this many nodes in batched decoding (beside its tail)


class BatchDecoder:
    """Continuous batching over one target: up to ``max_batch`` sequences of up to ``capacity`` positions each
    (prompt and generated tokens; a step's draft lives in :data:`~specdraft.step.STEP_ROOM` extra slots). Each
    sequence drafts as its speculation policy decides, priced at the number of sequences in each step
    (:func:`specdraft.sequence.speculation_policy`: ``GenerationConfig.speculation`` and ``max_draft_batch``).
    """

    def __init__(self, target: CausalLM, max_batch: int, capacity: int, tokenizer=None,
                 prefix_cache: bool = True) -> None:
        if not supports_batching(target):
            raise SpecdraftError(f"batched decoding needs a native Llama target; {target.name!r} is not one "
                                 "(load it with backend auto or native)")
        self.target, self.tokenizer = target, tokenizer
        self.capacity = min(capacity, target.max_context)
        self.cache = new_batched_cache(target, max_batch, self.capacity + STEP_ROOM)
        self.rows: list[SequenceState] = []  # row i of the cache holds rows[i]
        # Prefix caching across sequences, where the target reads a prefix exactly (as
        # the batch-1 loop's PrefixCache): a new sequence's prompt reads the positions it
        # shares with a running row, or with a free row that keeps a finished sequence's cache, and feeds the rest.
        self.reuse = prefix_cache and reads_prefix_exactly(target)
        self._kept: list[torch.Tensor | None] = [None] * max_batch  # free row i: the tokens its cache holds
        self._kept_at = [0] * max_batch  # when each free row's cache was kept (the oldest goes first)
        self._clock = 0
        # Called after each row's verification with (sequence, the target's logits (m + 1, V) that chose the m
        # accepted tokens and the next one, whether the draft had a token at the first rejected position, draft
        # size); set by a caller that records verified positions (online distillation).
        self.on_verify: Callable[[SequenceState, torch.Tensor, bool, int], None] | None = None

    @property
    def free_rows(self) -> int:
        return self.cache.max_rows - len(self.rows)

    def _target(self) -> BatchRows:
        """The step target over the rows in use."""
        return BatchRows(self.target, self.cache, [seq.features for seq in self.rows])

    @torch.inference_mode()
    def add(self, prompt_ids: Sequence[int] | torch.Tensor, drafter: Drafter | None = None,
            config: GenerationConfig | None = None, generator: torch.Generator | None = None,
            policy: SpeculationPolicy | None = None) -> SequenceState:
        """Set a new sequence up (:meth:`~specdraft.sequence.SequenceState.start`), give it a free row and prefill
        its prompt (all but the last token). ``policy``: by default one made from ``config``."""
        if drafter is not None and not facts_of(drafter).batchable:
            raise SpecdraftError(f"drafter {drafter.name!r} reads or drafts through the target's KV cache, which "
                                 "batched decoding does not share; use it at batch size 1 (specdraft generate)")
        if not self.free_rows:
            raise SpecdraftError(f"the batch is full ({self.cache.max_rows} sequences)")
        seq = SequenceState.start(self.target, prompt_ids, drafter, config, generator, self.tokenizer, policy,
                                  lambda needed: _UnsharedCache(), self.capacity)
        seq.row = len(self.rows)
        cached = self._take_prefix(seq.row, seq.prompt[:-1]) if self.reuse and seq.features is None else 0
        if not cached:
            self._vacate(seq.row)
        self.rows.append(seq)
        try:
            seq.prefill(self._target(), cached)
        except BaseException:  # the row is free again, and keeps nothing
            self.rows.pop()
            self.cache.lengths[seq.row], seq.row = 0, -1
            raise
        return seq

    def remove(self, seq: SequenceState, keep: bool = True) -> None:
        """Drop ``seq`` from the batch (finished or abandoned); the last row moves into its place. With prefix
        caching, its cache stays in the row that becomes free (unless it failed, or ``keep`` is False: a step that
        raised may have left it half written), for a later prompt that starts with its tokens."""
        if seq.row < 0 or seq.row >= len(self.rows) or self.rows[seq.row] is not seq:
            return
        keep = keep and self.reuse and seq.error is None
        last = self.rows.pop()
        if last is not seq:
            if keep:
                self.cache.swap_rows(seq.row, last.row)
            else:
                self.cache.move_row(last.row, seq.row)
            self.rows[seq.row], last.row = last, seq.row
        freed = len(self.rows)
        held = min(self.cache.lengths[freed], seq.context.shape[0]) if keep else 0
        self.cache.lengths[freed] = held
        self._kept[freed] = seq.context[:held].clone() if held else None
        if held:
            self._clock += 1
            self._kept_at[freed] = self._clock
        seq.row = -1

    def _tokens(self, row: int) -> torch.Tensor | None:
        """The tokens whose keys and values ``row`` holds: its sequence's (running) or those kept (free)."""
        if row < len(self.rows):
            return self.rows[row].context[: self.cache.lengths[row]]
        return self._kept[row]

    def _take_prefix(self, row: int, prompt: torch.Tensor) -> int:
        """Give free ``row`` the longest prefix of ``prompt`` (its tokens but the last, (L - 1,)) that any row's
        cache holds, copied from a running row or moved from a free one (whose own tokens then go where it was), and
        return its length (0: none, nothing moved)."""
        best, shared = -1, 0
        for other in range(self.cache.max_rows):
            tokens = self._tokens(other)
            same = 0 if tokens is None else common_prefix(tokens, prompt)
            if same > shared:
                best, shared = other, same
        if not shared:
            return 0
        if best < len(self.rows):  # a running row: copy the shared positions
            self._vacate(row)
            self.cache.copy_prefix(best, row, shared)
        else:  # a free row: it becomes this one, what this one kept goes to its place
            self.cache.crop(best, shared)
            self.cache.swap_rows(best, row)
            self._kept[best], self._kept_at[best] = self._kept[row], self._kept_at[row]
        self._kept[row] = None
        return shared

    def _vacate(self, row: int) -> None:
        """Empty free ``row`` for a new sequence; what it kept moves to an empty free row, else replaces what the
        free row kept longest ago (if that is older)."""
        if self._kept[row] is not None:
            others = [other for other in range(len(self.rows), self.cache.max_rows) if other != row]
            empty = [other for other in others if self._kept[other] is None]
            spare = empty[0] if empty else min(others, key=lambda other: self._kept_at[other], default=None)
            if spare is not None and (self._kept[spare] is None or self._kept_at[spare] < self._kept_at[row]):
                self.cache.lengths[spare] = 0
                self.cache.swap_rows(row, spare)
                self._kept[spare], self._kept_at[spare] = self._kept[row], self._kept_at[row]
        self.cache.lengths[row] = 0
        self._kept[row] = None

    def _propose(self, seq: SequenceState) -> Draft | Exception:
        """The row's draft, decided by its policy for a step of this many sequences (the room beside the one-token
        tail is the same for every row: what the batch's padding leaves), or the exception it raised: one
        drafter's failure is its sequence's alone."""
        try:
            return seq.propose(self.cache.lengths[seq.row], MAX_TREE_NODES, len(self.rows))
        except Exception as exc:
            return exc

    def _propose_all(self) -> list[Draft | Exception]:
        """Every row's draft; drafters whose draft model runs in lockstep draft together (their forwards batched)."""
        drafts: list[Draft | Exception | None] = [None] * len(self.rows)
        groups: dict[int, tuple[DraftBatcher, list[int]]] = {}
        for i, seq in enumerate(self.rows):
            batcher = batcher_of(seq.drafter)
            if batcher is not None:
                groups.setdefault(id(batcher), (batcher, []))[1].append(i)
        for batcher, rows in groups.values():
            together = batcher.run([functools.partial(self._propose, self.rows[i]) for i in rows])
            for i, draft in zip(rows, together, strict=True):
                drafts[i] = draft
        return [draft if draft is not None else self._propose(seq) for draft, seq in zip(drafts, self.rows,
                                                                                           strict=True)]

    def _drop_failed(self, proposals: list[Draft | Exception]) -> tuple[list[SequenceState], list[Draft]]:
        """Rows whose proposal raised end alone with their error (``error``, finish_reason "error") and leave the
        batch; returns them and the drafts of the rows that stay, in row order."""
        draft_of = {id(seq): draft for seq, draft in zip(self.rows, proposals, strict=True)}
        failed = [seq for seq in list(self.rows) if isinstance(draft_of[id(seq)], Exception)]
        for seq in failed:
            seq.error, seq.finish_reason = draft_of[id(seq)], "error"
            self.remove(seq)
        return failed, [draft_of[id(seq)] for seq in self.rows]

    def _verified(self, seq: SequenceState, draft: Draft, step) -> None:
        """Hand the row's verified step to ``on_verify``, if set."""
        if self.on_verify is None:
            return
        nodes = step.result.accepted_nodes
        parents = draft.parents if draft.parents is not None else chain_parents(len(draft))
        missed = len(draft) > 0 and bool((parents == (nodes[-1] if nodes else -1)).any())
        self.on_verify(seq, step.verified_logits, missed, len(draft))  # (m + 1, V)

    @torch.inference_mode()
    def step(self) -> list[tuple[SequenceState, list[int]]]:
        """One draft-verify step of every active sequence. Returns (sequence, tokens it committed) for each; the
        sequences that finished (``finish_reason`` set) have left the batch. A sequence whose own draft, distribution
        or verification raised (a non-finite distribution, a failing drafter) ends alone: ``error`` set,
        finish_reason "error", no tokens; the other rows' results are those they would have had without it."""
        if not self.rows:
            return []
        tick = time.perf_counter()
        failed, drafts = self._drop_failed(self._propose_all())
        if not self.rows:
            return [(seq, []) for seq in failed]
        tock = time.perf_counter()
        rows = list(self.rows)
        steps = speculative_step(self._target(), [seq.step_input(draft) for seq, draft in zip(rows, drafts,
                                                                                              strict=True)],
                                 isolate=True)
        verified = time.perf_counter()
        committed, done = [(seq, []) for seq in failed], []
        for seq, draft, step in zip(rows, drafts, steps, strict=True):
            try:
                if isinstance(step, Exception):
                    raise step
                self._verified(seq, draft, step)
                new = seq.commit(draft, step, (tock - tick) / len(rows), verified - tock)
            except Exception as exc:  # this row's distribution or verification failed: the others are unaffected
                seq.error, seq.finish_reason = exc, "error"
                committed.append((seq, []))
                done.append(seq)
                continue
            committed.append((seq, new))
            if seq.finish_reason is not None:
                done.append(seq)
        now = time.perf_counter()
        for seq in done:
            seq.finish(now)
            self.remove(seq)
        return committed


def _pad(layouts: Sequence[Layout]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad the rows to a common T: padding takes the next slots of its row and attends causally, as does a
    chain (a layout without offsets and mask).

    Returns input_ids (n, T), offsets (n, T), local mask (n, T, T) bool.
    """
    steps = max(layout.tokens.shape[0] for layout in layouts)
    batch = len(layouts)
    input_ids = torch.zeros(batch, steps, dtype=torch.long)
    offset = torch.arange(steps).repeat(batch, 1)  # (n, T)
    local = torch.ones(steps, steps, dtype=torch.bool).tril().repeat(batch, 1, 1)  # (n, T, T)
    for i, layout in enumerate(layouts):
        size = layout.tokens.shape[0]
        input_ids[i, :size] = layout.tokens
        if layout.mask is not None:
            offset[i, :size] = layout.offsets
            local[i, :size, :size] = layout.mask
        local[i, :size, size:] = False
    return input_ids, offset, local


def generate_batch(
    target: CausalLM,
    prompts: Sequence[Sequence[int] | torch.Tensor],
    drafters: Sequence[Drafter | None] | Callable[[], Drafter | None] | None = None,
    config: GenerationConfig | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    tokenizer=None,
    batch_size: int | None = None,
) -> list[GenerationResult]:
    """Generate from ``target`` after every prompt, ``batch_size`` sequences at a time (default: all at once);
    a finished sequence's row goes to the next prompt. ``drafters``: one per prompt, or a factory called once per
    prompt (drafters keep per-generation state), or None for plain decoding. Row i's output equals
    ``generate(target, prompts[i], drafters[i], config, generators[i], tokenizer)`` (greedy: token for token in
    fp32; sampling: in distribution)."""
    config = config or GenerationConfig()
    count = len(prompts)
    if count == 0:
        return []
    make = drafters if callable(drafters) else (lambda i: None if drafters is None else drafters[i])
    drafter_of = (lambda i: make()) if callable(drafters) else make
    generators = generators or [None] * count
    capacity = max(len(p) for p in prompts) + config.max_new_tokens
    decoder = BatchDecoder(target, min(batch_size or count, count), capacity, tokenizer)
    results: list[GenerationResult | None] = [None] * count
    waiting = list(range(count))
    while waiting or decoder.rows:
        while waiting and decoder.free_rows:
            i = waiting.pop(0)
            decoder.add(prompts[i], drafter_of(i), config, generators[i]).tag = i
        for seq, _ in decoder.step():
            if seq.error is not None:
                raise seq.error
            if seq.finish_reason is not None:
                results[seq.tag] = seq.result()
    return results  # type: ignore[return-value]


def drafter_factory(prototype: Drafter | None) -> Callable[[], Drafter | None]:
    """Fresh drafter instances for new sequences, copied from an unused ``prototype``: per-generation state is
    copied, while its models, heads and tensors (weights, tables) are shared, not copied."""
    if prototype is None:
        return lambda: None
    shared: dict[int, object] = {}

    def collect(obj, depth: int) -> None:
        for value in getattr(obj, "__dict__", {}).values():
            if isinstance(value, (torch.Tensor, torch.nn.Module)):
                shared[id(value)] = value
            elif depth < 5 and hasattr(value, "__dict__") and not isinstance(value, type):
                collect(value, depth + 1)

    collect(prototype, 0)
    return lambda: copy.deepcopy(prototype, dict(shared))
