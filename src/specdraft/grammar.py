"""Structured outputs: a grammar's token mask on the target's p at every verified position, with xgrammar (Dong et
al. 2024, *XGrammar: Flexible and Efficient Structured Generation Engine for Large Language Models*), an optional
dependency (the ``grammar`` extra).

Exact under speculation. :class:`GrammarProcessor` is a :class:`~specdraft.sampling.LogitsProcessor`: at each row
of a verify it advances a matcher along the committed tokens and the draft's path to that row, masks the target's
logits there (forbidden tokens at -inf, before warping), and rolls the matcher back, so each row's p is the masked
p plain constrained decoding would use at that position. A row behind a draft token the grammar refuses is never
reached (that token has p = 0, so it is rejected), and is left unmasked. Before verification,
:meth:`GrammarProcessor.allowed_nodes` tells which draft tokens the grammar allows; :func:`grammar_cut` keeps the
draft up to them. A refused token with a draft distribution q stays (its rejection draws the recovered token from
norm(max(0, p - q)), which is not p, so dropping it would bias the answer); what follows it goes. A refused
deterministic token (q a point mass, or greedy decoding) goes too: there norm(max(0, p - q)) = p, since p(x) = 0.

The grammar as a drafter. Where the grammar allows one continuation only (keys, punctuation, the rest of an enum
value, closing braces), :meth:`GrammarProcessor.forced_tokens` gives it as tokens: xgrammar's jump-forward string
(the longest string certain from the matcher's state, as in SGLang's jump-forward decoding) in the tokenizer's own
encoding, cut before the first token that a following character could merge into (the encoding of the string and
of the string plus each of :data:`PROBES` must agree up to there), so the tokens are the ones the target itself
would produce. They are only proposed: the target verifies them like any draft
(:class:`~specdraft.drafters.grammar_draft.GrammarDrafter`).

Closed within the token budget. A sequence's fork knows the most tokens it may generate (``max_new_tokens``, its
stop token included). Near the end of that budget each masked row also prices a short way to finish the document
from there (:meth:`GrammarProcessor.close_plan`: a text chosen a character at a time from the state alone, the
jump-forward string where there is one, else the first character in :data:`CLOSERS`' order that the grammar allows;
encoded by the tokenizer, then a stop token). Once the plan
fills all but :data:`CLOSE_SLACK` of the tokens left, a row keeps the plan's next token and those of its
:data:`CLOSE_CANDIDATES` likeliest allowed tokens after which a plan still fits in what is left; the others get
-inf. So an answer that would end in time is left as it is (its greedy token always fits), and one that would not
(a string repeating itself) ends as a complete document, its last string cut short, instead of at the budget
mid-structure, which no client can parse. The kept set depends on the row's tokens and logits only, which plain and
speculative decoding share, so exactness holds as for the mask. A budget too small for any plan still ends at the
budget (``finish_reason`` "length").

JSON is compact here (no whitespace but the space after ``,`` and ``:``), and a token holding a control character
(U+0000 to U+001F) is never allowed: xgrammar's schema grammars let one stand unescaped inside a string
(mlc-ai/xgrammar#286), which is not JSON (RFC 8259, Sec. 7), and compact JSON needs none elsewhere.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Callable

import torch

from specdraft.errors import SpecdraftError

GRAMMAR_EXTRA = "pip install 'specdraft[grammar]' (xgrammar)"

# JSON Schema keywords the compiled grammar honours (OpenAI's structured-output subset, as xgrammar converts it);
# any other keyword in a schema is refused by name rather than silently ignored.
SCHEMA_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "enum", "const", "anyOf",
    "oneOf", "$ref", "$defs", "definitions", "description", "title", "default", "examples", "$schema", "$id",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "pattern", "format",
    "minItems", "maxItems", "minProperties", "maxProperties", "propertyNames", "strict", "nullable",
})
# the characters a close plan tries where the grammar forces none, in this order: end the open string, array and
# object first, then the shortest values
CLOSERS = '"]},1023456789.: -' + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
CLOSE_HORIZON = 128  # plans are priced only this many tokens before the budget ends
CLOSE_SLACK = 16  # tokens to spare when rows start to keep only tokens after which a plan fits
CLOSE_CANDIDATES = 8  # a row's likeliest allowed tokens checked for a plan that fits after them
# characters that may follow a forced string, probed to find where its encoding stops being certain
PROBES = ("a", "A", "1", '"', " ", "{", "[", "-", ".", "}", "]", ",")
# an EBNF string literal, a character class, or the rule name ``root`` (group 1): the one the last is renamed to
_EBNF_NAMES = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|\b(root)\b')
_VALUE_RULE = "json_value"
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")  # keyword -> {name: schema}
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")  # keyword -> [schema]
_SUBSCHEMAS = ("items", "additionalProperties", "propertyNames")  # keyword -> schema (or a bool)


def unsupported_schema_feature(schema, where: str = "#") -> str | None:
    """The first keyword of ``schema`` outside :data:`SCHEMA_KEYWORDS` (or a ``$ref`` that is not local), as
    "keyword at path", or None."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"a schema that is not an object at {where}"
    for key, value in schema.items():
        if key not in SCHEMA_KEYWORDS:
            return f"{key!r} at {where}"
        if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
            return f"a $ref that is not local ({value!r}) at {where}"
        children = []
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            children = [(f"{where}/{key}/{name}", sub) for name, sub in value.items()]
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            children = [(f"{where}/{key}/{i}", sub) for i, sub in enumerate(value)]
        elif key in _SUBSCHEMAS:
            children = [(f"{where}/{key}", value)]
        for path, sub in children:
            found = unsupported_schema_feature(sub, path)
            if found is not None:
                return found
    return None


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise SpecdraftError(f"structured outputs need the grammar library: {GRAMMAR_EXTRA}") from None
    return xgrammar


