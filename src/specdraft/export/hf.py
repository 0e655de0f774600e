"""``--format hf``: a standalone Hugging Face checkpoint folder.

The drafter's weights with the embedding table included (from the target when the drafter shares it), its
tokenizer, ``drafter_options.json`` (specdraft's default options, described in the model card) and the token ranking
that ``draft_vocab`` uses. ``AutoModelForCausalLM.from_pretrained(out)`` loads it with no warning, and it works as
transformers' ``assistant_model`` and as vLLM's ``draft_model`` (``speculative_config={"model": out, ...}``).
"""

from __future__ import annotations

from pathlib import Path

from specdraft.export.base import CheckedDrafter, ExportConfig, register
from specdraft.models.standalone import read_options, standalone_card, write_standalone

CARD_SECTION = "## This folder"


def model_card(drafter: CheckedDrafter) -> str:
    """The drafter's own card (or a title) with a section on the standalone folder and its options."""
    path = drafter.folder / "README.md"
    card = path.read_text() if path.is_file() else f"# {Path(drafter.name).name}\n"
    if CARD_SECTION in card:
        return card
    return standalone_card(card, drafter.target_name, read_options(drafter.folder))


@register("hf")
def export_hf(config: ExportConfig, drafter: CheckedDrafter) -> Path:
    out = Path(config.out).expanduser()
    source = {"exported_from": drafter.name, "target": drafter.target_name, "format": "hf"}
    return write_standalone(drafter.folder, drafter.table, out, card=model_card(drafter), source=source)
