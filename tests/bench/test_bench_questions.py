"""Question files, subtasks, selection, multi-turn prompts, and the answer-record files (resume, repair)."""

import json
from pathlib import Path

import pytest

from specdraft.bench.methods import TurnResult
from specdraft.bench.questions import (
    SPEC_BENCH_SUBTASKS,
    Question,
    builtin_questions,
    conversation_ids,
    load_questions,
    select_questions,
    subtask_of,
)
from specdraft.bench.records import check_out, method_filename, read_records
from specdraft.bench.runner import answer_question, schedule
from specdraft.errors import SpecdraftError
from toys import tiny_tokenizer

SPEC_BENCH = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "spec_bench" / "question.jsonl"


@pytest.mark.parametrize("category, subtask", [
    ("writing", "mt_bench"), ("roleplay", "mt_bench"), ("reasoning", "mt_bench"), ("math", "mt_bench"),
    ("coding", "mt_bench"), ("extraction", "mt_bench"), ("stem", "mt_bench"), ("humanities", "mt_bench"),
    ("translation", "translation"), ("summarization", "summarization"), ("qa", "qa"),
    ("math_reasoning", "math_reasoning"), ("rag", "rag"),
])
def test_category_to_subtask(category, subtask):
    assert subtask_of(category) == subtask


def test_unknown_category():
    with pytest.raises(SpecdraftError, match="unknown category 'poetry'"):
        subtask_of("poetry")


def _write(tmp_path, lines):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


GOOD = {"question_id": 1, "category": "qa", "turns": ["w1 w2"]}


@pytest.mark.parametrize("bad, message", [
    ("{not json", "line 2: not valid JSON"),
    ({"question_id": 2, "category": "qa"}, "line 2: missing turns"),
    ({"question_id": 2, "category": "qa", "turns": []}, "line 2: turns must be"),
    ({"question_id": 2, "category": "qa", "turns": ["ok", 3]}, "line 2: turns must be"),
    ({"question_id": 2, "category": "poetry", "turns": ["x"]}, "line 2: unknown category 'poetry'"),
    ({"question_id": 1, "category": "qa", "turns": ["x"]}, "line 2: duplicate question_id 1"),
    ("[1, 2]", "line 2: expected a JSON object"),
])
def test_malformed_question_lines_name_the_line(tmp_path, bad, message):
    with pytest.raises(SpecdraftError, match=message):
        load_questions(_write(tmp_path, [GOOD, bad]))


def test_a_line_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b'\n{"turns": ["\xe9"]}\n')
    with pytest.raises(SpecdraftError, match=r"q\.jsonl:2: not UTF-8 text \(byte 0xe9 at column 13\)"):
        load_questions(path)


def test_missing_file_and_reference_and_blank_lines(tmp_path):
    with pytest.raises(SpecdraftError, match="question file not found"):
        load_questions(tmp_path / "nope.jsonl")
    path = _write(tmp_path, [GOOD, "", {"question_id": "b", "category": "math", "turns": ["a", "b"],
                                        "reference": ["r1", "r2"]}])
    questions = load_questions(path)
    assert questions[1] == Question("b", "math", ("a", "b"), ("r1", "r2"))
    assert questions[1].subtask == "mt_bench"


def test_builtin_suite_covers_every_subtask():
    questions = load_questions("builtin")
    assert questions == builtin_questions()
    assert {q.subtask for q in questions} == set(SPEC_BENCH_SUBTASKS)
    assert [q.question_id for q in questions] == list(range(1, len(questions) + 1))


def test_selection_is_first_n_per_subtask_in_file_order():
    qs = [Question(i, c, ("x",)) for i, c in enumerate(["writing", "qa", "coding", "qa", "rag", "qa"])]
    assert [q.question_id for q in select_questions(qs, per_category=1)] == [0, 1, 4]
    assert [q.question_id for q in select_questions(qs, per_category=2)] == [0, 1, 2, 3, 4]
    assert [q.question_id for q in select_questions(qs, ["qa", "mt_bench"], 2)] == [0, 1, 2, 3]
    assert [q.question_id for q in select_questions(qs, ["coding"])] == [2]  # an original category works too
    with pytest.raises(SpecdraftError, match="unknown category nope"):
        select_questions(qs, ["nope"])
    with pytest.raises(SpecdraftError, match="no question left"):
        select_questions(qs, ["translation"])


@pytest.mark.skipif(not SPEC_BENCH.is_file(), reason="Spec-Bench questions not present")
def test_spec_bench_file_parses_into_six_subtasks():
    questions = load_questions(SPEC_BENCH)
    assert len(questions) == 480
    per = {s: sum(q.subtask == s for q in questions) for s in SPEC_BENCH_SUBTASKS}
    assert per == dict.fromkeys(SPEC_BENCH_SUBTASKS, 80)
    assert all(len(q.turns) == 2 for q in questions if q.subtask == "mt_bench")


class ScriptedMethod:
    """A fake method answering each turn with fixed words, remembering the prompts it saw."""

    name = base = "scripted"
    num_draft_tokens = param_ratio = engine = None

    def __init__(self, tokenizer, answers):
        self.answers = [tokenizer.convert_tokens_to_ids(a.split()) for a in answers]
        self.prompts = []

    def answer(self, prompt_ids, config, generator):
        self.prompts.append(list(prompt_ids))
        return TurnResult(token_ids=self.answers[len(self.prompts) - 1], wall_time=0.5, decoding_steps=3)


