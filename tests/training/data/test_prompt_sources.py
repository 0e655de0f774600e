"""Prompt sources: every ShareGPT human turn in its context, split by conversation; pooled sources."""

import json

import pytest

from specdraft.corpus import split_of
from specdraft.errors import SpecdraftError
from specdraft.training.data.prompt_sources import load_prompt_sources, sharegpt_turn_prompts


def chat(cid: str, *turns: tuple[str, str]) -> dict:
    return {"id": cid, "conversations": [{"from": who, "value": text} for who, text in turns]}


def write_sharegpt(path, conversations):
    path.write_text(json.dumps(conversations, indent=1), encoding="utf-8")
    return path


CONVERSATIONS = [
    chat("a_0", ("human", "Explain how a rainbow forms."), ("gpt", "Light refracts in drops."),
         ("human", "And a double rainbow?"), ("gpt", "Two reflections.")),
    chat("b_1", ("gpt", "Part two starts with the assistant."), ("human", "Now say it in French."),
         ("gpt", "Bien."), ("gpt", "A second assistant turn breaks the pattern."), ("human", "never read")),
    chat("c_0", ("human", "Write about the sea. " * 40), ("gpt", "Waves."), ("human", "Shorter, please.")),
    chat("d_0", ("human", "What is a tide?"), ("gpt", ""), ("human", "after an empty turn")),
]


def test_every_human_turn_with_the_conversation_before_it(tmp_path):
    path = write_sharegpt(tmp_path / "s.json", CONVERSATIONS)
    pairs = dict(sharegpt_turn_prompts("all", path=path))
    assert list(pairs) == ["sharegpt:a_0:0", "sharegpt:a_0:1", "sharegpt:b_1:0", "sharegpt:c_0:1", "sharegpt:d_0:0"]
    assert pairs["sharegpt:a_0:1"] == [
        {"role": "user", "content": "Explain how a rainbow forms."}, {"role": "assistant", "content": "Light "
         "refracts in drops."}, {"role": "user", "content": "And a double rainbow?"}]
    assert pairs["sharegpt:b_1:0"] == [{"role": "user", "content": "Now say it in French."}]
    assert len(pairs["sharegpt:c_0:1"]) == 3  # a long first turn is context, not a prompt of its own
    assert pairs["sharegpt:d_0:0"] == [{"role": "user", "content": "What is a tide?"}]
    assert sharegpt_turn_prompts("all", max_context_chars=60, path=path)[:2] == list(pairs.items())[:1] + [
        ("sharegpt:b_1:0", pairs["sharegpt:b_1:0"])]


def test_split_is_by_conversation_and_drops_heldout_openings(tmp_path):
    conversations = [chat(f"x{i}_0", ("human", f"Question number {i % 7} about the sea?"), ("gpt", "Yes."),
                          ("human", f"Follow-up {i}, please?")) for i in range(40)]
    path = write_sharegpt(tmp_path / "s.json", conversations)
    kwargs = dict(path=path, heldout_fraction=0.3)
    train, heldout = sharegpt_turn_prompts("train", **kwargs), sharegpt_turn_prompts("heldout", **kwargs)
    conv = {pid.split(":")[1] for pid, _ in train}
    assert conv and {pid.split(":")[1] for pid, _ in heldout}.isdisjoint(conv)
    assert all(split_of(c, 0.3) == "train" for c in conv)
    heldout_openings = {m[0]["content"] for _, m in heldout}
    assert not any(m[-1]["content"] in heldout_openings for _, m in train)


def test_pooled_sources_in_order_with_a_limit(tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("\n".join(json.dumps({"prompt": f"a{i}"}) for i in range(3)) + "\n")
    second.write_text(json.dumps({"category": "qa", "prompt": "b0"}) + "\n")
    pairs = load_prompt_sources(f"{first}, {second}")
    assert [pid for pid, _ in pairs] == ["a.jsonl:0", "a.jsonl:1", "a.jsonl:2", "b.jsonl:0"]
    assert [pid for pid, _ in load_prompt_sources(f"{first},{second}", limit=2)] == ["a.jsonl:0", "a.jsonl:1"]
    with pytest.raises(SpecdraftError, match="names no source"):
        load_prompt_sources(" , ")
