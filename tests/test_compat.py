import pytest

from specdraft.compat import check_compatible, tokenizer_fingerprint
from specdraft.errors import SpecdraftError
from toys import WORDS, hf_target, tiny_tokenizer


def test_fingerprint_identifies_vocabulary_and_specials():
    assert tokenizer_fingerprint(tiny_tokenizer()) == tokenizer_fingerprint(tiny_tokenizer())
    assert tokenizer_fingerprint(tiny_tokenizer()) != tokenizer_fingerprint(tiny_tokenizer(WORDS[::-1]))
    assert tokenizer_fingerprint(tiny_tokenizer()) != tokenizer_fingerprint(tiny_tokenizer(eos="<unk>"))


def test_compatible_pair_passes_and_mismatches_name_both_sides():
    target, draft = hf_target(0), hf_target(1)
    check_compatible(target, tiny_tokenizer(), draft, tiny_tokenizer())
    check_compatible(target, tiny_tokenizer(), draft, None)  # bare checkpoint: size only
    with pytest.raises(SpecdraftError, match=r"vocabulary mismatch: target 'tiny0' has 64 .* draft 'tiny1' has 80"):
        check_compatible(target, tiny_tokenizer(), hf_target(1, vocab_size=80), None)
    with pytest.raises(SpecdraftError, match=r"tokenizer mismatch: target 'tiny0'.*draft 'tiny1'"):
        check_compatible(target, tiny_tokenizer(), draft, tiny_tokenizer(WORDS[::-1]))
    with pytest.raises(SpecdraftError, match="special token mismatch: eos_token_id"):
        check_compatible(target, tiny_tokenizer(), draft, tiny_tokenizer(eos="<unk>"))
