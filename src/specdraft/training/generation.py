"""Distillation data (Goel et al. 2024, arXiv 2403.00858, the stage "distillation dataset generation"): the
target's own responses to real instructions.

Prompts (ShareGPT first turns, every ShareGPT turn in context, prompt jsonl files: see
:mod:`specdraft.training.prompt_sources`) are cut into fixed shards; each shard is generated in batches
with left padding by transformers' ``generate`` and written atomically (temp file, then rename). A shard file that
exists is complete, so a run killed at any moment (even ``kill -9``) and started again regenerates only missing
shards: every prompt is answered exactly once. ``manifest.json`` lists the shards and says whether the set is
complete; it is rewritten after every shard, so the shards of a run stopped part-way can be used at once
(``--allow-incomplete``). Under ``torchrun`` rank r takes the shards with index ≡ r (mod world size).

Output records (one JSON line per response): ``prompt_id``, ``messages``, ``prompt_token_ids``,
``response_token_ids``, ``response_text``, ``response_index``, ``finish_reason``, ``sampling``, ``target``,
``policy`` (who answered: "target", or "draft" with ``drafter``, on-policy data: :mod:`specdraft.training.onpolicy`),
and with ``top_logprobs > 0`` the target's top-k log-probabilities per response token (``top_ids``,
``top_logprobs``: an approximation of p for training, labelled as such).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdraft.errors import SpecdraftError
from specdraft.files import write_text_atomic as _atomic_write
from specdraft.sampling import SamplingConfig
from specdraft.training import onpolicy
from specdraft.training.data import MANIFEST_FILE

CONFIG_FILE = "distill_config.json"


@dataclass(frozen=True)
class DistillDataConfig:
    """Settings of ``specdraft distill-data``; the ones that shape the data must match on resume."""

    target: str = field(metadata={"help": "target model (built-in name, folder or cached hub id)"})
    out: str = field(metadata={"help": "output folder (shards, manifest)"})
    prompts: str = field(default="sharegpt", metadata={
        "help": "sharegpt (first turns), sharegpt-turns (every turn in context) or a prompt jsonl; comma-separated "
                "sources are pooled"})
    split: str = field(default="train", metadata={"help": "ShareGPT split: train or heldout"})
    limit: int | None = field(default=None, metadata={"help": "use the first N prompts"})
    responses_per_prompt: int = field(default=1, metadata={"help": "responses sampled per prompt"})
    max_new_tokens: int = field(default=128, metadata={"help": "response length cap"})
    temperature: float = field(default=1.0, metadata={"help": "0 = greedy"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass"})
    top_k: int = field(default=0, metadata={"help": "0 = off"})
    top_logprobs: int = field(default=0, metadata={"help": "store the target's top-k log-probs per token"})
    batch_size: int = field(default=16, metadata={"help": "prompts per generate call"})
    shard_size: int = field(default=64, metadata={"help": "prompts per shard file"})
    dtype: str = field(default="bfloat16", metadata={"help": "float32 or bfloat16"})
    seed: int = field(default=0, metadata={"help": "base seed; each shard derives its own"})
    policy: str = field(default="target", metadata={"help": "who answers: target, draft (on-policy) or mixed (GKD)"})
    mix_fraction: float = field(default=0.5, metadata={"help": "mixed: share of prompts the drafter answers (λ)"})
    draft: str | None = field(default=None, metadata={"help": "drafter that answers under --policy draft or mixed"})
    greedy_response: bool = field(default=False, metadata={"help": "add a greedy response beside the sampled ones"})

    def __post_init__(self) -> None:
        SamplingConfig(self.temperature, self.top_k, self.top_p)  # validates the sampling values
        for name in ("responses_per_prompt", "max_new_tokens", "batch_size", "shard_size"):
            if getattr(self, name) < 1:
                raise SpecdraftError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.top_logprobs < 0:
            raise SpecdraftError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        if self.limit is not None and self.limit < 1:
            raise SpecdraftError(f"limit must be >= 1, got {self.limit}")
        onpolicy.check_policy(self)

    def data_fields(self) -> dict:
        """What determines the data (resuming with other values would mix two datasets)."""
        skip = {"out", "batch_size", "policy", "mix_fraction", "draft", "greedy_response"}
        return {k: v for k, v in asdict(self).items() if k not in skip} | onpolicy.policy_fields(self)


def load_prompts(config: DistillDataConfig) -> list[tuple[str, list[dict]]]:
    """(prompt id, chat messages) pairs in a fixed order (:mod:`specdraft.training.prompt_sources`)."""
    from specdraft.training.prompt_sources import load_prompt_sources

    return load_prompt_sources(config.prompts, config.split, config.limit)


def _check_or_write_config(config: DistillDataConfig, out: Path, overwrite: bool) -> None:
    path = out / CONFIG_FILE
    if path.is_file() and not overwrite:
        saved = json.loads(path.read_text())
        if saved != config.data_fields():
            changed = sorted(k for k in saved.keys() | config.data_fields().keys()
                             if saved.get(k) != config.data_fields().get(k))
            raise SpecdraftError(f"{out} holds data made with other settings ({', '.join(changed)}); "
                                 "use a new --out or --overwrite")
        return
    if overwrite:
        for old in out.glob("shard-*.jsonl"):
            old.unlink()
    _atomic_write(path, json.dumps(config.data_fields(), indent=1))


def shard_path(out: Path, index: int) -> Path:
    return out / f"shard-{index:05d}.jsonl"


def generate_distillation_data(config: DistillDataConfig, overwrite: bool = False, progress: bool = True,
                               prompts: list | None = None, models: tuple | None = None) -> dict:
    """Generate (or finish) the distillation set; returns the manifest. Rank/world from torchrun's environment.

    ``prompts`` ((id, messages) pairs) and ``models`` ((target, tokenizer, drafter or None), transformers models
    already loaded) replace ``config.prompts`` and loading by name (``finetune --regenerate-every``)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(config) if prompts is None else prompts
    if rank == 0:
        _check_or_write_config(config, out, overwrite)
        for stale in out.glob(".*.tmp"):  # left by a killed run: never part of the data
            stale.unlink()
    _barrier(world)
    shards = [prompts[i : i + config.shard_size] for i in range(0, len(prompts), config.shard_size)]
    todo = [i for i in range(len(shards)) if i % world == rank and not shard_path(out, i).is_file()]
    if todo:  # rank 0 rewrites the manifest after each of its shards: a run stopped part-way can still be used
        update = (lambda: write_manifest(out, len(shards), config)) if rank == 0 else None
        _generate_shards(config, out, shards, todo, progress and rank == 0, update, models)
    _barrier(world)
    return write_manifest(out, len(shards), config) if rank == 0 else {}


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        dist.barrier()


