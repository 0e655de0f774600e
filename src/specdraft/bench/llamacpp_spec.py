"""llama.cpp's speculative decoding settings as benchmark method options.

A ``llama-server`` takes its speculative settings on the command line only: this build's ``/completion`` ignores
the per-request ``speculative.*`` fields (its server compiles them out), so every setting is one server. Methods:

- ``llama.cpp-draft:DRAFT.gguf`` (``--spec-type draft-simple``, a draft model such as ``specdraft export DRAFTER
  --format gguf``), ``llama.cpp-eagle3:EAGLE3.gguf`` (``--spec-type draft-eagle3``, ``specdraft export HEADS
  --format eagle3-gguf``) and ``llama.cpp-dflash:DFLASH.gguf`` (``--spec-type draft-dflash``, one forward drafts a
  block: ``specdraft export HEADS --format dflash-gguf``; llama.cpp clamps ``n_max`` to the block size less one),
  with options ``;n_max=N`` (``--spec-draft-n-max``, default γ), ``;n_min=N``
  (``--spec-draft-n-min``: a shorter draft is dropped; llama.cpp's default 0) and ``;p_min=P``
  (``--spec-draft-p-min``: drafting stops at a token whose draft probability is below P; llama.cpp's default 0),
  e.g. ``llama.cpp-draft:d.gguf;n_max=2;p_min=0.75``.
- ``llama.cpp-ngram:MODE`` (model-free drafting from the text so far), MODE one of :data:`NGRAM_MODES` with its
  options, e.g. ``llama.cpp-ngram:ngram-map-k;size_n=3;size_m=4``. Every option is passed explicitly, with
  llama.cpp's own defaults (those of the pinned build) where none is given, so a record says what ran.

γ (``num_draft_tokens`` of the records) is the longest draft the setting allows: ``n_max``, or the mode's draft
length (``n_max`` of ngram-mod, ``size_m`` of the others).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

from specdraft.errors import SpecdraftError

DRAFT_KINDS = {"llama.cpp-draft": "draft-simple", "llama.cpp-eagle3": "draft-eagle3",
               "llama.cpp-dflash": "draft-dflash"}
HEAD_ARCHS = {"draft-eagle3": ("eagle3", "eagle3-gguf"), "draft-dflash": ("dflash", "dflash-gguf")}  # else: a model
MASK_KEY = "tokenizer.ggml.mask_token_id"  # a DFlash GGUF adds its block filler to the target's tokenizer
DRAFT_OPTIONS = {"n_max": ("--spec-draft-n-max", int), "n_min": ("--spec-draft-n-min", int),
                 "p_min": ("--spec-draft-p-min", float)}
DRAFT_DEFAULTS = {"n_min": 0, "p_min": 0.0}  # llama.cpp's own defaults (common.h of the pinned build)
NGRAM_MODES = {  # mode: {option: (flag, llama.cpp's default)}; the first option named in NGRAM_LENGTH is γ
    "ngram-mod": {"n_match": ("--spec-ngram-mod-n-match", 24), "n_max": ("--spec-ngram-mod-n-max", 64),
                  "n_min": ("--spec-ngram-mod-n-min", 48)},
    **{mode: {"size_n": (f"--spec-{mode}-size-n", 12), "size_m": (f"--spec-{mode}-size-m", 48),
              "min_hits": (f"--spec-{mode}-min-hits", 1)} for mode in ("ngram-simple", "ngram-map-k", "ngram-map-k4v")},
}
NGRAM_LENGTH = {"ngram-mod": "n_max", "ngram-simple": "size_m", "ngram-map-k": "size_m", "ngram-map-k4v": "size_m"}


@dataclass(frozen=True)
class Speculation:
    """How one ``llama-server`` speculates: ``--spec-type``, its draft model (None for ngram modes), options."""

    spec_type: str
    draft: Path | None = None
    options: dict = field(default_factory=dict)

    @property
    def num_draft_tokens(self) -> int:
        """The longest draft (γ)."""
        return int(self.options[NGRAM_LENGTH.get(self.spec_type, "n_max")])

    def args(self, threads: int) -> list[str]:
        """``llama-server`` arguments for this setting."""
        args = ["--spec-type", self.spec_type]
        if self.draft is not None:
            args += ["-md", str(self.draft), "-td", str(threads), "-tbd", str(threads)]
        flags = NGRAM_MODES.get(self.spec_type) or {k: (flag, None) for k, (flag, _) in DRAFT_OPTIONS.items()}
        for key, value in self.options.items():
            args += [flags[key][0], str(value)]
        return args

    def record(self) -> dict:
        """What a benchmark record keeps of the setting."""
        return {"type": self.spec_type, "draft": str(self.draft) if self.draft else None} | self.options


def _options(text: str, allowed: dict, where: str) -> dict:
    """``KEY=VALUE;KEY=VALUE`` with KEY in ``allowed`` ({key: type}), values checked (>= 0; p_min in [0, 1])."""
    options = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        key, _, value = item.partition("=")
        if key not in allowed:
            raise SpecdraftError(f"{where}: unknown option {key!r}; known: {', '.join(allowed)}")
        try:
            number = allowed[key](value)
        except ValueError:
            words = "an integer" if allowed[key] is int else "a number"
            raise SpecdraftError(f"{where}: {key} needs {words}, got {value!r}") from None
        if number < 0 or (key == "p_min" and number > 1):
            raise SpecdraftError(f"{where}: {key}={value} is out of range")
        options[key] = number
    return options


def parse_speculation(kind: str, arg: str | None, gamma: int | None = None) -> Speculation:
    """The setting of method ``KIND:ARG`` (γ = ``gamma`` where the options set no ``n_max``; without either,
    ``n_max`` stays None: the options are only checked); raises SpecdraftError naming the problem. Files are not
    read here (:func:`check_draft_file`)."""
    where = f"{kind}:{arg or ''}"
    if kind == "llama.cpp-ngram":
        mode, _, rest = (arg or "").partition(";")
        if mode not in NGRAM_MODES:
            raise SpecdraftError(f"{where}: llama.cpp-ngram needs a mode, one of {', '.join(NGRAM_MODES)} "
                                 "(e.g. llama.cpp-ngram:ngram-map-k;size_n=3)")
        given = _options(rest, {key: int for key in NGRAM_MODES[mode]}, where)
        return Speculation(mode, None, {k: given.get(k, default) for k, (_, default) in NGRAM_MODES[mode].items()})
    if kind not in DRAFT_KINDS:
        known = ", ".join([*DRAFT_KINDS, "llama.cpp-ngram"])
        raise SpecdraftError(f"{where}: not a llama.cpp speculative method ({known})")
    path, _, rest = (arg or "").partition(";")
    if not path:
        raise SpecdraftError(f"method {kind!r} needs a draft GGUF: {kind}:PATH")
    given = _options(rest, {k: t for k, (_, t) in DRAFT_OPTIONS.items()}, where)
    options = {"n_max": given.get("n_max", gamma)} | {k: given.get(k, v) for k, v in DRAFT_DEFAULTS.items()}
    if options["n_max"] is not None and options["n_max"] < 1:
        raise SpecdraftError(f"{where}: n_max must be at least 1")
    if options["n_max"] is not None and options["n_min"] > options["n_max"]:
        raise SpecdraftError(f"{where}: n_min ({options['n_min']}) is above n_max ({options['n_max']}): no draft "
                             "would ever be kept")
    return Speculation(DRAFT_KINDS[kind], Path(path).expanduser(), options)


def fixed_length(kind: str, arg: str | None) -> bool:
    """Whether the method's draft length is set by its own options (then it has no variant per γ in a sweep)."""
    return kind == "llama.cpp-ngram" or parse_speculation(kind, arg).options["n_max"] is not None


