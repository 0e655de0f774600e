"""Online distillation while serving (Online Speculative Decoding, Liu et al. 2023, arXiv 2310.07177): the drafter
keeps learning from the traffic it drafts for.

- The decoding thread records the target's top-k p at every verified position into a bounded on-disk replay buffer
  (:mod:`specdraft.serve.replay`); no extra target forward runs.
- A background thread wakes every ``every_tokens`` served tokens, fine-tunes a copy of the current drafter on the
  buffer's training records (:mod:`specdraft.serve.online_train`), scores the candidate and the current drafter by
  top-1 agreement with p on the most recent held-back records, and only when the candidate is better builds a
  complete serving copy and swaps it in with one assignment. Sequences already running keep the drafter they
  started with; new ones get the new version. Decoding never waits on training, and verification keeps the output
  lossless whatever the drafter.
- The accepted drafter (its weights without the shared embeddings) and the history of rounds are saved in the
  folder, written beside and renamed; a restart resumes from them and from the buffer.

The thread runs at the lowest CPU priority by default (``nice`` 19 for that thread on Linux), so on a busy CPU the
decoding thread comes first; on a machine shared with other busy processes that can starve training (``nice``).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from specdraft.drafters.base import Drafter
from specdraft.drafters.combined import draft_model_of, with_model
from specdraft.errors import SpecdraftError
from specdraft.files import write_text_atomic
from specdraft.hardware import release_openmp_workers
from specdraft.models.native_llama import NativeLlama
from specdraft.serve.online_config import OnlineDistillConfig
from specdraft.serve.online_train import finetune_copy, hf_from_native, native_from_hf, top1_agreement
from specdraft.serve.replay import ReplayBuffer, VerifiedRecorder

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
_WEIGHTS = re.compile(r"^drafter-v\d+\.safetensors$")
_STALE = (".drafter-v*.safetensors.*.tmp", f".{STATE_FILE}.*.tmp")  # writes a crash cut short (beside, renamed)


def check_supported(prototype: Drafter | None) -> None:
    """Online distillation trains a native Llama draft model drafting chains; anything else is refused."""
    base = draft_model_of(prototype)
    if base is None or not isinstance(base.model, NativeLlama):
        name = getattr(prototype, "name", "no drafter")
        raise SpecdraftError(f"--online-distill trains a draft model (--draft, a Llama checkpoint); {name} is not one")
    if base.tree_branching:
        raise SpecdraftError("--online-distill needs a chain-drafting draft model (no tree_branching option)")


class OnlineDistiller:
    """Owns the replay buffer, the current drafter version and the training thread.

    Args:
        config: the settings.
        prototype: the loaded draft-model drafter (unused instance), version 0.
        base: the name it was loaded under (a restart must name the same).
        make_factory: builds the per-sequence drafter factory of a prototype (lockstep drafting in the server).
        pad_id: padding token id for training batches.
    """

    def __init__(self, config: OnlineDistillConfig, prototype: Drafter, base: str,
                 make_factory: Callable[[Drafter], Callable[[], Drafter]], pad_id: int) -> None:
        check_supported(prototype)
        self.config, self.base, self.pad_id = config, base, pad_id
        self.folder = Path(config.folder)
        check_folder(config, base)
        for pattern in _STALE:
            for stale in self.folder.glob(pattern):
                stale.unlink(missing_ok=True)
        self.buffer = ReplayBuffer(self.folder / "buffer", config.max_records, config.heldout_every)
        self.recorder = VerifiedRecorder(config.top_k)
        self._make_factory, self._base_proto = make_factory, prototype
        self.keep = draft_model_of(prototype).vocab_keep  # (N,) draft vocabulary, or None
        self.history: list[dict] = []  # one entry per training round
        self.served: dict[int, list[int]] = {}  # version -> [accepted, proposed] draft tokens
        self._recent: collections.deque = collections.deque(maxlen=256)  # (accepted, proposed), latest drafted steps
        self.version, self._current = 0, hf_from_native(draft_model_of(prototype).model)
        self._resume()
        self._live = (self.version, make_factory(self._prototype(self._current)))
        self._new_tokens, self._cond, self._stopping = 0, threading.Condition(), False
        self._thread = threading.Thread(target=self._run, name="specdraft-online-distill", daemon=True)

    # --- the decoding thread's side ---------------------------------------------------------------------------

    def make_drafter(self) -> Drafter:
        """A drafter of the current version for a new sequence."""
        version, factory = self._live  # one read: a swap replaces the pair at once
        drafter = factory()
        drafter.online_version = version
        return drafter

    def on_verify(self, seq, p_logits: torch.Tensor, missed: bool, proposed: int) -> None:
        self.recorder.on_verify(seq, p_logits, missed)
        if proposed:
            accepted = p_logits.shape[0] - 1
            counts = self.served.setdefault(getattr(seq.drafter, "online_version", 0), [0, 0])
            counts[0] += accepted
            counts[1] += proposed
            self._recent.append((accepted, proposed))

    def finished(self, seq) -> None:
        """Store a finished sequence's record; wake the trainer after ``every_tokens`` new tokens."""
        record = self.recorder.finish(seq, {"drafter_version": getattr(seq.drafter, "online_version", 0)})
        if record is None:
            return
        self.buffer.add(record)
        with self._cond:
            self._new_tokens += len(record["response_token_ids"])
            if self._new_tokens >= self.config.every_tokens:
                self._cond.notify_all()

    def discard(self, seq) -> None:
        self.recorder.discard(seq)

    # --- the training thread ----------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the training thread; a round still running is abandoned with the process (it writes nothing until
        its end, and then only by renames)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        if self.config.nice:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.config.nice)  # this thread (Linux)
            except (AttributeError, OSError):
                pass
        while True:
            with self._cond:
                while not self._stopping and self._new_tokens < self.config.every_tokens:
                    self._cond.wait()
                if self._stopping:
                    return
                self._new_tokens = 0
            try:
                self.train_round()
            except Exception:  # a failed round must not stop serving: the current drafter stays
                log.exception("online distillation round failed")
            release_openmp_workers()  # idle until the next round: its workers would slow the decoding thread's

    def train_round(self) -> dict:
        """Fine-tune a copy of the current drafter on the buffer, score both on recent held-back records, swap the
        candidate in when it agrees with the target more often. Returns the round's entry of :attr:`history`."""
        config, started = self.config, time.monotonic()
        train, heldout = self.buffer.records()
        heldout = heldout[-config.heldout_records :]
        entry = {"round": len(self.history) + 1, "version": self.version, "train_records": len(train),
                 "heldout_records": len(heldout), "accepted": False}
        if not train or not heldout:
            self._note(entry | {"reason": "not enough records yet"})
            return self.history[-1]
        candidate = finetune_copy(
            self._current, train, loss=config.loss, steps=config.steps, batch_size=config.batch_size, lr=config.lr,
            max_seq_len=config.max_seq_len, keep=self.keep, pad_id=self.pad_id, seed=config.seed + entry["round"],
            loss_options=config.loss_settings())
        score = {"keep": self.keep, "pad_id": self.pad_id, "max_seq_len": config.max_seq_len}
        current = top1_agreement(self._current, heldout, **score)
        new = top1_agreement(candidate, heldout, **score)
        entry |= {"current_agreement": current[0] / max(current[1], 1), "candidate_agreement": new[0] / max(new[1], 1),
                  "positions": current[1]}
        if new[0] > current[0]:
            self._accept(candidate)
            entry |= {"accepted": True, "version": self.version}
        self._note(entry | {"seconds": round(time.monotonic() - started, 1)})
        return self.history[-1]

    def _accept(self, candidate) -> None:
        """Save the candidate as the next version, then make it the one new sequences get."""
        factory = self._make_factory(self._prototype(candidate))  # complete before anyone can see it
        version = self.version + 1
        self._save_weights(candidate, version)
        self._current, self.version = candidate, version
        self._live = (version, factory)

    def _prototype(self, model) -> Drafter:
        if model is self._current and self.version == 0:
            return self._base_proto
        return with_model(self._base_proto, native_from_hf(model, draft_model_of(self._base_proto).model))

    # --- state on disk ----------------------------------------------------------------------------------------

    def _weights_name(self, version: int) -> str:
        return f"drafter-v{version}.safetensors"

    def _save_weights(self, model, version: int) -> None:
        from safetensors.torch import save_file

        tensors = {name: param.detach().contiguous().clone() for name, param in model.named_parameters()
                   if param.requires_grad}  # the trained part: decoder layers and final norm
        path = self.folder / self._weights_name(version)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file(tensors, tmp)
        os.replace(tmp, path)

    def _note(self, entry: dict) -> None:
        """Append a round to the history and save the state (version, weights file, history) atomically; older
        weights files go once the state no longer names them."""
        self.history.append(entry)
        state = {"base": self.base, "version": self.version, "weights": self._weights_name(self.version)
                 if self.version else None, "config": asdict(self.config), "history": self.history}
        write_text_atomic(self.folder / STATE_FILE, json.dumps(state, indent=1) + "\n")
        for old in self.folder.glob("drafter-v*.safetensors"):
            if old.name != state["weights"]:
                old.unlink(missing_ok=True)
        log.info("online distillation round %s", json.dumps(entry))

    def _resume(self) -> None:
        """Load the last accepted drafter and the history saved in the folder, if any."""
        state = read_state(self.folder, self.base)
        if state is None:
            return
        self.history = list(state.get("history", []))
        if state.get("weights"):
            from safetensors.torch import load_file

            weights = self.folder / state["weights"]
            try:
                self._current.load_state_dict(load_file(weights), strict=False)
            except Exception as exc:  # damaged since the check, or weights of another model
                raise SpecdraftError(f"{weights} cannot be loaded into the drafter ({exc})") from None
            self.version = int(state["version"])

    def metric_lines(self) -> list[str]:
        """Prometheus lines: the drafter version, served acceptance by version and recently, held-back agreement of
        each accepted version, rounds and buffer size."""
        recent = list(self._recent)
        by_version = sorted(self.served.items())
        accepted = [entry for entry in self.history if entry.get("accepted")]
        lines = _gauge("online_drafter_version", "version of the drafter new sequences get (0 = as loaded)",
                       [("", self._live[0])])
        lines += _gauge("online_acceptance_rate", "accepted / proposed draft tokens served, by drafter version",
                        [(f'version="{v}"', a / max(p, 1)) for v, (a, p) in by_version])
        lines += _gauge("online_acceptance_rate_recent", "accepted / proposed draft tokens, latest 256 drafted steps",
                        [("", sum(a for a, _ in recent) / max(sum(p for _, p in recent), 1))])
        lines += _gauge("online_heldout_agreement", "top-1 agreement with p on held-back records when accepted",
                        [(f'version="{e["version"]}"', e["candidate_agreement"]) for e in accepted])
        lines += _gauge("online_rounds", "training rounds run", [("", len(self.history))])
        return lines + _gauge("online_records", "records in the replay buffer", [("", len(self.buffer))])