def _generate_shards(config: DistillDataConfig, out: Path, shards: list, todo: list[int], progress: bool,
                     after_shard: Callable[[], object] | None = None, models: tuple | None = None) -> None:
    from tqdm import tqdm

    from specdraft.models.registry import load_model, load_tokenizer, parse_dtype

    if models is None:
        target = load_model(config.target, parse_dtype(config.dtype), backend="hf")
        tokenizer = load_tokenizer(config.target)
        models = target.model, tokenizer, onpolicy.load_drafter(config, target, tokenizer)
    model, tokenizer, drafter = models
    bar = tqdm(total=sum(len(shards[i]) for i in todo), unit="prompt", disable=not progress, desc="distill-data")
    for index in todo:
        started = time.perf_counter()
        records = onpolicy.generate_shard(model, tokenizer, shards[index], config, config.seed * 100_003 + index,
                                          generate_shard, drafter)
        _atomic_write(shard_path(out, index), "".join(json.dumps(r) + "\n" for r in records))
        if after_shard is not None:
            after_shard()
        bar.update(len(shards[index]))
        bar.set_postfix(prompts_per_min=f"{60 * len(shards[index]) / (time.perf_counter() - started):.1f}")
    bar.close()


def write_manifest(out: Path, num_shards: int, config: DistillDataConfig) -> dict:
    """List the shards present with their record counts; ``complete`` when none is missing."""
    present = {}
    for index in range(num_shards):
        path = shard_path(out, index)
        if path.is_file():
            with open(path) as f:
                present[path.name] = sum(1 for _ in f)
    manifest = {"num_shards": num_shards, "complete": len(present) == num_shards, "shards": present,
                "records": sum(present.values()), "config": config.data_fields()}
    _atomic_write(out / MANIFEST_FILE, json.dumps(manifest, indent=1))
    return manifest


