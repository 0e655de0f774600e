"""The drafter registry: every drafter chosen by name declares its facts, the facts agree with what the class
implements, and adding a drafter is one file (the worked example of docs/architecture.md, run as it stands there)."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch

import specdraft.drafters
from specdraft.batching import generate_batch
from specdraft.bench.replay import replay
from specdraft.cli import main
from specdraft.decoding import generate
from specdraft.drafters import NAMED_DRAFTERS, DraftModelDrafter, PromptLookupDrafter, WithPromptLookup, facts_of
from specdraft.drafters.base import DrafterFacts, ReadsTargetCache, ReadsTargetFeatures
from specdraft.models.native_llama import NativeLlama
from specdraft.sequence import GenerationConfig
from toys import save_tiny_checkpoint, tiny_llama

ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
SHIPPED = {"prompt-lookup", "ngram", "rest", "lookahead", "suffix", "layer-skip", "gsd", "bild", "eagle", "eagle3",
           "medusa", "glide"}


def test_every_named_drafter_declares_facts_that_agree_with_its_class():
    assert SHIPPED <= set(NAMED_DRAFTERS)
    for name in NAMED_DRAFTERS:
        cls = NAMED_DRAFTERS[name]
        facts = cls.facts
        assert isinstance(facts, DrafterFacts) and cls.method == name
        assert facts.reads_target_features == issubclass(cls, ReadsTargetFeatures), name
        if issubclass(cls, ReadsTargetCache):
            assert facts.reads_target_cache, name
        if facts.reads_target_cache:  # a batch's rows share no target cache
            assert not facts.batchable, name
        if facts.replayable:  # replay runs no target: nothing of it can be read
            assert not (facts.reads_target_features or facts.reads_target_cache), name
    assert facts_of(NAMED_DRAFTERS["layer-skip"]).cpu_only and facts_of(NAMED_DRAFTERS["eagle3"]).cpu_only
    assert not facts_of(NAMED_DRAFTERS["bild"]).replayable  # its lossy acceptance is not greedy replay's


def test_a_combination_has_the_facts_of_the_drafter_inside():
    model = NativeLlama.from_hf(tiny_llama(1))
    assert facts_of(WithPromptLookup(DraftModelDrafter(model), PromptLookupDrafter())).replayable
    assert facts_of(object()) == DrafterFacts()  # a drafter that declares nothing: the defaults


def test_facts_are_read_by_the_cli_and_the_server_config(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import specdraft.cli
    from specdraft.cli import decoding_device
    from specdraft.errors import SpecdraftError
    from specdraft.serve import ServeConfig

    monkeypatch.setattr(specdraft.cli, "resolve_device", lambda device: SimpleNamespace(name="cuda:0"))  # a GPU
    assert decoding_device("cuda", "auto", "prompt-lookup") == "cuda:0"
    for cpu_only in ("layer-skip", "eagle3"):
        with pytest.raises(SpecdraftError, match="drafts on the CPU"):
            decoding_device("cuda", "auto", cpu_only)
    with pytest.raises(SpecdraftError, match="target's KV cache"):
        ServeConfig(target=str(tmp_path), drafter="glide")  # refused before any model loads


def _worked_example() -> dict[str, str]:
    """The code blocks of docs/architecture.md's worked example, by the file each names in its first line."""
    text = ARCHITECTURE.read_text()
    section = text[text.index("### Adding a drafter"):]
    blocks = re.findall(r"```python\n# (\S+)\n(.*?)```", section, flags=re.S)
    return {path: code for path, code in blocks}


@pytest.fixture
def bigram(tmp_path, monkeypatch):
    """The worked example's drafter file, installed in a folder of the drafters package's path."""
    example = _worked_example()
    assert set(example) == {"src/specdraft/drafters/bigram.py", "tests/drafters/test_bigram.py"}
    folder = tmp_path / "more_drafters"
    folder.mkdir()
    (folder / "bigram.py").write_text(example["src/specdraft/drafters/bigram.py"])
    monkeypatch.setattr(specdraft.drafters, "__path__", [*specdraft.drafters.__path__, str(folder)])
    NAMED_DRAFTERS.refresh()
    yield example["tests/drafters/test_bigram.py"]
    sys.modules.pop("specdraft.drafters.bigram", None)
    monkeypatch.undo()
    NAMED_DRAFTERS.refresh()


def test_adding_a_drafter_is_one_file_the_docs_worked_example(bigram, tmp_path, capsys):
    assert "bigram" in NAMED_DRAFTERS and facts_of(NAMED_DRAFTERS["bigram"]).replayable
    namespace: dict = {}
    exec(compile(bigram, "test_bigram.py", "exec"), namespace)  # its own test, as the docs show it
    namespace["test_bigram_follows_the_most_frequent_successor_and_decodes_losslessly"]()

    target = str(save_tiny_checkpoint(tmp_path / "target", seed=0))
    base = ["generate", "--target", target, "--prompt-ids", "5,7,5,7,5,9,5", "--max-new-tokens", "12", "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)["token_ids"]
    assert main([*base, "--drafter", "bigram", "--drafter-option", "min_count=1"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain

    drafter = NAMED_DRAFTERS["bigram"]()
    model = NativeLlama.from_hf(tiny_llama(0))
    prompt = [5, 7, 5, 7, 5, 9, 5]
    answer = generate(model, prompt, None, GenerationConfig(16)).token_ids
    lengths = replay(drafter, prompt, answer, 3, 16)  # the bench's greedy replay takes it: it is replayable
    spec = generate(model, prompt, NAMED_DRAFTERS["bigram"](), GenerationConfig(16, 3, speculation="fixed"))
    assert lengths == spec.stats.accept_lengths
    batched = generate_batch(model, [prompt, prompt[:3]], lambda: NAMED_DRAFTERS["bigram"](), GenerationConfig(16, 3))
    assert batched[0].token_ids == answer
    assert torch.equal(torch.tensor(batched[1].token_ids), torch.tensor(generate(model, prompt[:3], None,
                                                                                GenerationConfig(16)).token_ids))
