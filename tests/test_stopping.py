from specdraft.stopping import Stopper


class CharTokenizer:
    """id i decodes to chr(ord('a') + i)."""

    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def test_eos_keeps_eos_and_stops():
    stopper = Stopper(10, eos_token_ids=(2,))
    assert stopper.scan([5, 6], [7, 2, 8]) == (2, "eos")
    assert stopper.scan([5, 6], [2]) == (1, "eos")
    assert stopper.scan([5, 6], [7, 8]) == (2, None)


def test_max_new_tokens_cuts_block():
    stopper = Stopper(5, eos_token_ids=(2,))
    assert stopper.scan([1, 1, 1], [4, 4, 4]) == (2, "length")
    assert stopper.scan([1, 1, 1], [4]) == (1, None)
    assert stopper.scan([1, 1, 1, 1], [2, 4]) == (1, "eos")  # eos exactly at the budget: eos wins


def test_stop_string_across_tokens():
    stopper = Stopper(20, stop_strings=("cde",), tokenizer=CharTokenizer())
    assert stopper.scan([0, 1], [2, 3, 4, 5]) == (3, "stop")  # "ab" + "cde" completes at the third new token
    assert stopper.scan([], [2, 3, 5]) == (3, None)
