"""Distributed data parallel training on CPU: 2 processes (gloo) end with identical weights, equal to one process
training on the same global batches."""

import os
import socket

import torch
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from specdraft.corpus import PackedDataset
from specdraft.training.drafter.pretrain import lm_loss
from specdraft.training.runs.checkpoint import load_training_state
from specdraft.training.runs.trainer import TrainerConfig, train

STEPS = 4


def _model(seed):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def _dataset():
    return PackedDataset(torch.randint(0, 32, (20, 9), generator=torch.Generator().manual_seed(1)))


def _config(out, batch_size):
    return TrainerConfig(out=str(out), steps=STEPS, batch_size=batch_size, grad_accum=2, lr=1e-2, bf16=False,
                         progress=False, log_every=1, device="cpu")  # gloo on the CPU, whatever the machine has


def _worker(rank: int, world: int, port: int, folder: str) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    model = _model(seed=rank)  # different initialisations: DDP broadcasts rank 0's
    train(model, _dataset(), lm_loss, _config(os.path.join(folder, "run"), batch_size=2))
    torch.save(model.state_dict(), os.path.join(folder, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_cpu_processes_end_with_identical_weights(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    weights = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    single = _model(seed=0)
    train(single, _dataset(), lm_loss, _config(tmp_path / "single", batch_size=4))
    for name, tensor in weights[0].items():
        assert torch.equal(tensor, weights[1][name]), name
        torch.testing.assert_close(tensor, single.state_dict()[name], rtol=1e-4, atol=1e-5)
    assert not torch.equal(weights[0]["model.norm.weight"], _model(seed=0).state_dict()["model.norm.weight"])
    assert load_training_state(tmp_path / "run" / "checkpoint.pt")["step"] == STEPS
    lines = (tmp_path / "run" / "train_log.csv").read_text().splitlines()
    assert len(lines) == STEPS + 1  # one writer (rank 0): a header and one row per step
