"""Batches of prompt + response sequences: truncation that keeps the response, right padding with a response mask,
p rebuilt from the stored top-k, and the drafter's logits at the response positions."""

import torch

from specdraft.training.data.batches import (
    DistillDataset,
    collate_distill,
    dense_from_topk,
    response_logits,
    subset_from_topk,
    subset_labels,
)
from toys import distill_records, tiny_llama


def test_dense_from_topk_keeps_stored_log_probs_and_spreads_the_rest():
    log_p = torch.log_softmax(torch.randn(3, 10), -1)
    top = log_p.topk(4, dim=-1)
    dense = dense_from_topk(top.indices, top.values, 10)  # (3, 10)
    torch.testing.assert_close(dense.gather(-1, top.indices), top.values)
    torch.testing.assert_close(dense.exp().sum(-1), torch.ones(3))
    full = log_p.topk(10, dim=-1)
    torch.testing.assert_close(dense_from_topk(full.indices, full.values, 10), log_p)


def test_subset_from_topk_is_the_dense_table_restricted_to_the_draft_vocabulary():
    log_p = torch.log_softmax(torch.randn(5, 12), -1)
    top = log_p.topk(4, dim=-1)
    keep = torch.tensor([7, 0, 3, 11, 5])  # some stored ids are kept, some not
    torch.testing.assert_close(subset_from_topk(top.indices, top.values, keep, 12),
                               dense_from_topk(top.indices, top.values, 12)[:, keep])
    columns, inside = subset_labels(torch.tensor([3, 4, 7, 11]), keep, 12)
    assert columns.tolist() == [2, 0, 0, 3] and inside.tolist() == [True, False, True, True]


def test_response_logits_are_the_full_forward_at_response_positions():
    model = tiny_llama(seed=1)
    records = distill_records(4)
    batch = collate_distill([DistillDataset(records, 64)[i] for i in range(4)], 0)
    assert not batch["attention_mask"].all()  # padded: the mask must leave the padding out
    full = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # (B, T, V)
    torch.testing.assert_close(response_logits(model, batch), full[batch["mask"]], rtol=1e-5, atol=1e-5)


def test_a_long_prompt_loses_its_start_not_its_response():
    record = {"prompt_token_ids": list(range(100, 130)), "response_token_ids": [1, 2, 3, 4, 5],
              "top_ids": [[t] for t in (1, 2, 3, 4, 5)], "top_logprobs": [[0.0]] * 5}
    item = DistillDataset([record], max_seq_len=11, topk=True)[0]  # 12 tokens kept of 35
    assert item["ids"].tolist() == list(range(123, 130)) + [1, 2, 3, 4, 5] and item["prompt_len"] == 7
    batch = collate_distill([item], pad_id=0)
    assert batch["labels"][batch["mask"]].tolist() == [1, 2, 3, 4, 5]
    assert batch["top_ids"][batch["mask"]][:, 0].tolist() == [1, 2, 3, 4, 5]
    short = DistillDataset([record], max_seq_len=39)[0]  # fits: unchanged
    assert short["ids"].tolist() == record["prompt_token_ids"] + record["response_token_ids"]
    assert DistillDataset([record], max_seq_len=11).lengths == [12] and DistillDataset([record], 39).lengths == [35]
    half = DistillDataset([record | {"response_token_ids": list(range(1, 30))}], max_seq_len=19)[0]
    assert half["prompt_len"] == 10 and half["ids"].tolist() == list(range(120, 130)) + list(range(1, 11))
