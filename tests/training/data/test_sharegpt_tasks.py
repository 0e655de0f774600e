"""The sharegpt-tasks prompt source: Spec-Bench-shaped prompts from ShareGPT conversations, split by conversation."""

import json
from collections import Counter

from specdraft.corpus import split_of
from specdraft.training.data.prompt_sources import load_prompt_sources
from specdraft.training.data.sharegpt_tasks import (
    KINDS,
    german_sentences,
    is_short_question,
    is_word_problem,
    kind_of,
    one_line,
    sharegpt_task_prompts,
)

FRACTION = 0.3
ANIMALS = ("otters", "herons", "badgers", "foxes", "owls", "hares", "beavers", "swans")


def passage(i: int) -> str:
    """English prose of about 800 characters, different for each i."""
    animal = ANIMALS[i % len(ANIMALS)]
    return (f"The river valley number {i} is home to many {animal}, and they live near the water all year. "
            f"In the spring the {animal} build their homes from reeds and mud that the floods leave behind. ") * 4


def document(i: int) -> str:
    """English prose of about 2,300 characters in paragraphs."""
    return "\n\n".join(f"Part {k} of the story {i}: the town council met on a cold morning to talk about the "
                       f"new park, and the people who came were happy with the plan for trees and paths."
                       for k in range(12))


def conversation(i: int) -> dict:
    opening = (f"Who built the old stone bridge number {i}?" if i % 2 == 0
               else f"Describe the harbour of the town number {i} in a few words.")
    turns = [("human", opening), ("gpt", passage(i)),
             ("human", f"Maria buys {i + 3} packs of 12 pencils and gives 5 of them away. How many pencils does "
                       "she have left?"),
             ("gpt", document(i)),
             ("human", f"Die Stadt {i} hat im letzten Jahr eine neue Brücke über den Fluss gebaut, und sie ist "
                       "sehr schön. Wir wollen morgen mit dem Zug nach Berlin fahren, weil die Konferenz dort ist."),
             ("gpt", "Gern.")]
    return {"id": f"c{i}_0", "conversations": [{"from": who, "value": text} for who, text in turns]}


def write_corpus(path, conversations):
    path.write_text(json.dumps(conversations, indent=1), encoding="utf-8")
    return path


def corpus(tmp_path, count: int = 30):
    return write_corpus(tmp_path / "sharegpt.json", [conversation(i) for i in range(count)])


def by_kind(pairs):
    kinds: dict[str, list[tuple[str, str]]] = {kind: [] for kind in KINDS}
    for pid, messages in pairs:
        assert len(messages) == 1 and messages[0]["role"] == "user"
        kinds[kind_of(pid)].append((pid, messages[0]["content"]))
    return kinds


def test_each_kind_has_its_format_and_length_bounds(tmp_path):
    kinds = by_kind(sharegpt_task_prompts("all", path=corpus(tmp_path)))
    assert all(kinds[kind] for kind in KINDS), {kind: len(v) for kind, v in kinds.items()}
    for _, text in kinds["chat"]:
        assert 10 <= len(text) <= 300 and text.startswith("Describe the harbour")
    for _, text in kinds["translation"]:
        sentence = text.removeprefix("Translate German to English: ")
        assert sentence != text and 40 <= len(sentence) <= 250 and " , " in sentence + " , "
        assert sentence.endswith(" .") and "\n" not in sentence
    for pid, text in kinds["summarization"]:
        doc = text.removeprefix("Summarize: ")
        assert doc == one_line(document(int(pid.split(":")[2][1:-2]))) and 1500 <= len(doc) <= 4000
    for _, text in kinds["qa"]:
        assert 10 <= len(text) <= 100 and text.endswith("?") and text.startswith("Who built")
    for _, text in kinds["math_reasoning"]:
        assert text.startswith("Maria buys") and is_word_problem(text)
    for pid, text in kinds["rag"]:
        *passages, question = text.split("\n")
        i = int(pid.split(":")[2][1:-2])
        assert 2 <= len(passages) <= 4 and 2000 <= len(text) <= 4000
        assert question == f"Who built the old stone bridge number {i}?" and one_line(passage(i)) in passages
        assert len(set(passages)) == len(passages)


