"""GliDe drafting with CaPE (Du et al. 2024, "GliDe with a CaPE: A Low-Hassle Method to Accelerate Speculative
Decoding", arXiv 2402.02082).

GliDe (Sec. 3). The draft model (:mod:`specdraft.heads.glide`) cross-attends to the target's KV cache: the drafter
states the :class:`~specdraft.drafters.base.ReadsTargetCache` capability, and the decoding loop hands it the
target's cache after ``begin``. At ``propose`` the cache holds every context token but the last (the root), written
by the last verify forward, so reading it costs the target nothing. The drafter feeds the context tokens it has not
fed yet into its own cache (each reads the target's keys before its position), then drafts a greedy chain: the node
at depth d is fed at position r + d (r the root's) and reads the target's keys before r. Only committed tokens stay
in the draft's cache; the chain's slots are cropped before ``propose`` returns.

CaPE, confidence-aware proposal expansion (Sec. 4). The draft's confidence at a depth, its largest probability
there, tells how likely the chain token is accepted; where it is low, extra candidates (the next most likely tokens)
join the tree as leaves beside the chain token, and the target verifies chain and candidates in one forward (a token
tree, SpecInfer). ``cape`` lists decreasing confidence thresholds: a depth whose confidence is below j of them gets j
extra candidates (``0.6/0.3``: one below 0.6, two below 0.3; empty: a plain chain). The candidates come from logits
the chain computed anyway, so they cost no draft forward, only verify width; the node count is capped by
``max_nodes``.

Every node is a point mass (q = None): greedy verification follows the target's argmax, and speculative sampling
accepts a point-mass candidate with probability p'(x) and otherwise removes it from the residual
(:func:`specdraft.verification.verify_tree_sampling`), so both are lossless.

Draft vocabulary (``draft_vocab=N``): the LM head multiplications use the N tokens most frequent in the training
data (FR-Spec, :mod:`specdraft.draft_vocab`), as EAGLE's drafter does.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from specdraft.draft_vocab import DraftVocab, draft_subset
from specdraft.drafters.base import EMPTY_DRAFT, Draft, DrafterFacts, ReadsTargetCache, grown_cache
from specdraft.drafters.draft_model import MODEL, SIBLING
from specdraft.drafters.loading import with_heads_defaults
from specdraft.drafters.options import build
from specdraft.errors import SpecdraftError
from specdraft.heads import load_heads
from specdraft.models.base import ReadableKVCache
from specdraft.models.shared_embeddings import target_weights
from specdraft.sampling import SamplingConfig
from specdraft.verification import VerifyResult


def parse_thresholds(cape: str) -> tuple[float, ...]:
    """``cape`` = decreasing confidence thresholds in (0, 1], '/'- or ','-separated; empty or ``off``: none."""
    text = str(cape).strip()
    if text.lower() in ("", "off", "0"):
        return ()
    try:
        values = tuple(float(part) for part in text.replace(",", "/").split("/"))
    except ValueError:
        raise SpecdraftError(f"cape must be decreasing thresholds in (0, 1] like 0.6/0.3, got {cape!r}") from None
    if any(not 0 < v <= 1 for v in values) or any(a <= b for a, b in itertools.pairwise(values)):
        raise SpecdraftError(f"cape must be decreasing thresholds in (0, 1] like 0.6/0.3, got {cape!r}")
    return values


def extra_candidates(confidence: float, thresholds: tuple[float, ...]) -> int:
    """CaPE's expansion: how many candidates beside the chain token a depth of this confidence gets."""
    return sum(confidence < t for t in thresholds)