def test_multi_turn_sees_its_own_previous_answer():
    tokenizer = tiny_tokenizer()
    method = ScriptedMethod(tokenizer, ["w40 w41", "w42"])
    question = Question(7, "writing", ("w1 w2", "w3"))
    record = answer_question(question, method, repeat=0, tokenizer=tokenizer, config=None, seed=0)
    first, second = (tokenizer.decode(p) for p in method.prompts)
    # the tiny word-level vocabulary has no "user"/"assistant": they become <unk>
    assert first == "<s> <unk> w1 w2 </s> <s> <unk>"
    assert second == "<s> <unk> w1 w2 </s> <s> <unk> w40 w41 </s> <s> <unk> w3 </s> <s> <unk>"
    assert method.prompts[0] == conversation_ids(tokenizer, question.turns, [])
    choice = record["choices"][0]
    assert choice["turns"] == ["w40 w41", "w42"] and choice["new_tokens"] == [2, 1]
    assert choice["decoding_steps"] == [3, 3] and choice["wall_time"] == [0.5, 0.5]
    assert choice["accept_lengths"] is None and choice["draft_seconds"] is None  # not measured by this method
    assert (record["question_id"], record["category"], record["subtask"], record["model_id"]) == \
        (7, "writing", "mt_bench", "scripted")


class Named:
    def __init__(self, name):
        self.name = name


def test_schedule_interleaves_rotates_and_skips_done():
    methods = [Named("ar"), Named("a"), Named("b")]
    qs = [Question(i, "qa", ("x",)) for i in range(3)]
    todo = schedule(qs, methods, repeats=1, done=set())
    assert [(q.question_id, m.name) for q, m, _ in todo] == [
        (0, "ar"), (0, "a"), (0, "b"), (1, "a"), (1, "b"), (1, "ar"), (2, "b"), (2, "ar"), (2, "a")]
    todo = schedule(qs[:1], methods, repeats=2, done={(0, "a", 0), (0, "ar", 1)})
    assert [(m.name, r) for _, m, r in todo] == [("ar", 0), ("b", 0), ("a", 1), ("b", 1)]


def test_cut_last_line_is_ignored_then_repaired(tmp_path):
    path = tmp_path / "m.jsonl"
    full = [json.dumps({"question_id": i, "x": "y" * 10}) for i in range(3)]
    path.write_text(full[0] + "\n" + full[1] + "\n" + full[2][:15])
    assert [r["question_id"] for r in read_records(path)] == [0, 1]
    assert path.read_text().endswith(full[2][:15])  # reading alone changes nothing
    assert [r["question_id"] for r in read_records(path, repair=True)] == [0, 1]
    assert path.read_text() == full[0] + "\n" + full[1] + "\n"
    path.write_text(full[0] + "\n" + full[1])  # complete, but killed before its newline
    assert len(read_records(path, repair=True)) == 2 and path.read_text().endswith("}\n")
    path.write_text(full[0] + "\n{cut\n" + full[1] + "\n")
    with pytest.raises(SpecdraftError, match="line 2: corrupt answer record"):
        read_records(path)


def test_method_filenames_are_safe_and_distinct():
    names = ["ar", "prompt-lookup", "draft:/a/b", "draft:/a_b", "prompt-lookup@γ=3", "hf-assisted:../x"]
    files = [method_filename(n) for n in names]
    assert files[:2] == ["ar.jsonl", "prompt-lookup.jsonl"]
    assert len(set(files)) == len(files)
    assert all("/" not in f and ":" not in f for f in files)


def test_config_mismatch_is_an_error(tmp_path):
    info = {"config": {"max_new_tokens": 8}, "questions_sha256": "abc"}
    (tmp_path / "run.json").write_text(json.dumps(info))
    check_out(tmp_path, info, overwrite=False)  # same run: resumable
    with pytest.raises(SpecdraftError, match=r"different config \(max_new_tokens: 8 -> 9\)"):
        check_out(tmp_path, {**info, "config": {"max_new_tokens": 9}}, overwrite=False)
    with pytest.raises(SpecdraftError, match="questions_sha256"):
        check_out(tmp_path, {**info, "questions_sha256": "def"}, overwrite=False)
    check_out(tmp_path, {**info, "config": {"max_new_tokens": 9}}, overwrite=True)

def test_sharegpt_heldout_questions_are_the_heldout_split():
    from specdraft.bench.questions import SHAREGPT_HELDOUT
    from specdraft.corpus import sharegpt_prompts

    questions = load_questions(SHAREGPT_HELDOUT)
    heldout = sharegpt_prompts(split="heldout")
    assert [q.turns[0] for q in questions] == [r.text for r in heldout]
    assert {q.subtask for q in questions} == {"sharegpt"}
    train = {r.text for r in sharegpt_prompts(split="train")}
    assert not train & {q.turns[0] for q in questions}
    assert len(select_questions(questions, ["sharegpt"], 5)) == 5