@torch.inference_mode()
def generate_shard(model, tokenizer, prompts: list[tuple[str, list[dict]]], config: DistillDataConfig,
                   seed: int) -> list[dict]:
    """Responses for one shard, batched with left padding; records in prompt order."""
    encoded = [_encode(tokenizer, messages) for _, messages in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))  # similar lengths share a batch
    records: dict[int, list[dict]] = {}
    for start in range(0, len(order), config.batch_size):
        batch = order[start : start + config.batch_size]
        torch.manual_seed(seed * 1_000 + start)  # transformers' sampling draws from the global generator
        responses = _generate_batch(model, tokenizer, [encoded[i] for i in batch], config)
        for slot, i in enumerate(batch):
            mine = responses[slot * config.responses_per_prompt : (slot + 1) * config.responses_per_prompt]
            records[i] = [_record(prompts[i], encoded[i], r, k, config, tokenizer) for k, r in enumerate(mine)]
    return [record for i in range(len(prompts)) for record in records[i]]


def _encode(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


def _generate_batch(model, tokenizer, batch: list[list[int]], config: DistillDataConfig) -> list[dict]:
    """One left-padded ``generate`` call -> per response: token ids (cut after EOS), finish reason, top log-probs."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(ids) for ids in batch)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch])  # (B, W)
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])  # (B, W)
    greedy = config.temperature == 0
    out = model.generate(
        input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
        max_new_tokens=config.max_new_tokens,
        do_sample=not greedy, temperature=None if greedy else config.temperature,
        top_p=None if greedy else config.top_p, top_k=None if greedy else (config.top_k or None),
        num_return_sequences=config.responses_per_prompt, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id,
        return_dict_in_generate=True, output_logits=config.top_logprobs > 0,
    )
    new = out.sequences[:, width:]  # (B * n, S)
    logits = torch.stack(out.logits, dim=1) if config.top_logprobs else None  # (B * n, S, V)
    return [_response(new[row], None if logits is None else logits[row], tokenizer.eos_token_id, config)
            for row in range(new.shape[0])]


def _response(tokens: torch.Tensor, logits: torch.Tensor | None, eos: int, config: DistillDataConfig) -> dict:
    ids = tokens.tolist()
    length = ids.index(eos) + 1 if eos in ids else len(ids)
    response = {"ids": ids[:length], "finish_reason": "eos" if eos in ids[:length] else "length"}
    if logits is not None:
        top = torch.log_softmax(logits[:length].float(), -1).topk(config.top_logprobs, dim=-1)  # (S, k)
        response["top_ids"], response["top_logprobs"] = top.indices.tolist(), top.values.tolist()
    return response


def _record(prompt, prompt_ids: list[int], response: dict, index: int, config: DistillDataConfig, tokenizer) -> dict:
    prompt_id, messages = prompt
    record = {
        "prompt_id": prompt_id, "messages": messages, "prompt_token_ids": prompt_ids,
        "response_token_ids": response["ids"], "response_index": index, "finish_reason": response["finish_reason"],
        "response_text": tokenizer.decode(response["ids"], skip_special_tokens=True),
        "sampling": {"temperature": config.temperature, "top_p": config.top_p, "top_k": config.top_k,
                     "max_new_tokens": config.max_new_tokens},
        "target": config.target,
    }
    if "top_ids" in response:
        record["top_ids"], record["top_logprobs"] = response["top_ids"], response["top_logprobs"]
    return record