def check_folder(config: OnlineDistillConfig, base: str | None) -> None:
    """Before any model loads: the folder (or the one it will be made in) is one this process can write, and what
    an earlier run left there is intact (:func:`read_state`). Raises :class:`SpecdraftError` naming the file."""
    folder = Path(config.folder)
    if folder.exists() and not folder.is_dir():
        raise SpecdraftError(f"--online-distill {folder} is not a folder")
    existing = next((p for p in (folder, *folder.parents) if p.exists()), Path("."))
    if not existing.is_dir() or not os.access(existing, os.R_OK | os.W_OK | os.X_OK):
        raise SpecdraftError(f"--online-distill {folder}: cannot read and write in {existing}")
    buffer = folder / "buffer"
    if buffer.exists() and (not buffer.is_dir() or not os.access(buffer, os.R_OK | os.W_OK | os.X_OK)):
        raise SpecdraftError(f"--online-distill {folder}: {buffer} is not a folder this process can read and write")
    read_state(folder, base)


def read_state(folder: Path, base: str | None) -> dict | None:
    """``folder/state.json`` (None if absent), checked: valid JSON for the same draft model ``base``, naming a
    weights file that is present and a whole safetensors file (its header and sizes are read, not its tensors)."""
    path = folder / STATE_FILE
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SpecdraftError(f"{path} is unreadable or not valid JSON ({exc})") from None
    if not isinstance(state, dict) or not isinstance(state.get("version", 0), int):
        raise SpecdraftError(f"{path} is not a state file of online distillation")
    if state.get("base") != base:
        raise SpecdraftError(f"{folder} continues drafter {state.get('base')!r}, not {base!r}: "
                             "give that --draft or another --online-distill folder")
    if state.get("weights"):
        from safetensors import safe_open

        name = str(state["weights"])
        weights = folder / name
        if not _WEIGHTS.match(name) or not weights.is_file():
            raise SpecdraftError(f"{path} names {name}, which is missing")
        try:
            with safe_open(str(weights), "pt"):
                pass
        except Exception as exc:  # SafetensorError: truncated, not a safetensors file; OSError
            raise SpecdraftError(f"{weights} is damaged ({exc}): restore it, or move the folder aside to start "
                                 "over") from None
    return state


def _gauge(name: str, help_text: str, values: list[tuple[str, float]]) -> list[str]:
    lines = [f"# HELP specdraft_{name} {help_text}", f"# TYPE specdraft_{name} gauge"]
    return lines + [f"specdraft_{name}{{{labels}}} {value:g}" if labels else f"specdraft_{name} {value:g}"
                    for labels, value in values]


__all__ = ["OnlineDistillConfig", "OnlineDistiller", "check_folder", "check_supported", "read_state"]
