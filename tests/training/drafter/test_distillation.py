"""The distillation objective of ``specdraft finetune``: on a draft vocabulary, q and p over its tokens only."""

import pytest
import torch

from specdraft.training.data.batches import DistillDataset, collate_distill, response_logits, target_logits
from specdraft.training.drafter.distillation import make_kd_loss
from specdraft.training.drafter.finetune_config import FinetuneConfig
from toys import distill_records, tiny_llama


@pytest.mark.parametrize("loss", ["ce", "fkl", "tvdpp"])
def test_training_on_a_draft_vocabulary_touches_only_its_rows(loss):
    """With ``keep`` the loss sees q and p over the kept tokens only: LM-head rows outside it get no gradient, and
    the loss equals the one computed on the full logits restricted to those columns."""
    model = tiny_llama(seed=1)  # a separate head (untied), so that its rows' gradients are visible
    target_model = tiny_llama(seed=0)
    records = distill_records(4)
    batch = collate_distill([DistillDataset(records, 64)[i] for i in range(4)], 0)
    keep = torch.tensor(sorted(set(batch["labels"][batch["mask"]].tolist()))[:5] + [63])  # (N,) some labels left out
    config = FinetuneConfig(drafter="d", target="t", data="x", out="o", loss=loss, steps=1)
    value, count = make_kd_loss(config.objective(), target_model, keep)(model, batch, torch.Generator().manual_seed(0))
    value.backward()
    outside = torch.ones(64, dtype=torch.bool)
    outside[keep] = False
    assert count == int(batch["mask"].sum()) and value.item() > 0
    assert model.lm_head.weight.grad[outside].abs().max() == 0 and model.lm_head.weight.grad[keep].abs().max() > 0
    full = response_logits(model, batch)  # (n, V)
    torch.testing.assert_close(response_logits(model, batch, keep), full[:, keep])
    if loss == "fkl":
        p = target_logits(target_model, batch)[batch["mask"]][:, keep]
        expected = torch.nn.functional.kl_div(torch.log_softmax(full[:, keep], -1), torch.log_softmax(p, -1),
                                              log_target=True, reduction="batchmean")
        torch.testing.assert_close(value, expected)