@dataclass(frozen=True)
class GgufFacts:
    """What the benchmark reads of a GGUF file: its ``tokenizer.*`` values, architecture and tensor elements."""

    tokenizer: dict
    architecture: str | None
    elements: int


def gguf_facts(path: Path) -> GgufFacts:
    """:class:`GgufFacts` of ``path``, read once per file version (``GGUFReader`` parses every field: tens of
    seconds for a 49k-token vocabulary on a loaded 2-core machine)."""
    stat = os.stat(path)
    return _read_facts(str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _read_facts(path: str, mtime_ns: int, size: int) -> GgufFacts:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    tokenizer = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    arch = reader.fields.get("general.architecture")
    return GgufFacts(tokenizer, arch.contents() if arch is not None else None,
                     sum(int(t.n_elements) for t in reader.tensors))


def check_draft_file(speculation: Speculation, target: Path, kind: str) -> None:
    """Refuse a draft GGUF that is missing, speaks another vocabulary than ``target`` (a DFlash GGUF may add its
    mask token id), or is of the wrong kind (heads of one kind under another --spec-type, a draft model under
    draft-eagle3 or draft-dflash)."""
    draft = speculation.draft
    arch, fmt = HEAD_ARCHS.get(speculation.spec_type, (None, "gguf"))
    make = f"specdraft export ... --format {fmt}"
    if draft is None or not draft.is_file():
        raise SpecdraftError(f"{kind}: no GGUF file at {draft} (make one with {make})")
    facts = gguf_facts(draft)
    heads = {a for a, _ in HEAD_ARCHS.values()}
    if facts.architecture != arch and (arch is not None or facts.architecture in heads):
        needs = f"{'an' if arch[0] in 'aeiou' else 'a'} {arch}" if arch else "a draft model"
        raise SpecdraftError(f"{kind}: {draft.name} is a {facts.architecture!r} GGUF; {kind} needs {needs} GGUF "
                             f"({make})")
    tokenizer = facts.tokenizer
    if arch == "dflash":
        tokenizer = {k: v for k, v in tokenizer.items() if k != MASK_KEY}
        if MASK_KEY not in facts.tokenizer:
            raise SpecdraftError(f"{kind}: {draft.name} has no {MASK_KEY}, which draft-dflash fills its block with "
                                 f"({make})")
    if tokenizer != gguf_facts(target).tokenizer:
        raise SpecdraftError(f"{kind}: the draft GGUF's tokenizer metadata differs from the target's {target.name}")
