"""Distillation data (Goel et al. 2024, arXiv 2403.00858, the stage "distillation dataset generation"): the
target's own responses to real instructions.

Prompts (ShareGPT first turns, every ShareGPT turn in context, prompt jsonl files: see
:mod:`specdraft.training.data.prompt_sources`) are cut into fixed shards; each shard is generated in batches
with left padding by transformers' ``generate`` and written atomically (temp file, then rename). A shard file that
exists is complete, so a run killed at any moment (even ``kill -9``) and started again regenerates only missing
shards: every prompt is answered exactly once. ``manifest.json`` lists the shards with their record counts and
sha256 checksums and says whether the set is complete; it is rewritten after every shard, so the shards of a run
stopped part-way can be used at once (``--allow-incomplete``). Under ``torchrun`` rank r takes the shards with
index ≡ r (mod world size).

``distill_config.json`` records the settings and a digest of the prompts: a rerun continues exactly that run or is
refused naming what changed; a shard damaged from outside is set aside (``.damaged``) and made again; ``overwrite``
builds the new run beside the old one and swaps it in when complete (:mod:`specdraft.training.runs.folders`).

Output records (one JSON line per response): ``prompt_id``, ``messages``, ``prompt_token_ids``,
``response_token_ids``, ``response_text``, ``response_index``, ``finish_reason``, ``sampling``, ``target``,
``policy`` (who answered: "target", or "draft" with ``drafter``, on-policy data:
:mod:`specdraft.training.data.onpolicy`), and with ``top_logprobs > 0`` the target's top-k log-probabilities per
response token (``top_ids``, ``top_logprobs``: an approximation of p for training, labelled as such).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from specdraft.errors import SpecdraftError
from specdraft.hardware import check_device_name
from specdraft.prompts import encode_prompts
from specdraft.sampling import SamplingConfig
from specdraft.training.data import onpolicy
from specdraft.training.data.native_generation import StaticEngine, generate_rows
from specdraft.training.data.scoring import given_responses
from specdraft.training.runs import folders

CONFIG_FILE = "distill_config.json"
ENGINES = ("hf", "native", "vllm")


@dataclass(frozen=True)
class DistillDataConfig:
    """Settings of ``specdraft distill-data``; the ones that shape the data must match on resume."""

    target: str = field(metadata={"help": "target model (built-in name, folder or cached hub id)"})
    out: str = field(metadata={"help": "output folder (shards, manifest)"})
    prompts: str = field(default="sharegpt", metadata={
        "help": "sharegpt (first turns), sharegpt-turns (every turn in context), sharegpt-tasks (Spec-Bench-shaped "
                "chat, translation, summarization, qa, math_reasoning, rag prompts from ShareGPT, kinds in turn) or a "
                "prompt jsonl; comma-separated sources are pooled"})
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
    dtype: str = field(default="auto", metadata={"help": "auto (bfloat16 where the machine has native bf16, else "
                                                          "float32), float32 or bfloat16"})
    seed: int = field(default=0, metadata={"help": "base seed; each shard derives its own"})
    policy: str = field(default="target", metadata={"help": "who answers: target, draft (on-policy) or mixed (GKD)"})
    mix_fraction: float = field(default=0.5, metadata={"help": "mixed: share of prompts the drafter answers (λ)"})
    draft: str | None = field(default=None, metadata={"help": "drafter that answers under --policy draft or mixed"})
    greedy_response: bool = field(default=False, metadata={"help": "add a greedy response beside the sampled ones"})
    answers: str = field(default="", metadata={
        "help": "answers made elsewhere instead of generating: a jsonl (or .jsonl.gz) of {prompt | messages | turns, "
                "answer_ids}; the target adds its top-k by teacher forcing (--top-logprobs); replaces --prompts"})
    engine: str = field(default="hf", metadata={
        "help": "hf (transformers' generate, left-padded batches), native (specdraft's Llama: each prompt "
                "prefilled on its own row, rows decoded together; on CUDA a static cache and CUDA graphs; "
                "Llama-family targets, --policy target) or vllm (vLLM's offline engine in its own environment, built "
                "by `make engines`; --policy target)"})
    refill: bool = field(default=False, metadata={
        "help": "native engine on CUDA: a row whose answer ended takes the shard's next prompt at once (the shard in "
                "one static batch of --batch-size rows) instead of waiting for its batch's longest answer"})
    tensor_parallel: int = field(default=1, metadata={
        "help": "vllm: GPUs the target is sharded over (vLLM's tensor_parallel_size)"})
    device: str = field(default="auto", metadata={
        "help": "where the target runs: auto (CUDA when visible, else the CPU), cpu, cuda or cuda:N (under "
                "torchrun each process takes cuda:LOCAL_RANK); not part of the run's fingerprint"})

    def __post_init__(self) -> None:
        SamplingConfig(self.temperature, self.top_k, self.top_p)  # validates the sampling values
        for name in ("responses_per_prompt", "max_new_tokens", "batch_size", "shard_size"):
            if getattr(self, name) < 1:
                raise SpecdraftError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.top_logprobs < 0:
            raise SpecdraftError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        if self.limit is not None and self.limit < 1:
            raise SpecdraftError(f"limit must be >= 1, got {self.limit}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise SpecdraftError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        onpolicy.check_policy(self)
        if self.engine not in ENGINES:
            raise SpecdraftError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        try:
            check_device_name(self.device)
        except ValueError as exc:
            raise SpecdraftError(str(exc)) from None
        if self.answers and (self.prompts != "sharegpt" or self.policy != "target" or self.engine != "hf"
                             or self.responses_per_prompt != 1 or self.greedy_response):
            raise SpecdraftError("--answers gives the prompts and one answer each: drop --prompts, --policy, "
                                 "--engine, --responses-per-prompt and --greedy-response")
        if self.engine != "hf" and self.policy != "target":
            raise SpecdraftError(f"--engine {self.engine} generates the target's answers only: use --policy target, "
                                 "or --engine hf for on-policy data")
        if self.tensor_parallel < 1 or (self.tensor_parallel > 1 and self.engine != "vllm"):
            raise SpecdraftError(f"tensor_parallel must be >= 1, and above 1 only with --engine vllm; got "
                                 f"{self.tensor_parallel} with --engine {self.engine}")

    def data_fields(self) -> dict:
        """What determines the data (resuming with other values would mix two datasets)."""
        skip = {"out", "batch_size", "policy", "mix_fraction", "draft", "greedy_response", "engine", "tensor_parallel",
                "device", "answers", "refill"}
        engine = {"engine": self.engine} if self.engine != "hf" else {}  # runs made before the option stay valid
        engine |= {"answers": self.answers} if self.answers else {}
        return {k: v for k, v in asdict(self).items() if k not in skip} | onpolicy.policy_fields(self) | engine


def load_prompts(config: DistillDataConfig) -> list[tuple]:
    """(prompt id, chat messages) pairs in a fixed order (:mod:`specdraft.training.data.prompt_sources`); with
    ``answers``, (prompt id, chat messages, answer ids) triples of that file."""
    from specdraft.corpus import answers_from_jsonl
    from specdraft.training.data.prompt_sources import load_prompt_sources

    if not config.answers:
        return load_prompt_sources(config.prompts, config.split, config.limit)
    pairs = answers_from_jsonl(config.answers)[: config.limit]
    return [(f"{Path(config.answers).name}:{i}", messages, ids) for i, (messages, ids) in enumerate(pairs)]


def resolve_config(config: DistillDataConfig) -> tuple[DistillDataConfig, dict]:
    """``config`` with ``device`` and ``dtype`` auto resolved (:func:`specdraft.hardware.resolve_device`,
    :func:`~specdraft.hardware.resolve_dtype` on that device), and the decisions, as the run's config records them
    (``dtype_choice``, ``device_choice``)."""
    from specdraft.hardware import resolve_device, resolve_dtype

    try:
        device = resolve_device(config.device)
        choice = resolve_dtype(config.dtype, device.device)
    except ValueError as exc:
        raise SpecdraftError(str(exc)) from None
    resolved = replace(config, dtype=choice.dtype, device=device.name)
    return resolved, {"dtype_choice": choice.to_dict(), "device_choice": device.to_dict()}


def prompts_fingerprint(prompts: list[tuple]) -> str:
    """Content digest of the prompts in order (ids and messages, and answers made elsewhere): an edited prompts or
    answers file changes it."""
    return folders.digest_json([list(prompt) for prompt in prompts])


def _holds_data(folder: Path) -> bool:
    return (folder.is_dir() and any(folder.glob("shard-*.jsonl"))) or (folder / CONFIG_FILE).is_file()


def _prepare_folder(config: DistillDataConfig, out: Path, prompts: list, choices: dict, overwrite: bool) -> Path:
    """The folder to write: ``out`` (fresh, or the same run continued), or with ``overwrite`` and data in ``out`` a
    staging folder beside it that replaces ``out`` when complete. A run of other settings or prompts is refused."""
    folders.recover(out)
    work = folders.staging_path(out) if overwrite and _holds_data(out) else out
    if not overwrite and folders.staging_path(out).is_dir():
        folders.note(f"a replacement of {out} was interrupted ({folders.staging_path(out)}); rerun with --overwrite to "
                  "finish it")
    saved = _saved_config(work, older_ok=work != out)
    current = config.data_fields() | {"inputs": {"prompts": prompts_fingerprint(prompts)}}
    if saved is not None and work != out and (not saved or _config_changes(saved, current, config)):
        shutil.rmtree(work)  # a staging folder of another replacement: never the user's data
        saved = None
    if saved is not None:
        changed = _config_changes(saved, current, config)
        folders.refuse_changes(work, "distill-data run", changed, "use a new --out, or --overwrite to replace it")
    work.mkdir(parents=True, exist_ok=True)
    folders.atomic_write(work / CONFIG_FILE, json.dumps(current | choices, indent=1))
    return work


def distill_changes(config: DistillDataConfig) -> list[str] | None:
    """What differs between the run in ``config.out`` and this config and its prompts (None when it holds none; a
    run of an older layout differs in everything: this is asked before replacing a run)."""
    config, _ = resolve_config(config)
    out = Path(config.out)
    folders.recover(out)
    saved = _saved_config(out, older_ok=True)
    if saved is None:
        return None
    if not saved:
        return [f"{CONFIG_FILE} (an older layout)"]
    prompts = load_prompts(config)
    return _config_changes(saved, config.data_fields() | {"inputs": {"prompts": prompts_fingerprint(prompts)}},
                           config)


def _saved_config(folder: Path, older_ok: bool = False) -> dict | None:
    """The saved config of the run in ``folder`` (None when it holds none). One of an older layout (no prompts
    fingerprint) is refused, or with ``older_ok`` (it is about to be replaced) returned empty."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        if folder.is_dir() and any(folder.glob("shard-*.jsonl")):
            raise SpecdraftError(f"{folder} holds shards but no {CONFIG_FILE}: not a distill-data run; use a new --out")
        return None
    try:
        saved = json.loads(path.read_text())
        if not isinstance(saved, dict):
            raise ValueError
    except (OSError, ValueError):
        raise SpecdraftError(f"{path} is damaged; use a new --out, or --overwrite to replace the run") from None
    if "inputs" not in saved:
        if older_ok:
            return {}
        folders.older_layout(path, "has no fingerprint of the prompts",
                             "finetune and train-heads read the folder as it is; to add to it, make it again with "
                             "--overwrite")
    return saved


