"""Lookahead decoding (Fu et al. 2024, *Break the Sequential Dependency of LLM Inference Using Lookahead Decoding*,
arXiv 2402.02057): no draft model; the target itself runs Jacobi iterations on a 2D window of guessed future tokens
in the same forward that verifies earlier guesses, and the n-grams those iterations produce become the guesses.

Each step feeds one target forward with two branches beside the committed context:

- the **verification branch**: up to ``guess_set_size`` (G) n-grams from the pool whose key is the last context
  token (the *root*); their (N-1)-token continuations, merged into a trie, form the token tree the decoding loop
  verifies (deterministic, q = None);
- the **lookahead branch** (an :class:`~specdraft.trees.AuxBranch`): the window of N-1 levels, W columns each.
  Level l's column j sits ``l + j`` positions after the root; level 0 is the root itself plus W-1 guessed tokens
  (offsets 1..W-1), so column j's chain root/level0[j-1], level1[j], ..., level(N-2)[j] covers consecutive
  positions. A token attends the committed context, the level-0 tokens left of its column, and its own column in
  levels 1 up to its own; level 0 is causal (the lookahead attention mask of the reference implementation).

After the forward, the argmax at each top-level token (the greedy Jacobi update) gives a new top level; each
column's chain plus its new token is an n-gram for the pool (key: the chain's first token). The window then moves
down one level (the oldest level is dropped) and left by the number of tokens committed. Verification stays exact,
so the output is lossless whatever the window holds. Before the window is full (the first N-2 steps) each forward
adds one level, as the reference implementation does.

The window lives in lists of token ids; :func:`window_layout`, :func:`harvest` and :func:`advance` are pure
functions of those lists, and :class:`NgramPool` is the least-recently-used pool of the reference implementation.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from specdraft.drafters.base import Draft, DrafterFacts
from specdraft.errors import SpecdraftError
from specdraft.sampling import SamplingConfig
from specdraft.trees import AuxBranch
from specdraft.verification import VerifyResult

Levels = list[list[int]]


class NgramPool:
    """The n-gram pool: a key token -> at most ``capacity`` continuations ((N-1)-token tuples); re-adding one makes
    it the most recent, and a full key forgets its least recently added one (the reference's LRU policy)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._table: dict[int, list[tuple[int, ...]]] = {}

    def add(self, key: int, continuation: Sequence[int]) -> None:
        entries = self._table.setdefault(key, [])
        item = tuple(continuation)
        if item in entries:
            entries.remove(item)
        elif len(entries) == self.capacity:
            entries.pop(0)
        entries.append(item)

    def get(self, key: int) -> list[tuple[int, ...]]:
        """The continuations stored under ``key``, most recent first."""
        return self._table.get(key, [])[::-1]

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._table.values())


def start_offset(level: int) -> int:
    """Offset (from the root) of a level's first stored token: level 0 stores its columns 1.. (column 0 is the root)."""
    return max(level, 1)


def level_lengths(window: int, ngram: int, filled: int) -> list[int]:
    """Stored tokens per level when levels 0..``filled`` exist: W-1 and W once full (``filled`` = N-2); one more per
    level for each level still missing, since each Jacobi level loses a column."""
    extra = ngram - 2 - filled
    return [window - 1 + extra] + [window + extra] * filled


