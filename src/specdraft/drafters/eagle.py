"""EAGLE drafting (Li et al. 2024, arXiv 2401.15077) with an EAGLE-2 dynamic draft tree (Li et al. 2024, "EAGLE-2:
Faster Inference of Language Models with Dynamic Draft Trees", arXiv 2406.16858).

The feature stream. The loop hands over, after every step, the target's final-normed features of the tokens it fed
and committed (``result.hidden``); the token after the last of them (``result.next_token``) is committed but not
yet fed. With context x_0 .. x_{L-1} the drafter therefore holds features f_0 .. f_{L-2}, and pair i is
(f_i, x_{i+1}); the last pair's token is the previous step's ``result.next_token``. ``observe`` stores the features;
``propose`` pairs each new row i with ``context[i + 1]`` and feeds the new pairs to the head in one forward on the
head's own KV cache (so that their cost counts as draft time). Only committed tokens ever enter that cache, so
nothing is rolled back; the tree's nodes are cropped off before ``propose`` returns.

The tree (EAGLE-2). The last pair's output g predicts f_{L-1}; W_lm g gives the root's children. Each level
expands the ``top_k`` frontier nodes with the highest cumulative draft log-probability (EAGLE-2's confidence,
the product of the draft probabilities along the path) into ``top_k`` children each, with one head forward per
level over the frontier (each node sees the committed pairs and its ancestors: a tree mask); a node's pair is
(its parent's predicted feature, its token), at position L - 2 + depth. Depth = ``num_draft_tokens``. Finally the
``tree_nodes`` most confident nodes (closed under ancestors) are the draft. Greedy: children are the top-k tokens,
q = None (point masses). Sampling: children are ``top_k`` i.i.d. draws from the warped q of their parent, returned
as q rows, which SpecInfer's multi-draft verification (``verify_tree_sampling``) accepts losslessly.

Draft vocabulary (``draft_vocab=N``): the LM head multiplications of the tree use only the N tokens most frequent in
the heads' training data (FR-Spec, :mod:`specdraft.draft_vocab`); lossless, and far cheaper when the vocabulary is
large next to the model.

The first step of a generation has no features yet and proposes nothing (plain decoding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdraft.draft_vocab import DraftVocab, draft_subset
from specdraft.drafters.base import EMPTY_DRAFT, Draft, DrafterFacts, ReadsTargetFeatures, TargetFeatures, grown_cache
from specdraft.drafters.loading import with_heads_defaults
from specdraft.drafters.options import build
from specdraft.errors import SpecdraftError
from specdraft.heads import load_heads
from specdraft.models.shared_embeddings import target_weights
from specdraft.sampling import SamplingConfig, warp
from specdraft.trees import add_children, expansion_mask, most_confident
from specdraft.verification import VerifyResult


class EagleDrafter(ReadsTargetFeatures):
    """Drafts an EAGLE-2 dynamic tree with an EAGLE head trained by ``specdraft train-heads --kind eagle``.

    Args:
        heads: the heads folder (``<out>/heads``).
        top_k: children per expanded node and frontier nodes per level (EAGLE-2's k).
        tree_nodes: nodes kept in the final tree (EAGLE-2's re-ranking).
        draft_vocab: draft only the N most frequent tokens of the training data (0: the whole vocabulary).
    """

    name = "eagle"

    method = "eagle"
    facts = DrafterFacts(cpu_only=True, reads_target_features=True)

    @classmethod
    def from_options(cls, target, tokenizer, options: dict[str, str]) -> EagleDrafter:
        """``--drafter eagle``: ``heads=PATH`` (with the options the folder ships) and the constructor's."""
        return build(cls, with_heads_defaults(options, cls.method, cls.method))

    def __init__(self, heads: str, top_k: int = 4, tree_nodes: int = 16, draft_vocab: int = 0) -> None:
        if not str(heads).strip():
            raise SpecdraftError("eagle needs heads=PATH: a heads folder made by `specdraft train-heads --kind eagle`")
        _, head = load_heads(heads, kind="eagle")
        self._setup(head, top_k, tree_nodes, draft_subset(heads, int(head.sizes["vocab_size"]), draft_vocab))

    @classmethod
    def from_module(cls, head, top_k: int = 4, tree_nodes: int = 16, keep: torch.Tensor | None = None
                    ) -> EagleDrafter:
        """A drafter over an in-memory :class:`~specdraft.heads.eagle.EagleHead`; ``keep`` (N,): the token ids it
        may draft (None: all)."""
        drafter = cls.__new__(cls)
        drafter._setup(head, top_k, tree_nodes, keep)
        return drafter

    def _setup(self, head, top_k: int, tree_nodes: int, keep: torch.Tensor | None = None) -> None:
        if not isinstance(top_k, int) or not isinstance(tree_nodes, int) or top_k < 1 or tree_nodes < 1:
            raise SpecdraftError(f"top_k and tree_nodes must be integers >= 1, got {top_k!r}, {tree_nodes!r}")
        self.keep, self._vocab = keep, None
        self.head = head.eval()
        self.top_k, self.tree_nodes = top_k, tree_nodes
        self.vocab_size = int(head.sizes["vocab_size"])
        self.max_context = int(head.sizes["max_position_embeddings"])
        self._embed = self._lm_head = self._cache = self._root = None
        self._features: list[torch.Tensor] = []
        self._received, self._fed = 0, 0  # feature rows observed; pairs in the cache

    def begin(self, target, cache) -> None:
        """A new generation: forget the feature stream; take the target's frozen embeddings and LM head."""

        embed, lm_head = target_weights(target)
        hidden = int(self.head.sizes["hidden_size"])
        if tuple(lm_head.shape) != (self.vocab_size, hidden) or tuple(embed.shape)[1:] != (hidden,):
            raise SpecdraftError(f"EAGLE head mismatch: trained for vocabulary {self.vocab_size} and hidden size "
                                 f"{hidden}, target {target.name!r} has LM head {tuple(lm_head.shape)}")
        if self.head.dtype != lm_head.dtype:
            self.head.to(lm_head.dtype)
        if self._lm_head is None or self._lm_head.data_ptr() != lm_head.data_ptr():  # a new target's weights
            self._vocab = DraftVocab(lm_head.detach(), self.keep)  # (N, D) rows copied once per LM head
        self._embed, self._lm_head = embed.detach(), lm_head.detach()
        self._cache = self._root = None
        self._features, self._received, self._fed = [], 0, 0

    def target_features(self) -> TargetFeatures:
        """The target's final-normed hidden states, EAGLE's features."""
        return TargetFeatures()

    def observe(self, result: VerifyResult) -> None:
        """Keep the committed tokens' features; they are paired and fed at the next ``propose``."""
        if result.hidden is not None and result.hidden.shape[0]:
            self._features.append(result.hidden.detach().reshape(-1, result.hidden.shape[-1]))  # (F, D)
            self._received += int(result.hidden.shape[0])

    @torch.inference_mode()
    def propose(
        self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Draft:
        if self._received == 0 or num_draft_tokens < 1:
            return EMPTY_DRAFT  # the first step: no features yet
        root = self._sync(context, num_draft_tokens)  # (D,)
        return self._tree(root, num_draft_tokens, sampling, generator)

    def _sync(self, context: torch.Tensor, depth: int) -> torch.Tensor:
        """Feed the pairs not yet in the head's cache; return the last pair's predicted feature g (D,)."""
        if self._lm_head is None:
            raise SpecdraftError("EagleDrafter.begin(target, cache) must be called before propose")
        if self._received != context.shape[0] - 1:
            raise SpecdraftError(f"EAGLE drafter holds features of {self._received} tokens but the context has "
                                 f"{context.shape[0]} (expected one more: the last token is not fed yet)")
        grown = grown_cache(self._cache, self._received + max(depth - 1, 0) * self.top_k, self.head.new_cache)
        if grown is not None:
            self._cache, self._fed = grown, 0
        if self._fed < self._received:
            features = torch.cat(self._features) if len(self._features) > 1 else self._features[0]  # (n, D)
            self._features = [features]
            new = features[self._fed :]  # (F, D)
            tokens = context[self._fed + 1 : self._received + 1]  # (F,) x_{i+1} of each new row i
            out = self.head(new[None], F.embedding(tokens, self._embed)[None], self._cache)  # (1, F, D)
            self._root, self._fed = out[0, -1], self._received
        return self._root

    def _logits(self, features: torch.Tensor) -> torch.Tensor:
        """Token logits of predicted features through the target's LM head (or its draft-vocabulary rows).
        (..., D) -> (..., V) float32."""
        return self._vocab.logits(features)

    def _tree(self, root: torch.Tensor, depth: int, sampling: SamplingConfig, generator) -> Draft:
        """An EAGLE-2 tree of at most ``tree_nodes`` nodes and ``depth`` levels (see the module docstring)."""
        base = self._cache.length  # committed pairs; tree pairs are fed after them and cropped at the end
        frontier = [(-1, root, self._logits(root))]  # (node, its predicted feature (D,), logits (V,))
        tokens, parents, q_rows, scores, slot_of = [], [], [], [], {}
        for level in range(depth):
            children, feature_of = [], {}
            for node, feature, logits in frontier:
                probs = torch.softmax(logits, -1) if sampling.greedy else warp(logits, sampling)  # (V,)
                tree = (tokens, parents, q_rows, scores)
                new = add_children(node, probs, self.top_k, sampling.greedy, generator, tree)
                children += new
                feature_of.update(dict.fromkeys(new, feature))
            if level + 1 == depth:
                break
            chosen = sorted(children, key=lambda n: -scores[n])[: self.top_k]
            out = self._expand(chosen, feature_of, tokens, parents, slot_of, base, level)  # (k, D)
            frontier = list(zip(chosen, out, self._logits(out), strict=True))
        self._cache.crop(base)
        return self._best_nodes(tokens, parents, q_rows, scores, sampling.greedy)

    def _expand(self, nodes: list[int], feature_of: dict, tokens: list[int], parents: list[int],
                slot_of: dict[int, int], base: int, level: int) -> torch.Tensor:
        """One head forward over ``nodes`` (all at depth ``level + 1``): pairs (parent's predicted feature, token),
        each attending the committed pairs, its fed ancestors and itself. Returns their predicted features (F, D)."""
        start = self._cache.length
        mask = expansion_mask(nodes, parents, slot_of, base, start)  # (F, S)
        positions = torch.full((len(nodes),), base + level, dtype=torch.long)  # (F,): pair L-2+depth
        features = torch.stack([feature_of[n] for n in nodes])[None]  # (1, F, D)
        embeds = F.embedding(torch.tensor([tokens[n] for n in nodes]), self._embed)[None]  # (1, F, D)
        return self.head(features, embeds, self._cache, positions, mask)[0]  # (F, D)

    def _best_nodes(self, tokens, parents, q_rows, scores, greedy: bool) -> Draft:
        """The ``tree_nodes`` most confident nodes, closed under ancestors, in node order (EAGLE-2's re-ranking)."""
        kept, new_parents = most_confident(parents, scores, self.tree_nodes)
        q = None if greedy else torch.stack(q_rows)[kept]  # (N, V)
        return Draft(torch.tensor(tokens, dtype=torch.long)[kept], q, new_parents)