def _config_changes(saved: dict, current: dict, config: DistillDataConfig) -> list[str]:
    """What differs between a saved run's config and this one (a setting added since counts at its default)."""
    defaults = {f.name: f.default for f in fields(config) if f.default is not MISSING}
    skip = ("dtype_choice", "device_choice", "inputs")
    changed = folders.changes({k: v for k, v in saved.items() if k not in skip},
                              {k: v for k, v in current.items() if k not in skip}, defaults)
    if saved["inputs"].get("prompts") != current["inputs"]["prompts"]:
        changed.append(f"prompts ({config.prompts}: content or order differs)")
    return changed


def _check_present_shards(out: Path, shards: list, config: DistillDataConfig) -> dict[str, tuple[int, str]]:
    """(records, sha256) of every complete shard on disk; a shard with the wrong record count or checksum (cut
    short or edited outside specdraft) is moved aside to ``<name>.damaged`` and will be regenerated."""
    listed = {}
    with contextlib.suppress(OSError, ValueError, AttributeError):
        listed = json.loads((out / folders.MANIFEST_FILE).read_text()).get("sha256") or {}
    entries = {}
    for index, shard in enumerate(shards):
        path = shard_path(out, index)
        if not path.is_file():
            continue
        count, digest = folders.count_and_hash(path)
        expected = len(shard) * (config.responses_per_prompt + int(config.greedy_response))
        if count != expected or listed.get(path.name, digest) != digest:
            os.replace(path, path.with_name(path.name + ".damaged"))
            folders.note(f"{path} was damaged ({count} records of {expected}, or a changed checksum): kept as "
                      f"{path.name}.damaged and generated again")
            continue
        entries[path.name] = (count, digest)
    return entries


