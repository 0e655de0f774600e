"""Target/draft compatibility, checked before decoding: speculative decoding compares token ids, so both sides must
share the vocabulary (size, every token string and id) and the special tokens."""

from __future__ import annotations

import hashlib
import json

from specdraft.errors import SpecdraftError

SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 (first 16 hex digits) of the token->id table and the special-token ids."""
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": {name: getattr(tokenizer, name, None) for name in SPECIAL_TOKENS},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def check_compatible(target, target_tokenizer, draft, draft_tokenizer) -> None:
    """Raise :class:`SpecdraftError` naming both sides when the draft cannot speculate for the target.

    Args:
        target, draft: :class:`~specdraft.models.base.CausalLM` models (their ``vocab_size`` is the logit width).
        target_tokenizer, draft_tokenizer: their tokenizers; the draft's may be None (no tokenizer files), then only
            the vocabulary size is checked.
    """
    if target.vocab_size != draft.vocab_size:
        raise SpecdraftError(
            f"vocabulary mismatch: target {target.name!r} has {target.vocab_size} tokens, "
            f"draft {draft.name!r} has {draft.vocab_size}"
        )
    if draft_tokenizer is None:
        return
    for name in SPECIAL_TOKENS:
        mine, theirs = getattr(target_tokenizer, name, None), getattr(draft_tokenizer, name, None)
        if mine != theirs:
            raise SpecdraftError(f"special token mismatch: {name} is {mine} in target {target.name!r}, "
                                 f"{theirs} in draft {draft.name!r}")
    target_hash, draft_hash = tokenizer_fingerprint(target_tokenizer), tokenizer_fingerprint(draft_tokenizer)
    if target_hash != draft_hash:
        raise SpecdraftError(
            f"tokenizer mismatch: target {target.name!r} tokenizer {target_hash}, draft {draft.name!r} {draft_hash}"
        )
