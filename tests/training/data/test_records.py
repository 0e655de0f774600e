"""distill-data records as the training stages read them: the folders of ``--data``, the held-out split by prompt
and the check of their token ids against the target's vocabulary."""

import pytest

from specdraft.errors import SpecdraftError
from specdraft.training.data.records import check_token_ids, data_folders, split_by_prompt
from toys import distill_records


def test_data_folders_are_comma_separated_each_named_once():
    assert data_folders(" a, b ,a,") == ["a", "b"]
    with pytest.raises(SpecdraftError, match="names no folder"):
        data_folders(" , ")


def test_the_split_holds_out_every_nth_prompt_with_all_its_responses():
    records = [{"prompt_id": f"p{i}", "prompt_token_ids": [3 + i], "response_token_ids": [5 + r]}
               for i in range(9) for r in range(2)]  # 9 prompts, 2 responses each
    train, heldout = split_by_prompt(records, 3)
    assert sorted({r["prompt_id"] for r in heldout}) == ["p2", "p5", "p8"] and len(heldout) == 6
    assert {r["prompt_id"] for r in train}.isdisjoint(r["prompt_id"] for r in heldout) and len(train) == 12
    plain = [{k: v for k, v in r.items() if k != "prompt_id"} for r in records]  # keyed by the prompt's token ids
    assert split_by_prompt(plain, 3)[1] == [r for r in plain if r["prompt_token_ids"][0] in (5, 8, 11)]
    with pytest.raises(SpecdraftError, match="only 9 distinct prompts"):
        split_by_prompt(records, 10)


def test_token_ids_outside_the_targets_vocabulary_are_refused():
    records = distill_records(4)
    check_token_ids(records, 64, "data")
    with pytest.raises(SpecdraftError, match="outside the target's vocabulary of 40"):
        check_token_ids(records, 40, "data")
