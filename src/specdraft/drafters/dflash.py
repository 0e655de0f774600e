"""DFlash drafting (Chen et al. 2026, arXiv 2602.06036): a whole block of draft tokens from one forward of a small
non-causal drafter conditioned on the target's features (:mod:`specdraft.heads.dflash`), as llama.cpp's
``draft-dflash`` drafts.

The feature stream. The loop hands over, after every step, the target's residual stream after the head's
``target_layer_ids`` of the tokens it fed and committed (``result.hidden``, (F, kD): the verify forward returns them,
so there is no extra target forward). With context x_0 .. x_{L-1} the drafter holds features of x_0 .. x_{L-2}
(x_{L-1}, the last committed token, is not fed yet). ``propose`` encodes the rows not yet cached into every draft
layer's context keys and values (the draft KV cache); only committed tokens ever enter it, so rejected drafts never
need rolling back; the block's own keys and values are scratch in the slots after the context, overwritten by the
next committed rows.

The block. One forward over [x_{L-1}, MASK x (B - 1)] at positions L - 1 .. L + B - 2 gives B - 1 per-position
distributions q_1 .. q_{B-1}; the draft is the chain of its first ``num_draft_tokens`` (at most B - 1), whatever the
length costs one forward. Greedy: x_j = argmax q_j (q = None, a point mass). Sampling: x_j ~ q_j, each from its own
warped distribution (independent of x_1 .. x_{j-1}); verification accepts x_j with min(1, p(x_j | prefix) / q_j(x_j))
and resamples from norm(max(p - q_j, 0)), which is exact for any proposal distribution fixed before the draw
(Leviathan et al. 2023, Alg. 1), so the chain is lossless. ``confidence`` is each row's largest probability, read
before the draw, so adaptive speculation (:mod:`specdraft.speculation`) may cut the chain; the drafter's facts say
that one forward drafts any length, so the policy prices a draft at one forward's cost.

Weights (``quantize``): by default (``auto``) the drafter runs on specdraft's int8 kernels (Q8_0 blocks,
:mod:`specdraft.models.quantized`) where they can run: each draft layer is one fused call for the block's rows and one
that writes new context rows' keys and values (``quantlayer.cpp``), fc and the LM head int8 products; a block's few
rows are far cheaper there than through eager fp32 ops (the 8,192-row LM head most of all). Only the drafts change;
verification stays exact.

Tree mode (``tree_branching`` k > 0): q_j does not depend on the tokens drafted before position j, so the block's
one forward also gives a token tree, grown as EAGLE-2 grows one (Li et al. 2024): the children of a depth-(j - 1)
node are the top-k tokens of q_j (greedy) or k i.i.d. draws from it (sampling: every node's children are independent
draws from one row fixed before the draws, SpecInfer's multi-draft rule, so verification stays exact); the k children
of a depth with the highest cumulative draft log-probability are expanded next, and the ``tree_nodes`` most confident
nodes are kept, closed under ancestors. Depth = num_draft_tokens (at most B - 1); the tree costs the one forward.

The first step of a generation has no features yet and proposes nothing (plain decoding).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from specdraft.drafters.base import (
    EMPTY_DRAFT,
    Draft,
    DrafterFacts,
    ReadsTargetFeatures,
    TargetFeatures,
    check_feature_target,
    confident_tree,
    int8_drafting,
)
from specdraft.drafters.loading import with_heads_defaults
from specdraft.drafters.options import build
from specdraft.errors import SpecdraftError
from specdraft.heads import load_heads
from specdraft.models import quantized
from specdraft.models.registry import default_heads
from specdraft.models.shared_embeddings import target_weights
from specdraft.sampling import SamplingConfig, argmax, check_finite, warp
from specdraft.verification import VerifyResult


class DFlashDrafter(ReadsTargetFeatures):
    """Drafts a block per forward with a DFlash head trained by ``specdraft train-heads --kind dflash``.

    Args:
        heads: the heads folder (``<out>/heads``) or the name of shipped heads.
        quantize: ``auto`` (int8 kernels where they run, else the dense weights), ``int8`` or ``none``.
        tree_branching: 0 drafts a chain; k > 0 a tree of k children per expanded node (module docstring).
        tree_nodes: the most nodes a tree keeps.
    """

    name = "dflash"

    method = "dflash"
    facts = DrafterFacts(cpu_only=True, reads_target_features=True, one_forward_draft=True)

    @classmethod
    def from_options(cls, target, tokenizer, options: dict[str, str]) -> DFlashDrafter:
        """``--drafter dflash``: ``heads=PATH``, or without it the heads shipped for the target (SmolLM2-135M-Instruct:
        ``smollm2-135m-instruct-dflash``)."""
        if "heads" not in options:
            options = {"heads": default_heads("dflash", getattr(target, "name", ""))} | options
        return build(cls, with_heads_defaults(options, cls.method, cls.method))

    def __init__(self, heads: str, quantize: str = "auto", tree_branching: int = 0, tree_nodes: int = 16) -> None:
        if not str(heads).strip():
            raise SpecdraftError("dflash needs heads=PATH: a folder made by `specdraft train-heads --kind dflash`")
        _, head = load_heads(heads, kind="dflash")
        self._setup(head, quantize, tree_branching, tree_nodes)

    @classmethod
    def from_module(cls, head, quantize: str = "none", tree_branching: int = 0, tree_nodes: int = 16
                    ) -> DFlashDrafter:
        """A drafter over an in-memory :class:`~specdraft.heads.dflash.DFlashHead` (its weights as they are unless
        ``quantize``)."""
        drafter = cls.__new__(cls)
        drafter._setup(head, quantize, tree_branching, tree_nodes)
        return drafter

    def _setup(self, head, quantize: str, tree_branching: int, tree_nodes: int) -> None:
        if tree_branching < 0 or tree_nodes < 1:
            raise SpecdraftError(f"dflash needs tree_branching >= 0 and tree_nodes >= 1, got {tree_branching}, "
                                 f"{tree_nodes}")
        self.tree_branching, self.tree_nodes = tree_branching, tree_nodes
        self.quantize = int8_drafting("dflash", quantize)
        self.head = head.eval()
        self._run: DenseBlock | FusedBlock | None = None  # what drafts: the head in the target's dtype, or int8 calls
        self.vocab_size = int(head.spec["vocab_size"])
        self.max_context = int(head.spec["max_position_embeddings"])
        self.hidden_layers = tuple(i + 1 for i in head.target_layer_ids)  # inputs of the next layers
        self._embed = None
        self._reset()

    def _reset(self) -> None:
        self._features: list[torch.Tensor] = []
        self._received, self._fed = 0, 0  # feature rows observed; rows in the draft KV cache
        self._keys: list[torch.Tensor] = []  # per layer (1, K, capacity, hd): context rows, then the block's scratch
        self._values: list[torch.Tensor] = []

    def target_features(self) -> TargetFeatures:
        """The residual stream after the head's ``target_layer_ids`` (entering the next layers), concatenated."""
        return TargetFeatures(self.hidden_layers)

    def begin(self, target, cache) -> None:
        """A new generation: forget the feature stream and the draft KV cache; take the target's embeddings."""
        embed, _ = target_weights(target)
        check_feature_target("DFlash", target, embed, self.vocab_size, int(self.head.spec["hidden_size"]),
                             self.hidden_layers, self.head.target_layer_ids)
        if self.quantize:
            self._run = self._run or FusedBlock(self.head)
        else:
            self.head.to(embed.dtype)
            self._run = DenseBlock(self.head)
        self._embed = embed.detach()
        self._ids = self.head.d2t  # (V_d,)
        self._reset()

    def observe(self, result: VerifyResult) -> None:
        """Keep the committed tokens' target features (F, kD); ``propose`` encodes them into the draft KV cache."""
        if result.hidden is not None and result.hidden.shape[0]:
            self._features.append(result.hidden.detach().reshape(-1, result.hidden.shape[-1]))
            self._received += int(result.hidden.shape[0])

    @torch.inference_mode()
    def propose(self, context: torch.Tensor, num_draft_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        if self._received == 0 or num_draft_tokens < 1:
            return EMPTY_DRAFT  # the first step: no features yet
        self._sync(context)
        logits = self._block(context, min(num_draft_tokens, self.head.block_size - 1))  # (n, V_d)
        if self.tree_branching:
            return self._tree(logits, sampling, generator)
        if sampling.greedy:  # the draft vocabulary's argmax and softmax are the full vocabulary's
            best = argmax(logits)  # (n,)
            confidence = torch.softmax(logits, -1).gather(-1, best[:, None])[:, 0]  # (n,)
            return Draft(self._ids[best], None, confidence=confidence)
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))  # (n, V)
        probs = warp(full.index_copy_(-1, self._ids, logits), sampling)  # (n, V): q_j, 0 outside the draft vocab
        tokens = torch.multinomial(probs, 1, generator=generator).flatten()  # (n,): x_j ~ q_j
        return Draft(tokens, probs, confidence=probs.max(-1).values)

    def _tree(self, logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        """A tree over the block's n per-position distributions (n, V_d) (module docstring)."""
        greedy, branching = sampling.greedy, self.tree_branching
        if greedy:  # q_j over the draft vocabulary; a level's children are the same top-k under every node
            top = torch.softmax(logits, -1).topk(min(branching, logits.shape[-1]), -1)  # (n, k) each
            ids, values = self._ids[top.indices].tolist(), top.values.tolist()
        else:
            full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))  # (n, V)
            probs = warp(full.index_copy_(-1, self._ids, logits), sampling)  # (n, V): q_j
        tokens, parents, levels, scores, frontier = [], [], [], [], [-1]
        for level in range(logits.shape[0]):
            children = []
            for node in frontier:
                if greedy:
                    picks, chances = ids[level], values[level]
                else:
                    drawn = torch.multinomial(probs[level], branching, replacement=True, generator=generator)  # (k,)
                    picks, chances = drawn.tolist(), probs[level, drawn].tolist()
                for token, chance in zip(picks, chances, strict=True):
                    children.append(len(tokens))
                    tokens.append(token)
                    parents.append(node)
                    levels.append(level)
                    scores.append((scores[node] if node >= 0 else 0.0) + math.log(max(chance, 1e-30)))
            frontier = sorted(children, key=lambda c: -scores[c])[:branching]
        q = None if greedy else probs[torch.tensor(levels)]  # (N, V): the row each node was drawn from
        return confident_tree(tokens, parents, scores, self.tree_nodes, q)

    def _sync(self, context: torch.Tensor) -> None:
        """Encode the feature rows not yet in the draft KV cache into every layer's keys and values."""
        if self._embed is None:
            raise SpecdraftError("DFlashDrafter.begin(target, cache) must be called before propose")
        if self._received != context.shape[0] - 1:
            raise SpecdraftError(f"DFlash drafter holds features of {self._received} tokens but the context has "
                                 f"{context.shape[0]} (expected one more: the last token is not fed yet)")
        if self._fed == self._received:
            return
        pending = torch.cat(self._features) if len(self._features) > 1 else self._features[0]  # (F, kD)
        self._features = []  # only rows not yet encoded are kept
        needed = self._received + self.head.block_size  # the context and the block's scratch
        if not self._keys or self._keys[0].shape[2] < needed:
            capacity = max(needed, min(max(2 * needed, 256), self.max_context + self.head.block_size))
            fresh = self._run.new_cache(capacity)
            for old, new in zip(self._keys + self._values, fresh[0] + fresh[1], strict=bool(self._keys)):
                new[:, :, : self._fed] = old[:, :, : self._fed]  # (1, K, fed, hd)
            self._keys, self._values = fresh
        self._run.encode(pending, self._keys, self._values, self._fed)
        self._fed = self._received

    def _block(self, context: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """One forward over [x_{L-1}, MASK x (B-1)]: the first ``rows`` (default all B - 1) draft positions' float32
        logits over the draft vocabulary, (rows, V_d); the LM head reads only those rows."""
        logits = self._run.block(context[-1:], self._embed, self._keys, self._values, context.shape[0] - 1,
                                 rows or self.head.block_size - 1)  # (rows, V_d)
        check_finite(logits, "draft")
        return logits


class DenseBlock:
    """The head's own modules, in the target's dtype: a draft KV cache of that dtype."""

    def __init__(self, head) -> None:
        self.head = head

    def new_cache(self, capacity: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per draft layer, empty keys and values (1, K, capacity, hd)."""
        spec = self.head.spec
        shape = (1, spec["num_key_value_heads"], capacity, spec["head_dim"])
        layers = range(len(self.head.layers))
        return ([torch.zeros(shape, dtype=self.head.dtype) for _ in layers],
                [torch.zeros(shape, dtype=self.head.dtype) for _ in layers])

    def encode(self, features: torch.Tensor, keys: list, values: list, start: int) -> None:
        """Features (F, kD) of the context positions ``start ..`` -> their keys and values in every layer's cache."""
        g = self.head.encode(features)[None]  # (1, F, D)
        end = start + features.shape[0]
        for layer, (key, value) in enumerate(self.head.context(g, torch.arange(start, end))):  # (1, K, F, hd) each
            keys[layer][:, :, start:end] = key
            values[layer][:, :, start:end] = value

    def block(self, anchor: torch.Tensor, embed: torch.Tensor, keys: list, values: list, n: int,
              rows: int) -> torch.Tensor:
        """The block [anchor, MASK ...] at positions n .. n + B - 1 over the n cached context rows: rows 1 .. rows'
        float32 logits (rows, V_d)."""
        h = self.head.block_embeddings(anchor, embed)  # (1, B, D)
        positions = torch.arange(n, n + self.head.block_size)  # (B,)
        kv = [(k[:, :, :n], v[:, :, :n]) for k, v in zip(keys, values, strict=True)]
        hidden = self.head(h, positions, kv)[0, 1 : 1 + rows]  # (rows, D)
        return self.head.logits(hidden).float()


class FusedBlock:
    """The head on specdraft's int8 kernels (Q8_0 blocks): per draft layer one fused call (``quantlayer.cpp``) for
    the block's rows, Qwen3's q/k norms included, every slot visible (the non-causal block; its keys and values go to
    the scratch slots after the context), and one ``kv_only`` call for new context rows with ``hidden_norm`` as the
    input norm (so K_t = rope(k_norm(k_proj g_t)), V_t = v_proj g_t, g_t = hidden_norm(fc a_t)); fc and the LM head
    are int8 products. A block is a few calls instead of ~60 eager ops. The cache is float32."""

    def __init__(self, head) -> None:
        spec = head.spec
        self.block_size, self.eps = head.block_size, float(spec["rms_norm_eps"])
        self.kv_shape = (spec["num_key_value_heads"], spec["head_dim"])
        self.inv_freq = head.inv_freq.float()  # (hd/2,)
        self.fc, self.lm_head = _q8(head.fc.weight), _q8(head.lm_head.weight)
        self.norm, self.mask_embedding = _dense(head.norm.weight), _dense(head.mask_embedding)  # (D,) each
        self.layers, self.context_layers = [], []
        for layer in head.layers:
            attn, mlp = layer.self_attn, layer.mlp
            weights = [_q8(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])),
                       _q8(attn.o_proj.weight), _q8(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                       _q8(mlp.down_proj.weight)]
            fused = quantized.FusedLayer([w.packed for w in weights], [w.kind for w in weights],
                                         _dense(layer.input_layernorm.weight),
                                         _dense(layer.post_attention_layernorm.weight), self.eps, attn.num_heads,
                                         attn.num_kv_heads, _dense(attn.q_norm.weight), _dense(attn.k_norm.weight))
            self.layers.append(fused)
            self.context_layers.append(dataclasses.replace(fused, attn_norm=_dense(head.hidden_norm.weight)))

    def _rope(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.arange(start, start + count, dtype=torch.float32)[:, None] * self.inv_freq  # (T, hd/2)
        return angles.cos(), angles.sin()

    def new_cache(self, capacity: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        shape = (1, self.kv_shape[0], capacity, self.kv_shape[1])
        return [torch.zeros(shape) for _ in self.layers], [torch.zeros(shape) for _ in self.layers]

    def encode(self, features: torch.Tensor, keys: list, values: list, start: int) -> None:
        x = quantized.linear(features.float().contiguous(), self.fc)[None]  # (1, F, D): fc(a), normed in the call
        cos, sin = self._rope(start, features.shape[0])
        for layer, key, value in zip(self.context_layers, keys, values, strict=True):
            quantized.fused_layer(x, layer, key, value, start, cos, sin, None, kv_only=True)

    def block(self, anchor: torch.Tensor, embed: torch.Tensor, keys: list, values: list, n: int,
              rows: int) -> torch.Tensor:
        first = F.embedding(anchor, embed).float()  # (1, D)
        h = torch.cat([first, self.mask_embedding.expand(self.block_size - 1, -1)])[None]  # (1, B, D)
        cos, sin = self._rope(n, self.block_size)
        for layer, key, value in zip(self.layers, keys, values, strict=True):
            h = quantized.fused_layer(h, layer, key, value, n, cos, sin, None)  # (1, B, D)
        hidden = F.rms_norm(h[0, 1 : 1 + rows], self.norm.shape, self.norm, self.eps)  # (rows, D)
        return quantized.linear(hidden.contiguous(), self.lm_head)  # (rows, V_d)


def _q8(weight: torch.Tensor) -> quantized.QuantizedWeight:
    return quantized.quantize(weight.detach().float(), "q8_0")


def _dense(weight: torch.Tensor) -> torch.Tensor:
    return weight.detach().float().contiguous()