def shard_path(out: Path, index: int) -> Path:
    return out / f"shard-{index:05d}.jsonl"


@folders.owns_out
def generate_distillation_data(config: DistillDataConfig, overwrite: bool = False, progress: bool = True,
                               prompts: list | None = None, models: tuple | None = None) -> dict:
    """Generate (or finish) the distillation set; returns the manifest. Rank/world from torchrun's environment.

    A rerun continues exactly the run in ``config.out`` (same settings, same prompts) or is refused naming what
    changed; ``overwrite`` builds a new run beside the old one and swaps it in when complete. ``prompts`` ((id,
    messages) pairs) and ``models`` ((target, tokenizer, drafter or None), transformers models already loaded)
    replace ``config.prompts`` and loading by name (``finetune --regenerate-every``)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    config, choices = resolve_config(config)
    out = Path(config.out)
    prompts = load_prompts(config) if prompts is None else prompts  # validated before anything is written
    shards = [prompts[i : i + config.shard_size] for i in range(0, len(prompts), config.shard_size)]
    entries: dict[str, tuple[int, str]] = {}
    if rank == 0:
        work = _prepare_folder(config, out, prompts, choices, overwrite)
        folders.clear_leftovers(work)  # temp files of a killed run: never part of the data
        entries = _check_present_shards(work, shards, config)
    _barrier(world, config.device)
    if rank != 0:
        work = folders.staging_path(out) if overwrite and folders.staging_path(out).is_dir() else out
    todo = [i for i in range(len(shards)) if i % world == rank and not shard_path(work, i).is_file()]
    if todo:  # rank 0 rewrites the manifest after each of its shards: a run stopped part-way can still be used
        update = (lambda: write_manifest(work, len(shards), config, entries)) if rank == 0 else None
        _generate_shards(config, out=work, shards=shards, todo=todo, progress=progress and rank == 0,
                         after_shard=update, models=models, entries=entries)
    _barrier(world, config.device)
    if rank != 0:
        return {}
    manifest = write_manifest(work, len(shards), config, entries)
    if work != out and manifest["complete"]:
        folders.swap_in(work, out)
    return manifest


def _barrier(world: int, device: str) -> None:
    """Wait for every rank; the process group is the training stages' (nccl on CUDA, gloo on the CPU)."""
    if world > 1:
        import torch.distributed as dist

        from specdraft.training.runs.trainer import init_distributed

        init_distributed(device)
        dist.barrier()