def window_layout(levels: Levels) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The lookahead branch of ``levels`` (fed level by level): tokens (A,), offsets (A,) from the root, and the
    lookahead attention mask (A, A) bool.

    Level 0 is a causal chain; a token of level l >= 1 at column j attends level0[0..j-1] (offsets 1..j) and column
    j of levels 1..l (offsets j+1..j+l), itself included: one chain of consecutive positions after the root.
    """
    starts = [0]
    for level in levels:
        starts.append(starts[-1] + len(level))
    size = starts[-1]
    tokens = torch.tensor([t for level in levels for t in level], dtype=torch.long).reshape(size)  # (A,)
    offsets = torch.empty(size, dtype=torch.long)  # (A,)
    mask = torch.zeros(size, size, dtype=torch.bool)  # (A, A)
    for lev, level in enumerate(levels):
        for col in range(len(level)):
            row = starts[lev] + col
            offsets[row] = start_offset(lev) + col
            if lev == 0:
                mask[row, : row + 1] = True
                continue
            mask[row, : min(col, starts[1])] = True
            for below in range(1, lev + 1):
                mask[row, starts[below] + col] = True
    return tokens, offsets, mask


def harvest(root: int, levels: Levels, predicted: Sequence[int]) -> list[tuple[int, tuple[int, ...]]]:
    """The n-grams of a full window: for every top-level column j, (key, continuation) = (the chain's first token,
    the rest of the chain then ``predicted[j]``, the target's argmax at the top-level token of column j).

    The chain of column j is the root (j = 0) or level0[j-1], then column j of levels 1..N-2.
    """
    top = len(levels) - 1
    out = []
    for col, token in enumerate(predicted):
        key = root if col == 0 else levels[0][col - 1]
        out.append((key, tuple(levels[lev][col] for lev in range(1, top + 1)) + (token,)))
    return out


def _realign(tokens: Sequence[int], old_start: int, new_start: int, shift: int, length: int,
             pad: Callable[[], int]) -> list[int]:
    """Tokens that sat at offset ``old_start + i`` move to ``new_start + j`` after the root moves ``shift`` tokens
    on: j = i + old_start - new_start - shift. The first ``length`` of them, padded at the end with ``pad()``."""
    first = new_start + shift - old_start
    out = list(tokens[first : first + length]) if first >= 0 else []
    return out + [pad() for _ in range(length - len(out))]


def advance(levels: Levels, predicted: Sequence[int] | None, shift: int, window: int, ngram: int,
            pad: Callable[[], int]) -> Levels:
    """The window of the next step: the Jacobi update ``predicted`` (the argmax at each top-level token, or None
    when the lookahead branch was not run) becomes the top level, the oldest level is dropped once the window is
    full, and every level moves ``shift`` positions left (the tokens committed), padded at the end with ``pad()``.
    """
    top = len(levels) - 1
    if predicted is None:
        lengths = level_lengths(window, ngram, top)
        return [_realign(lv, start_offset(i), start_offset(i), shift, lengths[i], pad) for i, lv in enumerate(levels)]
    if top < ngram - 2:  # still filling: keep every level, add one
        kept = list(enumerate(levels))
        lengths = level_lengths(window, ngram, top + 1)
    else:  # full: level l+1 becomes level l
        kept = list(enumerate(levels[1:], start=1))
        lengths = level_lengths(window, ngram, top)
    new = [_realign(lv, start_offset(old), start_offset(i), shift, lengths[i], pad) for i, (old, lv) in enumerate(kept)]
    new_top = len(new)
    new.append(_realign(predicted, start_offset(top) + 1, start_offset(new_top), shift, lengths[new_top], pad))
    return new


def ngram_trie(candidates: Sequence[Sequence[int]], depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge candidate continuations, each cut to ``depth`` tokens, into a token tree (shared prefixes once; node
    order = first appearance, so parents come first). Returns tokens (N,) and parents (N,) long."""
    index: dict[tuple[int, ...], int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    for candidate in candidates:
        path = tuple(candidate[:depth])
        for end in range(1, len(path) + 1):
            if path[:end] not in index:
                index[path[:end]] = len(tokens)
                tokens.append(path[end - 1])
                parents.append(index[path[: end - 1]] if end > 1 else -1)
    return torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long)


def _check_int(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise SpecdraftError(f"lookahead option {name} must be an integer >= {low}, got {value!r}")


class LookaheadDrafter:
    """Lookahead decoding (Fu et al. 2024): the verification branch as a token tree, the 2D Jacobi window as an
    auxiliary branch of the same target forward.

    Options: ``window`` (W, columns), ``ngram`` (N: n-gram size; the window has N-1 levels and guesses are N-1
    tokens), ``guess_set_size`` (G: n-grams kept per key and verified per step), ``pool_from_context`` (also pool
    the context's own n-grams, the reference's POOL_FROM_PROMPT), ``always_forward_one`` (move the window one
    position a step, as the reference's default, instead of by the tokens committed), ``seed`` (the random context
    tokens that fill new window slots).
    """

    name = "lookahead"
    vocab_size = None
    max_context = None

    method = "lookahead"
    facts = DrafterFacts()  # its n-gram pool grows from the target's own Jacobi guesses

    def __init__(self, window: int = 5, ngram: int = 4, guess_set_size: int = 5, pool_from_context: bool = False,
                 always_forward_one: bool = False, seed: int = 0) -> None:
        _check_int("window", window, 1)
        _check_int("ngram", ngram, 3)
        _check_int("guess_set_size", guess_set_size, 1)
        _check_int("seed", seed, 0)
        self.window, self.ngram, self.guess_set_size = window, ngram, guess_set_size
        self.pool_from_context, self.always_forward_one, self.seed = pool_from_context, always_forward_one, seed
        self.begin(None, None)

    def begin(self, target, cache) -> None:
        """A new generation: empty pool, no window yet (the first ``propose`` fills level 0 from the context)."""
        self.pool = NgramPool(self.guess_set_size)
        self.levels: Levels = []
        self._rng = random.Random(self.seed)
        self._context = torch.empty(0, dtype=torch.long)
        self._root: int | None = None  # the root of the window fed in the pending forward
        self._scanned = 0  # context n-grams already pooled (pool_from_context)

    def _pad(self) -> int:
        """A random context token for a new window slot (the reference fills its window the same way)."""
        return int(self._context[self._rng.randrange(self._context.shape[0])])

    def _pool_context(self) -> None:
        """Pool every context n-gram not pooled yet (key, then N-1 tokens), oldest first."""
        ids = self._context.tolist()
        last = len(ids) - self.ngram
        for start in range(self._scanned, last + 1):
            self.pool.add(ids[start], ids[start + 1 : start + self.ngram])
        self._scanned = max(self._scanned, last + 1)

    def propose(
        self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Draft:
        """The pool's n-grams after the last context token as a trie (depth <= ``num_draft_tokens``), and the
        window as the auxiliary branch."""
        self._context = context
        if not self.levels:
            self.levels = [[self._pad() for _ in range(level_lengths(self.window, self.ngram, 0)[0])]]
        if self.pool_from_context:
            self._pool_context()
        self._root = int(context[-1])
        tokens, parents = ngram_trie(self.pool.get(self._root), num_draft_tokens)
        aux = AuxBranch(*window_layout(self.levels))
        return Draft(tokens, parents=parents, aux=aux)

    def observe(self, result: VerifyResult) -> None:
        """Jacobi update from the auxiliary logits (argmax), pool the full window's n-grams, move the window."""
        committed = result.num_accepted + 1
        shift = 1 if self.always_forward_one else committed
        predicted = None
        if result.aux_logits is not None and self._root is not None and self.levels:
            top = self.levels[-1]
            predicted = result.aux_logits[result.aux_logits.shape[0] - len(top) :].argmax(-1).tolist()  # (W',)
            if len(self.levels) == self.ngram - 1:
                for key, continuation in harvest(self._root, self.levels, predicted):
                    self.pool.add(key, continuation)
        if self.levels:
            self.levels = advance(self.levels, predicted, shift, self.window, self.ngram, self._pad)
        self._root = None