class GrammarCompiler:
    """Compiles JSON grammars for one tokenizer and vocabulary, caching the last ``cache_size`` by schema.

    Args:
        tokenizer: a Hugging Face tokenizer; vocab_size: the target's logits (V); stop_token_ids: the ids that end
            an answer, allowed once the grammar is complete.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...], cache_size: int = 64) -> None:
        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        self._start(info, vocab_size, cache_size)
        self.encode = lambda text: tokenizer.encode(text, add_special_tokens=False)

    @classmethod
    def from_vocab(cls, tokens: list[str], stop_token_ids: tuple[int, ...], cache_size: int = 64) -> GrammarCompiler:
        """A compiler for a vocabulary given as each token's text (token i is ``tokens[i]``)."""
        xgr = _xgrammar()
        compiler = cls.__new__(cls)
        info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=len(tokens), stop_token_ids=list(stop_token_ids))
        compiler._start(info, len(tokens), cache_size)
        compiler.encode = longest_match(tokens)
        return compiler

    def _start(self, info, vocab_size: int, cache_size: int) -> None:
        self.vocab_size, self.cache_size = vocab_size, cache_size
        self._compiler = _xgrammar().GrammarCompiler(info, max_threads=1)
        self._cache: OrderedDict[str, object] = OrderedDict()
        self.encode: Encoder | None = None
        spellable = torch.ones(vocab_size, dtype=torch.bool)  # (V,) tokens without a control character
        newlines = torch.zeros(vocab_size, dtype=torch.bool)  # (V,) tokens of newlines only
        for token, text in enumerate(info.decoded_vocab[:vocab_size]):
            spellable[token] = not any(byte < 0x20 for byte in text)
            newlines[token] = bool(text) and set(text) == {0x0A}
        spellable[list(info.stop_token_ids)] = True
        self.spellable, self.newlines = spellable, newlines
        self.char_tokens = char_tokens(info.decoded_vocab[:vocab_size], spellable)

    def json_object(self) -> GrammarProcessor:
        """Any JSON object (OpenAI's ``json_object``), compact: no whitespace but after ``,`` and ``:``, so that
        a model cannot spin in whitespace."""
        return self._processor("json_object", lambda: self._compile({"type": "object"}, strict=False))

    def json_schema(self, schema: dict) -> GrammarProcessor:
        """JSON valid against ``schema``, compact as :meth:`json_object`, strict (OpenAI's ``strict: true``: no
        property outside ``properties`` unless the schema allows more). A schema that is malformed or uses a keyword
        the grammar would not honour raises :class:`SpecdraftError`."""
        found = unsupported_schema_feature(schema)
        if found is not None:
            raise SpecdraftError(f"unsupported JSON schema feature: {found}")
        return self._processor("json_schema:" + json.dumps(schema, sort_keys=True),
                               lambda: self._compile(schema, strict=True))

    def json_schema_list(self, schema: dict, separator: str) -> GrammarProcessor:
        """One or more JSON values, each valid against ``schema`` (as :meth:`json_schema`), with ``separator``
        between them (parallel tool calls). The schema's grammar (xgrammar's EBNF of it) is renamed and repeated.
        Tokens of newlines only are allowed too, for a separator that holds them (xgrammar's JSON strings refuse a
        raw newline themselves)."""
        found = unsupported_schema_feature(schema)
        if found is not None:
            raise SpecdraftError(f"unsupported JSON schema feature: {found}")

        def compile_():
            self._compile(schema, strict=True)  # a schema xgrammar refuses: the same error as json_schema's
            one = str(_xgrammar().Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                                           strict_mode=True))
            renamed = _EBNF_NAMES.sub(lambda m: _VALUE_RULE if m.group(1) else m.group(0), one)
            return self._compiler.compile_grammar(
                f"{renamed}\nroot ::= {_VALUE_RULE} ({json.dumps(separator)} {_VALUE_RULE})*\n")

        return self._processor("json_schema_list:" + json.dumps([schema, separator], sort_keys=True), compile_,
                               self.spellable | self.newlines if "\n" in separator else None)

    def _compile(self, schema: dict, strict: bool):
        try:
            return self._compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=strict)
        except RuntimeError as exc:
            message = str(exc).strip().splitlines()[0]
            raise SpecdraftError(f"invalid JSON schema: {message.split(': ', 1)[-1][-300:]}") from None

    def _processor(self, key: str, compile_, spellable: torch.Tensor | None = None) -> GrammarProcessor:
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = compile_()
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return GrammarProcessor(compiled, self.vocab_size, self.spellable if spellable is None else spellable,
                                self.encode, self.char_tokens)