def _generate_shards(config: DistillDataConfig, out: Path, shards: list, todo: list[int], progress: bool,
                     after_shard: Callable[[], object] | None = None, models: tuple | None = None,
                     entries: dict[str, tuple[int, str]] | None = None) -> None:
    """Generate the shards ``todo`` into ``out``; the progress bar counts the prompts of every rank (shards on
    disk), so under torchrun it shows the whole run."""
    from specdraft.models.registry import load_model, load_tokenizer, parse_dtype

    engine = None
    if models is None and config.engine == "vllm":
        from specdraft.training.data.vllm_generation import start_engine

        engine = start_engine(config)  # a subprocess: stopped below, and dies with this process
        models = engine, load_tokenizer(config.target), None
    elif models is None:
        native = config.engine == "native"
        target = load_model(config.target, parse_dtype(config.dtype), backend="native" if native else "hf",
                            device=config.device)
        tokenizer = load_tokenizer(config.target)
        static = native and config.device != "cpu"
        model = StaticEngine(target, refill=config.refill) if static else target if native else target.model
        models = model, tokenizer, onpolicy.load_drafter(config, target, tokenizer)
    try:
        _write_shards(config, out, shards, todo, progress, after_shard, models, entries)
    finally:
        if engine is not None:
            engine.close()


def _write_shards(config: DistillDataConfig, out: Path, shards: list, todo: list[int], progress: bool,
                  after_shard: Callable[[], object] | None, models: tuple,
                  entries: dict[str, tuple[int, str]] | None) -> None:
    from tqdm import tqdm

    model, tokenizer, drafter = models
    done = lambda: sum(len(s) for i, s in enumerate(shards) if shard_path(out, i).is_file())  # noqa: E731
    bar = tqdm(total=sum(len(s) for s in shards), initial=done(), unit="prompt", disable=not progress,
               desc="distill-data")
    for index in todo:
        started = time.perf_counter()
        seed = config.seed * 100_003 + index
        records = (generate_shard(model, tokenizer, shards[index], config, seed) if config.answers
                   else onpolicy.generate_shard(model, tokenizer, shards[index], config, seed, generate_shard, drafter))
        text = "".join(json.dumps(r) + "\n" for r in records)
        folders.atomic_write(shard_path(out, index), text)
        if entries is not None:
            entries[shard_path(out, index).name] = (len(records), folders.digest_bytes(text.encode()))
        if after_shard is not None:
            after_shard()
        bar.update(done() - bar.n)
        bar.set_postfix(prompts_per_min=f"{60 * len(shards[index]) / (time.perf_counter() - started):.1f}")
    bar.close()


