"""Medusa drafting (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads", arXiv 2401.10774): K heads on the target's last hidden state fill a static token tree, verified in one
target forward with tree attention.

Offsets. The last feature row the loop hands over (``result.hidden[-1]``) is the target's final-normed hidden state
h_P of the last token it was fed, at position P. The LM head at P gave ``result.next_token``, the token at P+1,
which is the last token of ``context`` at the next ``propose`` and the root of the tree. Head k predicts the token
at P+1+k, so its top candidates fill depth k of the tree (Medusa's sparse trees, paper Sec. 2.1.2 and
``medusa_choices``: path (i, j) is head 2's j-th candidate under head 1's i-th).

Dynamic trees. With ``tree_nodes=N`` the tree is instead chosen at every step from the heads' own confidence, as
EAGLE-2 does for its head (Li et al. 2024, arXiv 2406.16858): a node at depth k scores the sum of log-softmax
probabilities of its path's candidates under heads 1..k (heads are independent, so this is Medusa's estimate of the
path's acceptance, paper Sec. 2.1.2, with the heads' probabilities standing in for measured top-i accuracies); each
depth keeps the N best-scoring nodes (a beam, each expanded into the head's ``top_k`` candidates), and the N best
nodes overall, closed under ancestors, are the draft. It lets a benchmark sweep the tree size with one option.

Draft vocabulary (``draft_vocab=N``, heads sharing the target's LM head): candidates come only from the N tokens most
frequent in the heads' training data (FR-Spec, :mod:`specdraft.draft_vocab`), which cuts the LM head product to N
rows.

Lossless: candidates are deterministic (q = None, point masses), which greedy and SpecInfer tree verification both
accept exactly. Medusa's lossy "typical acceptance" is not implemented.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdraft.draft_vocab import DraftVocab, draft_subset
from specdraft.drafters.base import EMPTY_DRAFT, Draft, DrafterFacts, ReadsTargetFeatures, TargetFeatures
from specdraft.drafters.loading import with_heads_defaults
from specdraft.drafters.options import build
from specdraft.errors import SpecdraftError
from specdraft.heads import load_heads
from specdraft.sampling import SamplingConfig
from specdraft.trees import most_confident, parents_from_paths
from specdraft.verification import VerifyResult

# A 16-node sparse tree of depth 4 in the spirit of Medusa's (``mc_sim_7b_63`` scaled down): more candidates
# where the heads are more often right (shallow depths, top ranks).
DEFAULT_TREE: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1),
)


def parse_tree(text: str) -> list[tuple[int, ...]]:
    """Choice paths from ``text``: empty for :data:`DEFAULT_TREE`; a ``.json`` file holding a list of paths; or
    paths separated by ``/`` or spaces with choices joined by ``.`` (``0/1/0.0/0.1``; no ``,`` or ``;``, which
    bench's method list uses)."""
    text = text.strip()
    if not text:
        return list(DEFAULT_TREE)
    if text.endswith(".json"):
        try:
            paths = json.loads(Path(text).expanduser().read_text())
            return [tuple(int(c) for c in path) for path in paths]
        except OSError as exc:
            raise SpecdraftError(f"cannot read Medusa tree file {text}: {exc.strerror}") from None
        except (ValueError, TypeError) as exc:
            raise SpecdraftError(f"Medusa tree file {text} must hold a JSON list of paths (lists of ints): "
                                 f"{exc}") from None
    try:
        return [tuple(int(c) for c in path.split(".")) for path in text.replace("/", " ").split()]
    except ValueError:
        raise SpecdraftError(f"Medusa tree must look like 0/1/0.0/0.1 (paths of choice ranks), got {text!r}") from None


class MedusaDrafter(ReadsTargetFeatures):
    """Drafts a static token tree from Medusa heads trained by ``specdraft train-heads --kind medusa``.

    Args:
        heads: the heads folder (``<out>/heads``).
        tree: the static tree as choice paths (see :func:`parse_tree`); empty = :data:`DEFAULT_TREE` (16 nodes).
        top_k: paths that use a candidate rank >= top_k are dropped (top_k = 1: a chain of each head's argmax);
            in a dynamic tree, the candidates each node is expanded into.
        tree_nodes: 0 for the static ``tree``; N >= 1 for a dynamic tree of N nodes (module docstring).
        draft_vocab: candidates only from the N most frequent training tokens (0: the whole vocabulary).
    The tree is also cut to depth min(γ, number of heads) at each step.
    """

    name = "medusa"
    max_context = None

    method = "medusa"
    facts = DrafterFacts(cpu_only=True, reads_target_features=True)

    @classmethod
    def from_options(cls, target, tokenizer, options: dict[str, str]) -> MedusaDrafter:
        """``--drafter medusa``: ``heads=PATH`` (with the options the folder ships) and the constructor's."""
        return build(cls, with_heads_defaults(options, cls.method))

    def __init__(self, heads: str, tree: str = "", top_k: int = 10, tree_nodes: int = 0, draft_vocab: int = 0) -> None:
        if not str(heads).strip():
            raise SpecdraftError("medusa needs heads=PATH: a heads folder made by `specdraft train-heads`")
        _, module = load_heads(heads, kind="medusa")
        self._setup(module, tree, top_k, tree_nodes, draft_subset(heads, module.vocab_size, draft_vocab))

    @classmethod
    def from_module(cls, module, tree: str = "", top_k: int = 10, tree_nodes: int = 0,
                    keep: torch.Tensor | None = None) -> MedusaDrafter:
        """A drafter over in-memory :class:`~specdraft.heads.medusa.MedusaHeads` (CPU, fp32); ``keep`` (N,): the
        token ids it may draft (None: all)."""
        drafter = cls.__new__(cls)
        drafter._setup(module, tree, top_k, tree_nodes, keep)
        return drafter

    def _setup(self, module, tree: str, top_k: int, tree_nodes: int = 0, keep: torch.Tensor | None = None) -> None:
        if keep is not None and not module.share_lm_head:
            raise SpecdraftError("draft_vocab needs heads that share the target's LM head (--share-lm-head)")
        self.keep, self._vocab = keep, None
        if not isinstance(top_k, int) or top_k < 1:
            raise SpecdraftError(f"top_k must be an integer >= 1, got {top_k!r}")
        if not isinstance(tree_nodes, int) or tree_nodes < 0:
            raise SpecdraftError(f"tree_nodes must be an integer >= 0 (0 = the static tree), got {tree_nodes!r}")
        if tree_nodes and str(tree).strip():
            raise SpecdraftError("give either tree (a static tree) or tree_nodes (a dynamic one), not both")
        self.tree_nodes, self.top_k = tree_nodes, top_k
        self.heads = module.float().eval()
        self.vocab_size = module.vocab_size
        paths = [p for p in parse_tree(tree) if max(p, default=0) < min(top_k, module.vocab_size)]
        parents_from_paths(paths)  # validate the whole tree once
        self.paths = paths
        self._trees: dict[int, tuple[torch.Tensor, list[tuple[int, ...]]]] = {}
        self.lm_head: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None

    def _tree(self, depth: int) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
        """(parents, paths in node order) of the tree cut to ``depth``."""
        if depth not in self._trees:
            kept = [p for p in self.paths if len(p) <= depth]
            self._trees[depth] = parents_from_paths(kept) if kept else (torch.empty(0, dtype=torch.long), [])
        return self._trees[depth]

    def target_features(self) -> TargetFeatures:
        """The target's final-normed hidden states, which every head reads."""
        return TargetFeatures()

    def begin(self, target, cache) -> None:
        """A new generation: forget the last features; take the target's LM head when the heads share it."""
        self.hidden = None
        weight = getattr(target, "lm_head_weight", None)
        if weight is None and hasattr(target, "model"):
            weight = target.model.get_output_embeddings().weight
        if target.vocab_size != self.vocab_size or (weight is not None and weight.shape[-1] != self.heads.hidden_size):
            width = None if weight is None else weight.shape[-1]
            raise SpecdraftError(f"vocabulary mismatch: Medusa heads were trained for a vocabulary of "
                                 f"{self.vocab_size} and hidden size {self.heads.hidden_size}, target "
                                 f"{target.name!r} has {target.vocab_size} and {width}")
        if self.heads.share_lm_head:
            if weight is None:
                raise SpecdraftError(f"target {target.name!r} exposes no LM head weight for shared Medusa heads")
            if self.lm_head is None or self.lm_head.data_ptr() != weight.data_ptr():
                self.heads.to(weight.dtype)  # heads run in the target's dtype, on its LM head (no copy)
                self.lm_head = weight.detach()
                self._vocab = DraftVocab(self.lm_head, self.keep)  # (N, D) rows when keep is given

    @torch.no_grad()
    def propose(
        self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Draft:
        """Head k's ranked candidates fill depth k of the static tree under the root ``context[-1]``."""
        if self.hidden is None or num_draft_tokens < 1:
            return EMPTY_DRAFT  # the first step: no features yet
        if self.tree_nodes:
            return self._dynamic(min(num_draft_tokens, self.heads.num_heads))
        parents, paths = self._tree(min(num_draft_tokens, self.heads.num_heads))
        if not paths:
            return EMPTY_DRAFT
        depth = max(len(p) for p in paths)
        ranks = 1 + max(max(p) for p in paths)
        logits = self._head_logits(depth)  # (depth, V)
        top = logits.topk(ranks, dim=-1).indices  # (depth, ranks)
        tokens = torch.tensor([int(top[len(p) - 1, p[-1]]) for p in paths], dtype=torch.long)  # (N,)
        return Draft(tokens, parents=parents)

    def _head_logits(self, depth: int) -> torch.Tensor:
        """Logits (depth, V) of heads 1..depth at the last feature (-inf outside a draft vocabulary)."""
        hidden = self.hidden.to(self.heads.blocks[0].weight.dtype)  # (D,)
        if self._vocab is None:  # heads with their own projections
            return self.heads(hidden)[:depth].float()
        return self._vocab.logits(self.heads.features(hidden)[:depth])  # (depth, V)

    def _dynamic(self, depth: int) -> Draft:
        """A tree of at most ``tree_nodes`` nodes scored by the heads' cumulative log-probabilities (docstring)."""
        logits = self._head_logits(depth)  # (depth, V)
        width = min(self.top_k, self.tree_nodes, self.vocab_size)
        logp, top = torch.log_softmax(logits, -1).topk(width, dim=-1)  # (depth, width) each
        logp, top = logp.tolist(), top.tolist()
        tokens, parents, scores, frontier = [], [], [], [-1]
        for k in range(depth):
            level = []
            for node in frontier:
                base = scores[node] if node >= 0 else 0.0
                for rank in range(width):
                    level.append(len(tokens))
                    tokens.append(top[k][rank])
                    parents.append(node)
                    scores.append(base + logp[k][rank])
            frontier = sorted(level, key=lambda n: -scores[n])[: self.tree_nodes]
        kept, new_parents = most_confident(parents, scores, self.tree_nodes)
        return Draft(torch.tensor(tokens, dtype=torch.long)[kept], parents=new_parents)

    def observe(self, result: VerifyResult) -> None:
        """Keep the hidden state of the last committed token the target was fed."""
        hidden = getattr(result, "hidden", None)
        if hidden is not None and hidden.shape[0]:
            self.hidden = hidden[-1].detach()  # (D,)