class GlideDrafter(ReadsTargetCache):
    """Drafts a GliDe chain with CaPE's candidates, with a draft model trained by ``specdraft train-heads --kind
    glide``.

    Args:
        heads: the heads folder (``<out>/heads``).
        cape: CaPE's decreasing confidence thresholds (module docstring); empty: a plain chain.
        max_nodes: most nodes a draft holds, chain first.
        draft_vocab: draft only the N most frequent tokens of the training data (0: the whole vocabulary).
        quantize: ``int8`` multiplies the draft's LM head rows rounded to int8 blocks (CPU; lossless, drafts only),
            ``none`` dense.
    """

    name = "glide"

    method = "glide"
    facts = DrafterFacts(batchable=False, reads_target_cache=True)

    @classmethod
    def from_options(cls, target, tokenizer, options: dict[str, str]) -> GlideDrafter:
        """``--drafter glide``: ``heads=PATH`` (with the options the folder ships) and the constructor's."""
        return build(cls, with_heads_defaults(options, cls.method, cls.method))

    def __init__(self, heads: str, cape: str = "0.6/0.3", max_nodes: int = 16, draft_vocab: int = 0,
                 quantize: str = "none") -> None:
        if not str(heads).strip():
            raise SpecdraftError("glide needs heads=PATH: a folder made by `specdraft train-heads --kind glide`")
        _, head = load_heads(heads, kind="glide")
        self._setup(head, cape, max_nodes, draft_subset(heads, int(head.sizes["vocab_size"]), draft_vocab))
        if str(quantize).lower() not in ("none", "int8"):
            raise SpecdraftError(f"glide quantize must be none or int8, got {quantize!r}")
        self.quantize = None if str(quantize).lower() == "none" else "int8"

    @classmethod
    def from_module(cls, head, cape: str = "0.6/0.3", max_nodes: int = 16, keep: torch.Tensor | None = None
                    ) -> GlideDrafter:
        """A drafter over an in-memory :class:`~specdraft.heads.glide.GlideHead`."""
        drafter = cls.__new__(cls)
        drafter._setup(head, cape, max_nodes, keep)
        return drafter

    def _setup(self, head, cape: str, max_nodes: int, keep: torch.Tensor | None) -> None:
        if not isinstance(max_nodes, int) or max_nodes < 1:
            raise SpecdraftError(f"max_nodes must be an integer >= 1, got {max_nodes!r}")
        self.head, self.thresholds, self.max_nodes, self.keep = head.eval(), parse_thresholds(cape), max_nodes, keep
        self.vocab_size = int(head.sizes["vocab_size"])
        self.max_context = int(head.sizes["max_position_embeddings"])
        self._vocab = self._lm_head = self._embed = self._target_cache = self._cache = self._root = None
        self._fed, self.quantize = 0, None

    def begin(self, target, cache) -> None:
        """A new generation: take the target's frozen embeddings and LM head; forget the draft's cache."""

        embed, lm_head = target_weights(target)
        sizes = self.head.sizes
        if tuple(lm_head.shape) != (self.vocab_size, sizes["hidden_size"]) or tuple(embed.shape)[1:] != (
                sizes["hidden_size"],):
            raise SpecdraftError(f"GliDe head mismatch: trained for vocabulary {self.vocab_size} and hidden size "
                                 f"{sizes['hidden_size']}, target {target.name!r} has LM head {tuple(lm_head.shape)}")
        layers = getattr(getattr(target, "config", None), "num_hidden_layers", None)
        if layers is not None and layers != sizes["target_layers"]:
            raise SpecdraftError(f"GliDe head reads layer {sizes['glimpse_layer']} of a {sizes['target_layers']}-layer"
                                 f" target; {target.name!r} has {layers} layers")
        if self.head.dtype != lm_head.dtype:
            self.head.to(lm_head.dtype)
        if self._lm_head is None or self._lm_head.data_ptr() != lm_head.data_ptr():
            self._vocab = DraftVocab(lm_head.detach(), self.keep, self.quantize)  # (N, D) rows once per LM head
        self._embed, self._lm_head = embed.detach(), lm_head.detach()
        self._target_cache = self._cache = self._root = None
        self._fed = 0

    def read_target_cache(self, cache: ReadableKVCache) -> None:
        """This generation's target cache, read (never written) at every ``propose``."""
        self._target_cache = cache

    def observe(self, result: VerifyResult) -> None:
        """Nothing to learn: the committed tokens are fed at the next ``propose``."""

    @torch.inference_mode()
    def propose(self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        if num_draft_tokens < 1:
            return EMPTY_DRAFT
        glimpse = self._glimpse(context)  # (1, K, S, hd) twice: every context token but the root
        root = self._sync(context, num_draft_tokens, glimpse)  # (D,)
        return self._chain(root, context.shape[0] - 1, num_draft_tokens, glimpse)

    def _glimpse(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's cached keys and values of the glimpse layer, in the head's dtype."""
        cache = self._target_cache
        if self._lm_head is None or cache is None:
            raise SpecdraftError("GlideDrafter.begin(target, cache) and read_target_cache(cache) must come before "
                                 "propose")
        if cache.length != context.shape[0] - 1:
            raise SpecdraftError(f"GliDe reads the target's cache of every context token but the last: it holds "
                                 f"{cache.length} positions, the context has {context.shape[0]} tokens")
        if cache.length == 0:
            empty = torch.empty(1, self.head.config.num_key_value_heads, 0, self.head.config.head_dim,
                                dtype=self.head.dtype)
            return empty, empty
        keys, values = cache.layer_kv(self.head.glimpse_layer)  # (1, K, S, hd) each
        return keys.to(self.head.dtype), values.to(self.head.dtype)

    def _sync(self, context: torch.Tensor, depth: int, glimpse) -> torch.Tensor:
        """Feed the context tokens not yet in the draft's cache (each reads the target's keys before its position);
        return the root's hidden state (D,)."""
        length = context.shape[0]
        grown = grown_cache(self._cache, length + depth, self.head.new_cache)
        if grown is not None:
            self._cache, self._fed = grown, 0
        if self._fed < length:
            positions = torch.arange(self._fed, length)  # (T,)
            visible = torch.arange(glimpse[0].shape[2])[None, :] < positions[:, None]  # (T, S)
            embeds = F.embedding(context[self._fed :], self._embed)[None]  # (1, T, D)
            self._root, self._fed = self.head(embeds, glimpse, visible, self._cache)[0, -1], length
        return self._root

    def _chain(self, root: torch.Tensor, root_position: int, depth: int, glimpse) -> Draft:
        """A greedy chain of ``depth`` tokens from the root's hidden state, with CaPE's candidates as leaves."""
        committed = self._cache.length
        visible = torch.ones(1, glimpse[0].shape[2], dtype=torch.bool)  # (1, S): a node reads all before the root
        chain, leaves, hidden = [], [], root
        for level in range(depth):
            probs = torch.softmax(self._vocab.logits(hidden), -1)  # (V,)
            extra = extra_candidates(float(probs.max()), self.thresholds)
            top = probs.topk(1 + extra)
            chain.append((int(top.indices[0]), float(top.values[0])))
            leaves += [(level, int(t), float(v)) for t, v in zip(top.indices[1:], top.values[1:], strict=True)]
            if level + 1 < depth:
                embeds = F.embedding(top.indices[:1], self._embed)[None]  # (1, 1, D)
                hidden = self.head(embeds, glimpse, visible, self._cache,
                                   torch.tensor([root_position + level + 1]))[0, -1]  # (D,)
        self._cache.crop(committed)
        return self._draft(chain, leaves)

    def _draft(self, chain: list[tuple[int, float]], leaves: list[tuple[int, int, float]]) -> Draft:
        """The chain, then CaPE's candidates (each beside the chain token of its depth) while ``max_nodes`` allows."""
        chain = chain[: self.max_nodes]
        leaves = [leaf for leaf in leaves if leaf[0] < len(chain)][: self.max_nodes - len(chain)]
        tokens = [t for t, _ in chain] + [t for _, t, _ in leaves]
        parents = list(range(-1, len(chain) - 1)) + [level - 1 for level, _, _ in leaves]
        confidence = [c for _, c in chain] + [c for _, _, c in leaves]
        source = [MODEL] * len(chain) + [SIBLING] * len(leaves)
        return Draft(torch.tensor(tokens, dtype=torch.long), None,
                     torch.tensor(parents, dtype=torch.long) if leaves else None, None,
                     torch.tensor(confidence), torch.tensor(source, dtype=torch.long))


__all__ = ["GlideDrafter", "extra_candidates", "parse_thresholds"]