def test_split_is_by_conversation_and_held_out_text_never_reaches_train(tmp_path):
    conversations = [conversation(i) for i in range(60)]
    heldout_ids = [c["id"] for c in conversations if split_of(c["id"], FRACTION) == "heldout"]
    assert heldout_ids
    copy = dict(conversations[[c["id"] for c in conversations].index(heldout_ids[0])], id="copy_0")
    assert split_of("copy_0", FRACTION) == "train"  # a train conversation repeating a held-out one's text
    path = write_corpus(tmp_path / "s.json", conversations + [copy])
    train = sharegpt_task_prompts("train", path=path, heldout_fraction=FRACTION)
    heldout = sharegpt_task_prompts("heldout", path=path, heldout_fraction=FRACTION)
    assert train and heldout
    assert {pid.split(":")[2] for pid, _ in heldout} <= set(heldout_ids)
    assert all(split_of(pid.split(":")[2], FRACTION) == "train" for pid, _ in train)
    heldout_numbers = {int(cid[1:-2]) for cid in heldout_ids}
    train_numbers = set(range(60)) - heldout_numbers
    for pairs, foreign in ((train, heldout_numbers), (heldout, train_numbers)):
        texts = [m[0]["content"] for _, m in pairs]
        for i in foreign:  # no passage, document, question or sentence of the other split's conversations
            marks = (one_line(passage(i)), f"story {i}:", f"bridge number {i}?", f"Stadt {i} ", f"buys {i + 3} ")
            assert not any(mark in text for mark in marks for text in texts), i


def test_same_prompts_on_every_run_and_a_balanced_mix_under_a_limit(tmp_path):
    path = corpus(tmp_path)
    first = sharegpt_task_prompts("all", path=path)
    assert first == sharegpt_task_prompts("all", path=path)
    assert first != sharegpt_task_prompts("all", seed=1, path=path)
    assert sorted(first) == sorted(sharegpt_task_prompts("all", path=path)) and len({p for p, _ in first}) == len(first)
    assert [kind_of(pid) for pid, _ in first[: len(KINDS)]] == list(KINDS)
    counts = Counter(kind_of(pid) for pid, _ in first)
    smallest = min(counts.values())
    for limit in (len(KINDS) * smallest, 7):
        mixed = Counter(kind_of(pid) for pid, _ in first[:limit])
        assert max(mixed.values()) - min(mixed[kind] for kind in KINDS) <= 1, mixed


def test_distill_data_reads_the_source_by_name(tmp_path, monkeypatch):
    path = corpus(tmp_path)
    monkeypatch.setattr("specdraft.corpus.sharegpt_path", lambda: path)
    extra = tmp_path / "extra.jsonl"
    extra.write_text(json.dumps({"prompt": "extra"}) + "\n")
    everything = sharegpt_task_prompts("all", path=path)
    assert load_prompt_sources("sharegpt-tasks", split="all", limit=7) == everything[:7]
    pooled = load_prompt_sources(f"sharegpt-tasks,{extra}", split="all")
    assert pooled[:-1] == everything and pooled[-1] == ("extra.jsonl:0", [{"role": "user", "content": "extra"}])


def test_detectors():
    assert is_word_problem("Tom has 3 boxes with 12 apples each. He eats 5. How many apples are left?")
    assert not is_word_problem("Write a python function that sums 3 and 4. How many lines does it need?")
    assert not is_word_problem("Write an article of 500 words with 3 headings about the total cost of a house?")
    assert is_short_question("Who painted the ceiling of the Sistine Chapel?", opening=False)
    assert not is_short_question("Can you explain that again in 2 lines?", opening=False)
    assert is_short_question("Can you explain rainbows?", opening=True)
    assert not is_short_question("Explain rainbows.", opening=True)
    assert german_sentences("Wir fahren morgen mit dem Zug nach Berlin, weil die Konferenz dort ist. Ja.") == [
        "Wir fahren morgen mit dem Zug nach Berlin , weil die Konferenz dort ist ."]
    assert german_sentences("We go to Berlin by train tomorrow because the conference is there.") == []
