"""Online distillation reads the loss registry: ``serve --online-loss`` offers the losses that train against p, with
their settings (``--online-loss-option``); DistiLLM's skew KL trains a round that the target agrees with more."""

import pytest
from test_online import _distiller, _fill, _served_records, models, tiny_draft  # noqa: F401 (fixtures)

from specdraft.cli import _online_config, build_parser
from specdraft.errors import SpecdraftError
from specdraft.serve import OnlineDistillConfig
from specdraft.serve.online_config import ONLINE_LOSSES
from specdraft.training.objectives.losses import loss_names


def _args(*extra):
    return build_parser().parse_args(["serve", "--target", "t", "--draft", "d", "--online-distill", "o", *extra])


def test_the_serve_flags_read_the_registry():
    assert ONLINE_LOSSES == loss_names(online=True) and "skl" in ONLINE_LOSSES and "ce" not in ONLINE_LOSSES
    config = _online_config(_args("--online-loss", "skl", "--online-loss-option", "alpha=0.2"))
    assert config.loss == "skl" and config.loss_settings() == {"alpha": 0.2}
    assert _online_config(_args("--online-loss", "tvdpp")).loss_settings() == {"weighting": "q",
                                                                                "normalization": "batch"}
    with pytest.raises(SystemExit):
        _args("--online-loss", "rkl")  # not a loss online distillation trains with
    with pytest.raises(SpecdraftError, match="online loss skl has no option 'beta'; its options are alpha"):
        _online_config(_args("--online-loss", "skl", "--online-loss-option", "beta=0.2"))
    with pytest.raises(SpecdraftError, match=r"alpha must be a number in \[0, 1\)"):
        OnlineDistillConfig(folder="o", loss="srkl", loss_options=(("alpha", "1"),))


def test_a_round_with_the_skew_kl_is_accepted(models, tiny_draft, tmp_path):  # noqa: F811 (fixtures)
    target, _, drafter = models
    distiller = _distiller(tmp_path, drafter, str(tiny_draft), steps=40, lr=3e-2, batch_size=4, loss="skl",
                           loss_options=(("alpha", "0.2"),))
    _fill(distiller, _served_records(target, drafter))
    entry = distiller.train_round()
    assert entry["accepted"] and entry["candidate_agreement"] > entry["current_agreement"]