def write_manifest(out: Path, num_shards: int, config: DistillDataConfig,
                   entries: dict[str, tuple[int, str]] | None = None) -> dict:
    """List the shards present with their record counts (``shards``) and checksums (``sha256``); ``complete`` when
    none is missing. ``entries`` holds the (records, sha256) already known; other shards on disk are read."""
    entries = {} if entries is None else entries
    for index in range(num_shards):
        path = shard_path(out, index)
        if path.name not in entries and path.is_file():
            entries[path.name] = folders.count_and_hash(path)
    present = {name: entries[name] for name in sorted(entries) if (out / name).is_file()}
    manifest = {"num_shards": num_shards, "complete": len(present) == num_shards,
                "shards": {name: count for name, (count, _) in present.items()},
                "sha256": {name: digest for name, (_, digest) in present.items()},
                "records": sum(count for count, _ in present.values()), "config": config.data_fields()}
    folders.atomic_write(out / folders.MANIFEST_FILE, json.dumps(manifest, indent=1))
    return manifest


@torch.inference_mode()
def generate_shard(model, tokenizer, prompts: list[tuple[str, list[dict]]], config: DistillDataConfig,
                   seed: int) -> list[dict]:
    """Responses for one shard, batched (vLLM: the whole shard at once; it batches itself), or the answers given,
    scored; records in prompt order."""
    encoded = encode_prompts(tokenizer, [prompt[1] for prompt in prompts])
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))  # similar lengths share a batch
    records: dict[int, list[dict]] = {}
    whole = config.engine == "vllm" or (isinstance(model, StaticEngine) and model.refill)  # they batch it themselves
    step = len(order) if whole else config.batch_size
    for start in range(0, len(order), step):
        batch = order[start : start + step]
        if config.answers:  # made elsewhere: the target's top-k added (scoring.given_responses)
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            responses = given_responses(model, [encoded[i] for i in batch], [prompts[i][2] for i in batch],
                                        config.max_new_tokens, tokenizer.eos_token_id, config.top_logprobs, pad)
        else:
            responses = _respond(config.engine)(model, tokenizer, [encoded[i] for i in batch], config,
                                                seed * 1_000 + start)
        for slot, i in enumerate(batch):
            mine = responses[slot * config.responses_per_prompt : (slot + 1) * config.responses_per_prompt]
            records[i] = [_record(prompts[i], encoded[i], r, k, config, tokenizer) for k, r in enumerate(mine)]
    return [record for i in range(len(prompts)) for record in records[i]]


def _respond(engine: str) -> Callable:
    """The batch function of an engine: ``(model, tokenizer, prompts, config, seed) -> responses``."""
    if engine == "vllm":
        from specdraft.training.data.vllm_generation import generate_batch

        return generate_batch
    return _generate_batch_native if engine == "native" else _generate_batch


def _generate_batch_native(model, tokenizer, batch: list[list[int]], config: DistillDataConfig, seed: int
                           ) -> list[dict]:
    """The same through the native Llama's batched rows (:mod:`specdraft.training.data.native_generation`): ragged rows
    on the CPU, a :class:`StaticEngine` (static cache, CUDA graphs) on CUDA."""
    rows = [ids for ids in batch for _ in range(config.responses_per_prompt)]
    sampling = SamplingConfig(config.temperature, config.top_k, config.top_p)
    if isinstance(model, StaticEngine):
        generator = torch.Generator(model.model.embed_weight.device).manual_seed(seed)
        return model.generate(rows, config.max_new_tokens, sampling, tokenizer.eos_token_id, config.top_logprobs,
                              generator, rows=config.batch_size)
    return generate_rows(model, rows, config.max_new_tokens, sampling, tokenizer.eos_token_id, config.top_logprobs,
                         torch.Generator().manual_seed(seed))


def _generate_batch(model, tokenizer, batch: list[list[int]], config: DistillDataConfig, seed: int) -> list[dict]:
    """One left-padded ``generate`` call -> per response: token ids (cut after EOS), finish reason, top log-probs."""
    torch.manual_seed(seed)  # transformers' sampling draws from the global generator
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
    prompt_id, messages = prompt[0], prompt[1]
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
