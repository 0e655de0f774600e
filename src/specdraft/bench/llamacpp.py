"""llama.cpp as benchmarked methods: ``llama.cpp`` (its plain decoding of the target's GGUF) and its speculative
decoding, ``llama.cpp-draft:DRAFT.gguf`` (a draft model, e.g. ``specdraft export --format gguf``),
``llama.cpp-eagle3:EAGLE3.gguf`` (EAGLE-3 heads, ``specdraft export --format eagle3-gguf``),
``llama.cpp-dflash:DFLASH.gguf`` (DFlash heads, ``specdraft export --format dflash-gguf``) and
``llama.cpp-ngram:MODE`` (its model-free n-gram drafting), with options
(:mod:`specdraft.bench.llamacpp_spec`).

Each method drives one ``llama-server`` subprocess on a free localhost port, started once and stopped when the
method is garbage-collected or the process exits; the speculative settings go on its command line (this build's
server ignores them in a request). Prompts go in as token ids (the same ids every other method gets; no second
tokenisation), with its prompt cache (``cache_prompt``) as the run keeps specdraft's (on by default: the prefix
the server's last prompt shares with this one is not read again). The server returns the generated
token ids and its own counters: ``prompt_ms`` (prefill), ``draft_n`` / ``draft_n_accepted`` (draft tokens proposed
/ accepted). Greedy is llama.cpp's greedy sampler (``temperature`` 0).

The binaries come from ``make engines`` (llama.cpp from the ``llama-cpp-python`` sdist, built once into the cache
folder for this machine); ``$SPECDRAFT_LLAMA_CPP_BIN`` names another folder holding ``llama-server``. A build with
specdraft's build info is checked against this machine before its server starts, and what it is (commit, options,
AMX, weight repacking) goes into the method's records (:mod:`specdraft.bench.llamacpp_build`), with the server's
threads and speculative setting.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch

from specdraft.bench.llamacpp_build import build_summary, check_build, engines_bin_dir
from specdraft.bench.llamacpp_spec import Speculation
from specdraft.errors import SpecdraftError
from specdraft.sequence import GenerationConfig

CONTEXT = 8192  # tokens of KV cache per server (prompt and answer of the longest turn)
START_TIMEOUT = 180.0  # seconds to wait for a server to load its models


def llama_cpp_bin_dir() -> Path:
    """Folder of the llama.cpp binaries: ``$SPECDRAFT_LLAMA_CPP_BIN``, else the cache build of ``make engines``."""
    if os.environ.get("SPECDRAFT_LLAMA_CPP_BIN"):
        return Path(os.environ["SPECDRAFT_LLAMA_CPP_BIN"]).expanduser()
    return engines_bin_dir()


def find_binary(name: str) -> Path:
    """A llama.cpp program (``llama-server``, ...) from the engines build (checked against this machine:
    :func:`check_build`), else from PATH."""
    path = llama_cpp_bin_dir() / name
    if path.is_file() and os.access(path, os.X_OK):
        check_build(path.parent)
        return path
    found = shutil.which(name)
    if found:
        return Path(found)
    raise SpecdraftError(f"llama.cpp's {name} is not built (looked in {llama_cpp_bin_dir()} and PATH): run "
                         "`make engines` once")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the server's process before exec: the kernel ends it when the benchmark's process dies (Linux), so a
    killed run leaves no server behind."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _stop(process: subprocess.Popen, log) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    log.close()


class LlamaServer:
    """A ``llama-server`` subprocess serving ``model`` on localhost, speculating as ``speculation`` says (None:
    plain decoding).

    ``build`` is what the benchmark records of the program's build (:func:`build_summary`, after
    :func:`check_build`), its threads and its speculative setting. The server keeps llama.cpp's defaults
    otherwise, weight repacking included.
    """

    def __init__(self, model: Path, speculation: Speculation | None = None, threads: int | None = None,
                 context: int = CONTEXT) -> None:
        threads = threads or torch.get_num_threads()
        binary = find_binary("llama-server")
        self.build = build_summary(check_build(binary.parent)) | {
            "threads": threads, "speculative": speculation.record() if speculation else None}
        self.port = _free_port()
        command = [str(binary), "-m", str(model), "--host", "127.0.0.1",
                   "--port", str(self.port), "-t", str(threads), "-tb", str(threads), "-c", str(context),
                   "-np", "1", "--temp", "0", "--no-webui"]
        if speculation is not None:
            command += speculation.args(threads)
        self.command = command
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=True)
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        preexec_fn=_die_with_parent)
        self._finalizer = weakref.finalize(self, _stop, self.process, self.log)
        self._wait_ready()

    def _log_tail(self, lines: int = 8) -> str:
        self.log.flush()
        self.log.seek(0)
        return " | ".join(self.log.read().strip().splitlines()[-lines:])

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SpecdraftError(f"llama-server exited ({self.process.returncode}): {self._log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        self.close()
        raise SpecdraftError(f"llama-server did not start within {START_TIMEOUT:.0f} s: {self._log_tail()}")

    def complete(self, payload: dict) -> dict:
        """POST /completion and return its JSON answer."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(payload).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=3600) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise SpecdraftError(f"llama-server answered {exc.code}: {exc.read()[:300]!r}") from None
        except (urllib.error.URLError, ConnectionError) as exc:
            raise SpecdraftError(f"llama-server is unreachable ({exc}): {self._log_tail()}") from None

    def close(self) -> None:
        self._finalizer()