Encoder = Callable[[str], list[int]]  # a text -> the tokenizer's ids for it


def longest_match(tokens: list[str]) -> Encoder:
    """An encoder for a vocabulary given as each token's text: the longest token that starts the rest of the text,
    again and again (up to where no token does)."""
    ids = {text: token for token, text in enumerate(tokens) if text}
    longest = max(map(len, ids), default=0)

    def encode(text: str) -> list[int]:
        out, at = [], 0
        while at < len(text):
            size = next((n for n in range(min(longest, len(text) - at), 0, -1) if text[at:at + n] in ids), 0)
            if not size:
                break
            out.append(ids[text[at:at + size]])
            at += size
        return out

    return encode


def char_tokens(decoded_vocab, spellable: torch.Tensor) -> dict[str, int]:
    """Each character's own token: the first spellable token whose text is that one character alone."""
    tokens: dict[str, int] = {}
    for token, text in enumerate(decoded_vocab):
        if len(text) == 1 and bool(spellable[token]):
            tokens.setdefault(bytes(text).decode("latin-1"), token)
    return tokens


def certain_tokens(encode: Encoder, text: str) -> list[int]:
    """``text``'s tokens up to the first one that a character following ``text`` could change (module docstring)."""
    ids = encode(text)
    keep = len(ids)
    for probe in PROBES:
        longer = encode(text + probe)
        same = 0
        while same < min(keep, len(longer)) and longer[same] == ids[same]:
            same += 1
        keep = same
    return ids[:keep]


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """A (V,) bool mask as xgrammar's bitmask row (ceil(V / 32),) int32: bit j % 32 of word j // 32 is token j."""
    words = -(-allowed.shape[0] // 32)
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[: allowed.shape[0]] = allowed.long()
    packed = (bits.view(words, 32) << torch.arange(32)).sum(-1)  # (W,) in 0 .. 2**32 - 1
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _paths(parents: torch.Tensor | None, n: int) -> list[list[int]]:
    """Each node's path from the root (node ids, itself last); a chain when ``parents`` is None."""
    if parents is None:
        return [list(range(i + 1)) for i in range(n)]
    paths: list[list[int]] = []
    for node, parent in enumerate(parents.tolist()):
        paths.append((paths[parent] if parent >= 0 else []) + [node])
    return paths


class GrammarProcessor:
    """A grammar's mask as a :class:`~specdraft.sampling.LogitsProcessor` for one sequence (module docstring);
    :meth:`fork` gives each further sequence its own matcher."""

    def __init__(self, compiled, vocab_size: int, spellable: torch.Tensor | None = None,
                 encode: Encoder | None = None, chars: dict[str, int] | None = None, budget: int | None = None
                 ) -> None:
        self.xgr = _xgrammar()
        self.encode = encode  # the tokenizer, for the forced tokens (None: none are forced)
        self.chars = chars or {}  # each character's own token, for close plans (empty: no plans)
        self.budget = budget  # the most tokens the sequence generates, its stop token included (None: no close)
        self._plans: OrderedDict[tuple[int, ...], list[int] | None] = OrderedDict()
        self._refused_first: set[tuple[int, ...]] = set()  # rows whose first-ranked token the close refused
        self.compiled, self.vocab_size = compiled, vocab_size
        self.spellable = torch.ones(vocab_size, dtype=torch.bool) if spellable is None else spellable  # (V,)
        self._spellable_bits = _pack(self.spellable)  # (ceil(V / 32),) int32
        self.matcher = self.xgr.GrammarMatcher(compiled)
        self.stop_token_ids = frozenset(compiled.tokenizer_info.stop_token_ids)
        self.consumed: list[int] = []  # the generated tokens the matcher has accepted
        self.broken = False  # a committed token the grammar refused (never, when every row was masked)

    def fork(self, budget: int | None = None) -> GrammarProcessor:
        """A processor of its own for one more sequence, which generates at most ``budget`` tokens (its stop token
        included; None: the answer is not closed within a budget)."""
        return GrammarProcessor(self.compiled, self.vocab_size, self.spellable, self.encode, self.chars, budget)

    def _sync(self, generated: torch.Tensor) -> None:
        """Advance the matcher to the end of ``generated`` (a prefix of it is what it has accepted already)."""
        tokens = generated.tolist()
        if tokens[: len(self.consumed)] != self.consumed:  # another sequence's tokens: start again
            self.matcher.reset()
            self.consumed, self.broken = [], False
        for token in tokens[len(self.consumed):]:
            if self.broken or self.matcher.is_terminated() or not self.matcher.accept_token(token):
                self.broken = True
            self.consumed.append(token)

    def _walk(self, generated: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor | None, visit) -> list[bool]:
        """For each node, whether the grammar accepts its path; ``visit(row, path)`` runs with the matcher advanced
        to the row (0: the root, i + 1: node i; ``path``: the node ids from the root to it) when that row can be
        masked (path accepted, matcher not terminated)."""
        self._sync(generated)
        if self.broken:
            return [True] * tokens.shape[0]
        ids = tokens.tolist()
        if not self.matcher.is_terminated():
            visit(0, [])
        allowed = []
        for node, path in enumerate(_paths(parents, len(ids))):
            taken = 0
            for step in path:
                if self.matcher.is_terminated() or not self.spellable[ids[step]] or \
                        not self.matcher.accept_token(ids[step]):
                    break
                taken += 1
            allowed.append(taken == len(path))
            if allowed[-1] and not self.matcher.is_terminated():
                visit(node + 1, path)
            if taken:
                self.matcher.rollback(taken)
        return allowed

    def __call__(self, logits: torch.Tensor, generated: torch.Tensor, tokens: torch.Tensor,
                 parents: torch.Tensor | None) -> torch.Tensor:
        """Masked logits (n + 1, V): -inf where the grammar forbids a token at that row."""
        out = logits.float().clone()  # (n + 1, V)
        bitmask = self.xgr.allocate_token_bitmask(out.shape[0], self.vocab_size)  # (n + 1, ceil(V / 32)) int32
        rows: list[int] = []

        ids = tokens.tolist()

        def visit(row: int, path: list[int]) -> None:
            self.matcher.fill_next_token_bitmask(bitmask, row)
            bitmask[row] &= self._spellable_bits
            if not bool(bitmask[row].any()):
                raise SpecdraftError("the grammar allows no token of this vocabulary here: the tokenizer cannot "
                                     "spell what the response format needs")
            keep = self._closing(generated, [ids[node] for node in path], out[row], bitmask[row])
            if keep is not None:  # near the budget's end: the tokens after which the document can still close
                bitmask[row] = _pack(torch.zeros(self.vocab_size, dtype=torch.bool).index_fill_(
                    0, torch.tensor(keep), True))
            rows.append(row)

        self._walk(generated, tokens, parents, visit)
        if rows:
            self.xgr.apply_token_bitmask_inplace(out, bitmask, vocab_size=self.vocab_size, indices=rows)
        return out

    def allowed_nodes(self, generated: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor | None
                      ) -> torch.Tensor:
        """(n,) bool: whether the grammar accepts each draft node's path after ``generated``."""
        return torch.tensor(self._walk(generated, tokens, parents, lambda row, path: None), dtype=torch.bool)

    def _closing(self, generated: torch.Tensor, path: list[int], logits: torch.Tensor, bits: torch.Tensor
                 ) -> list[int] | None:
        """The tokens the row after ``generated`` and ``path`` keeps (the matcher is there; ``logits`` (V,) and
        ``bits`` its row and mask so far) when the close plan fills all but :data:`CLOSE_SLACK` of the budget left:
        the plan's first token and the row's :data:`CLOSE_CANDIDATES` likeliest allowed tokens, each if a plan
        still fits after it (module docstring). None elsewhere: the row keeps its mask."""
        if self.budget is None or not self.chars:
            return None
        left = self.budget - generated.shape[0] - len(path)  # tokens this row and the ones after it may take
        if left > CLOSE_HORIZON or left < 1:
            return None
        key = tuple(generated.tolist()) + tuple(path)
        if self._plans and len(next(iter(self._plans))) < generated.shape[0]:  # states behind the sequence: gone
            self._plans = OrderedDict((k, v) for k, v in self._plans.items() if len(k) >= generated.shape[0])
        plan = self._plan(key, self.matcher, left)
        if plan is None or len(plan) + CLOSE_SLACK < left:
            return None
        masked = logits.float().clone().view(1, -1)  # (1, V)
        self.xgr.apply_token_bitmask_inplace(masked, bits.view(1, -1), vocab_size=self.vocab_size)
        likeliest = masked[0].topk(CLOSE_CANDIDATES)
        keep: list[int] = []
        for token in [plan[0]] + likeliest.indices[likeliest.values > -torch.inf].tolist():
            if token in keep:
                continue
            after = self.matcher.fork()
            if after.accept_token(token) and (after.is_terminated() or
                                              self._plan(key + (token,), after, left - 1) is not None):
                keep.append(token)
        keep = keep or plan[:1]  # none fits after its first token (a tokenization that does not split): try it
        if int(likeliest.indices[0]) not in keep:
            self._refused_first.add(key)
        return keep

    def closed_at_budget(self, generated: torch.Tensor) -> bool:
        """Whether the close changed ``generated`` (G,): at one of its positions the row's first-ranked token (the
        greedy choice) was refused because no plan fitted after it."""
        if not self._refused_first:
            return False
        tokens = tuple(generated.tolist())
        first = 0 if self.budget is None else max(0, self.budget - CLOSE_HORIZON)
        return any(tokens[:end] in self._refused_first for end in range(first, len(tokens)))

    def _plan(self, key: tuple[int, ...], matcher, limit: int) -> list[int] | None:
        """:meth:`close_plan` from ``matcher`` (at the state of tokens ``key``), remembered by ``key``."""
        if key not in self._plans:
            self._plans[key] = self.close_plan(limit, matcher)
            while len(self._plans) > 16 * CLOSE_HORIZON:
                self._plans.popitem(last=False)
        return self._plans[key]

    def close_plan(self, limit: int, matcher=None) -> list[int] | None:
        """Tokens that finish the document from ``matcher``'s state (default: this sequence's), a stop token last,
        or None when they would be more than ``limit`` or a character has no token of its own. The text is chosen a
        character at a time from the state alone: the jump-forward string where there is one, else the first of
        :data:`CLOSERS` the grammar allows; then it is encoded by the tokenizer. The matcher is left as it was."""
        start = self.matcher if matcher is None else matcher
        matcher, text = start.fork(), []
        while len(text) < 4 * limit + 16:
            if matcher.is_completed():
                stop = next((t for t in sorted(self.stop_token_ids) if matcher.accept_token(t)), None)
                tokens = self.encode("".join(text)) if self.encode is not None and text else []
                check = start.fork()
                if not all(bool(self.spellable[t]) and check.accept_token(t) for t in tokens):
                    tokens = [self.chars[c] for c in text]  # an encoding the grammar reads otherwise: a character each
                return None if stop is None or len(tokens) >= limit else tokens + [stop]
            forced = matcher.find_jump_forward_string()
            if forced:
                for char in forced:
                    if char not in self.chars or not matcher.accept_token(self.chars[char]):
                        return None
                    text.append(char)
                continue
            char = next((c for c in CLOSERS if c in self.chars and matcher.accept_token(self.chars[c])), None)
            if char is None:
                return None
            text.append(char)
        return None

    def forced_tokens(self, generated: torch.Tensor, drafted: torch.Tensor, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces after ``generated`` (G,) and then ``drafted`` (d,) (module
        docstring), ending with the stop token when the grammar is complete there and allows nothing else
        (:meth:`certain_stop`); none when it forces nothing there, or refuses ``drafted``. The matcher is left as
        it was."""
        self._sync(generated)
        if self.broken or self.encode is None or limit <= 0:
            return []
        taken = 0
        for token in drafted.tolist():
            if self.matcher.is_terminated() or not self.spellable[token] or not self.matcher.accept_token(token):
                break
            taken += 1
        forced: list[int] = []
        if taken == drafted.shape[0] and not self.matcher.is_terminated():
            text = self.matcher.find_jump_forward_string()
            if text:
                accept_all = self.matcher.fork()  # whether nothing can follow the whole string (then all is certain)
                whole = self.encode(text)
                ids = whole if accept_all.accept_string(text) and accept_all.is_completed() else \
                    certain_tokens(self.encode, text)
                for token in ids[:limit]:
                    if not self.spellable[token] or not self.matcher.accept_token(token):
                        break
                    forced.append(token)
            stop = self._only_stop() if len(forced) < limit else None
            if stop is not None:
                forced.append(stop)
                self.matcher.accept_token(stop)
        if taken + len(forced):
            self.matcher.rollback(taken + len(forced))
        return forced

    def certain_stop(self, generated: torch.Tensor) -> int | None:
        """The stop token, when the grammar is complete after ``generated`` (G,) and allows no other token there:
        the masked p is then a point mass on it, whatever the target's logits, so it can be committed without a
        target forward. None elsewhere."""
        self._sync(generated)
        return None if self.broken else self._only_stop()

    def _only_stop(self) -> int | None:
        """The one token the matcher allows now, when the grammar is complete and that token is a stop token."""
        if self.matcher.is_terminated() or not self.matcher.is_completed():
            return None
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab_size)  # (1, ceil(V / 32)) int32
        self.matcher.fill_next_token_bitmask(bitmask, 0)
        allowed = bitmask[0] & self._spellable_bits  # (ceil(V / 32),) int32
        words = allowed.nonzero().flatten()  # the words that hold an allowed token
        if words.numel() != 1:
            return None
        word = int(allowed[words[0]]) & 0xFFFFFFFF
        if word & (word - 1):  # more than one bit: more than one token
            return None
        token = int(words[0]) * 32 + word.bit_length() - 1
        return token if token in self.stop_token_ids else None


def grammar_cut(allowed: torch.Tensor, parents: torch.Tensor | None, exact_drop: bool) -> torch.Tensor:
    """Which draft nodes to verify (n,) bool, given the nodes whose path the grammar ``allowed``: the allowed ones,
    and, unless ``exact_drop`` (greedy decoding, or a deterministic draft), the refused ones whose parent is allowed
    (their rejection draws from the residual; module docstring)."""
    if exact_drop:
        return allowed.clone()
    n = allowed.shape[0]
    parent_ok = torch.ones(n, dtype=torch.bool)
    if n:
        parent_list = parents.tolist() if parents is not None else list(range(-1, n - 1))
        parent_ok = torch.tensor([p < 0 or bool(allowed[p]) for p in parent_list], dtype=torch.bool)
    return parent_ok
