"""The generic training loop: schedule, data order, logs, checkpoints, and resume == uninterrupted."""

import csv
import itertools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdraft.corpus import PackedDataset
from specdraft.errors import SpecdraftError
from specdraft.training.objectives.losses import distillation_loss
from specdraft.training.runs import trainer
from specdraft.training.runs.checkpoint import load_training_state
from specdraft.training.runs.trainer import BatchStream, TrainerConfig, lr_factor, train


def _model(seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def _dataset(rows=24, seq_len=8):
    return PackedDataset(torch.randint(0, 32, (rows, seq_len + 1), generator=torch.Generator().manual_seed(1)))


def noisy_loss(model, batch, generator):
    """Cross-entropy on a random subset of positions: draws from the loss generator and the global RNG."""
    input_ids, labels = batch
    logits = model(input_ids=input_ids, use_cache=False).logits  # (B, T, V)
    mask = torch.rand(labels.shape, generator=generator) < 0.7
    mask |= torch.rand(labels.shape) < 0.2
    return distillation_loss("ce", logits, None, labels, mask), int(mask.sum())


def _config(out, **kwargs):
    defaults = dict(steps=8, batch_size=4, grad_accum=2, lr=1e-2, warmup_steps=2, bf16=False, log_every=1,
                    progress=False)
    return TrainerConfig(out=str(out), **(defaults | kwargs))


def test_lr_schedule_warms_up_linearly_then_decays_to_the_floor():
    factors = [lr_factor(step, 4, 20, 0.1) for step in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in itertools.pairwise(factors[3:]))
    assert lr_factor(20, 4, 20, 0.1) == pytest.approx(0.1)
    assert lr_factor(12, 4, 20, 0.1) == pytest.approx(0.55)  # half-way down the cosine


def test_batch_stream_visits_every_example_once_per_epoch_and_splits_ranks():
    streams = [BatchStream(10, 2, seed=3, rank=r, world=2) for r in range(2)]
    epoch = [i for _ in range(2) for s in streams for i in s.next_indices()]
    assert len(set(epoch)) == 8 and set(epoch) <= set(range(10))  # 2 global batches of 4; the tail is skipped
    assert streams[0].next_indices() != streams[1].next_indices()
    assert streams[0].epoch == 1
    resumed = BatchStream(10, 2, seed=3, rank=0, world=2)
    resumed.load_state_dict(streams[0].state_dict())
    assert resumed.next_indices() == streams[0].next_indices()
    with pytest.raises(SpecdraftError, match="fewer than one global batch"):
        BatchStream(3, 2, seed=0, world=2)


def _padded_tokens(stream: BatchStream, lengths: list[int], batches: int) -> int:
    return sum(stream.batch_size * max(lengths[i] for i in stream.next_indices()) for _ in range(batches))


def test_length_grouped_stream_keeps_the_epochs_examples_with_less_padding_and_resumes():
    lengths = torch.randint(10, 600, (1000,), generator=torch.Generator().manual_seed(0)).tolist()
    plain, grouped = BatchStream(1000, 16, seed=1), BatchStream(1000, 16, seed=1, lengths=lengths)
    plain_epoch = [i for _ in range(62) for i in plain.next_indices()]
    grouped_epoch = [i for _ in range(62) for i in grouped.next_indices()]
    assert sorted(grouped_epoch) == sorted(plain_epoch)  # the same 992 examples (the same tail of 8 skipped)
    assert len(set(grouped_epoch)) == 992
    padded_plain = _padded_tokens(BatchStream(1000, 16, seed=1), lengths, 62)
    padded_grouped = _padded_tokens(BatchStream(1000, 16, seed=1, lengths=lengths), lengths, 62)
    assert padded_grouped < 0.8 * padded_plain  # a random batch pads to its longest member
    assert grouped.next_indices() != grouped_epoch[:16]  # a new epoch, a new order
    resumed = BatchStream(1000, 16, seed=1, lengths=lengths)
    resumed.load_state_dict(grouped.state_dict())
    assert resumed.next_indices() == grouped.next_indices()
    ranks = [BatchStream(1000, 4, seed=1, rank=r, world=2, lengths=lengths) for r in range(2)]
    first = [r.next_indices() for r in ranks]
    assert not set(first[0]) & set(first[1])
    assert min(lengths[i] for i in first[0]) >= max(lengths[i] for i in first[1])  # rank 0: the longer half
    with pytest.raises(SpecdraftError, match="3 lengths for 1000 examples"):
        BatchStream(1000, 16, seed=1, lengths=[1, 2, 3])


def test_group_by_length_needs_a_dataset_with_lengths(tmp_path):
    with pytest.raises(SpecdraftError, match="has no per-example lengths"):
        train(_model(), _dataset(), noisy_loss, _config(tmp_path / "g", group_by_length=True))


def test_resume_reaches_exactly_the_uninterrupted_weights(tmp_path):
    straight = _model()
    torch.manual_seed(5)
    train(straight, _dataset(), noisy_loss, _config(tmp_path / "a"))
    split = _model()
    torch.manual_seed(5)
    first = train(split, _dataset(), noisy_loss, _config(tmp_path / "b", stop_after=4))
    assert first.steps == 4
    torch.manual_seed(123)  # a new process would start from another RNG state
    resumed = _model(seed=9)  # and another initialisation: the checkpoint must restore everything
    second = train(resumed, _dataset(), noisy_loss, _config(tmp_path / "b", resume=True))
    assert second.steps == 8
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert load_training_state(tmp_path / "b" / "checkpoint.pt")["step"] == 8
    with open(tmp_path / "b" / "train_log.csv") as file:
        assert [int(row["step"]) for row in csv.DictReader(file)] == list(range(1, 9))


def test_logs_evaluation_and_periodic_checkpoints(tmp_path, monkeypatch):
    calls, saved_steps = [], []
    original = trainer.save_training_state

    def spy(path, state):
        saved_steps.append(state["step"])
        return original(path, state)

    def evaluate(model):
        calls.append(model.training)
        return {"score": 1.5}

    monkeypatch.setattr(trainer, "save_training_state", spy)
    result = train(_model(), _dataset(), noisy_loss, _config(tmp_path, steps=6, eval_every=2, checkpoint_every=4),
                   evaluate=evaluate)
    assert calls == [False, False, False]  # steps 2, 4, 6, in eval mode
    assert saved_steps == [4, 6]
    assert result.eval == {"score": 1.5} and result.tokens > 0 and result.wall_seconds > 0
    with open(tmp_path / "eval_log.csv") as file:
        assert [row["step"] for row in csv.DictReader(file)] == ["2", "4", "6"]


def test_bf16_autocast_training_lowers_the_loss(tmp_path):
    data = PackedDataset(torch.arange(9).repeat(16, 1) % 32)  # one repeated sequence: easy to learn
    model = _model()
    losses = []

    def loss_fn(m, batch, generator):
        input_ids, labels = batch
        logits = m(input_ids=input_ids, use_cache=False).logits
        assert logits.dtype == torch.bfloat16
        loss = distillation_loss("ce", logits, None, labels)
        losses.append(float(loss.detach()))
        return loss, labels.numel()

    train(model, data, loss_fn, _config(tmp_path, steps=20, grad_accum=1, bf16=True))
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize(("kwargs", "field"), [({"steps": 0}, "steps"), ({"lr": -1.0}, "lr"),
                                               ({"grad_accum": 0}, "grad_accum"), ({"stop_after": 9}, "stop_after"),
                                               ({"min_lr_ratio": 2.0}, "min_lr_ratio"), ({"out": " "}, "out"),
                                               ({"threads": 0}, "threads"), ({"threads": True}, "threads")])
def test_bad_values_name_the_field(tmp_path, kwargs, field):
    with pytest.raises(SpecdraftError, match=field):
        TrainerConfig(**({"out": str(tmp_path), "steps": 8} | kwargs))


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(SpecdraftError, match="no training checkpoint"):
        train(_model(), _dataset(), noisy_loss, _config(tmp_path, resume=True))


def _stage_configs():
    from specdraft.training.drafter.finetune import FinetuneConfig
    from specdraft.training.drafter.pretrain import PretrainConfig
    from specdraft.training.heads.train_heads import HeadsConfig

    return {"pretrain": (PretrainConfig, {"target": "t"}),
            "finetune": (FinetuneConfig, {"drafter": "d", "target": "t", "data": "x"}),
            "train-heads": (HeadsConfig, {"kind": "eagle", "target": "t", "data": "x"})}


@pytest.mark.parametrize("stage", ["pretrain", "finetune", "train-heads"])
@pytest.mark.parametrize(("kwargs", "field"), [({"heldout_every": 1}, "heldout_every"),
                                               ({"export_dtype": "float8"}, "export_dtype"),
                                               ({"max_seq_len": 0, "seq_len": 0}, "seq_len"),
                                               ({"batch_size": True}, "batch_size")])
def test_every_stage_refuses_bad_shared_values_by_name(tmp_path, stage, kwargs, field):
    cls, required = _stage_configs()[stage]
    cls(out=str(tmp_path), **required)  # the required fields alone are valid
    names = set(cls.__dataclass_fields__)
    kwargs = {k: v for k, v in kwargs.items() if k in names}
    with pytest.raises(SpecdraftError, match=field):
        cls(out=str(tmp_path), **required, **kwargs)


@pytest.mark.parametrize(("kwargs", "field"), [({"eval_prompts": -1}, "eval_prompts"),
                                               ({"target_dtype": "int8"}, "target_dtype"),
                                               ({"eval_max_new_tokens": 0}, "eval_max_new_tokens")])
@pytest.mark.parametrize("stage", ["finetune", "train-heads"])
def test_distillation_stages_refuse_bad_evaluation_values_by_name(tmp_path, stage, kwargs, field):
    cls, required = _stage_configs()[stage]
    with pytest.raises(SpecdraftError, match=field):
        cls(out=str(tmp_path), **required, **kwargs)