def completion_payload(prompt_ids: Sequence[int], config: GenerationConfig, seed: int,
                       cache_prompt: bool = False) -> dict:
    """The /completion request for one turn: token ids in, token ids and counters out; ``cache_prompt``: the server
    reads the prefix its last prompt shares with this one from its cache (the speculative settings are the
    server's: :class:`LlamaServer`)."""
    s = config.sampling
    return {"prompt": [int(t) for t in prompt_ids], "n_predict": config.max_new_tokens, "cache_prompt": cache_prompt,
            "return_tokens": True, "stream": False, "seed": seed, "min_p": 0.0, "repeat_penalty": 1.0,
            "temperature": 0.0 if s.greedy else s.temperature, "top_k": s.top_k, "top_p": s.top_p}


def turn_result(answer: dict, wall: float, eos_token_ids: Sequence[int], drafting: bool, make):
    """A TurnResult from llama-server's answer: its tokens, prefill time and draft counters.

    Target forwards (decoding_steps) are the tokens less the accepted draft tokens: every forward after the
    prefill commits its accepted drafts plus one token of the target's own, and the prefill commits the first.
    """
    tokens = [int(t) for t in answer.get("tokens") or []]
    stop = answer.get("stop_type")
    if stop == "eos" and eos_token_ids and (not tokens or tokens[-1] not in eos_token_ids):
        tokens.append(int(eos_token_ids[0]))  # a server that leaves the end-of-sequence token out
    timings = answer.get("timings") or {}
    proposed = int(timings.get("draft_n", 0)) if drafting else None
    accepted = int(timings.get("draft_n_accepted", 0)) if drafting else None
    return make(token_ids=tokens, wall_time=wall, finish_reason="eos" if stop == "eos" else "length",
                decoding_steps=len(tokens) - (accepted or 0),
                prefill_seconds=float(timings["prompt_ms"]) / 1000 if "prompt_ms" in timings else None,
                draft_tokens_proposed=proposed, draft_tokens_accepted=accepted)


def draft_param_ratio(draft: Path, target: Path) -> float | None:
    """Parameters of the draft GGUF over the target GGUF's (element counts of their tensors); None for a target
    file without tensors."""
    from specdraft.bench.llamacpp_spec import gguf_facts

    target_params = gguf_facts(target).elements
    return gguf_facts(draft).elements / target_params if target_params else None
