"""End to end through the CLI on tiny random models: records, summary.json's exact shape, summary.md, plots,
resume after a kill, config mismatch, sweeps, and one-line errors."""

import json

import pytest

from specdraft.bench.methods import BuildContext, build_methods, parse_methods
from specdraft.bench.records import read_records
from specdraft.cli import main
from specdraft.errors import SpecdraftError
from toys import save_tiny_checkpoint

REQUIRED = {"block_efficiency", "acceptance_rate", "tokens_per_second", "speedup", "mbsu", "greedy_equal",
            "num_draft_tokens", "n"}
QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["w1 w2 w3 w1 w2", "w4 w5 w4 w5"]},
    {"question_id": 2, "category": "translation", "turns": ["w7 w8 w9 w7 w8"]},
    {"question_id": 3, "category": "qa", "turns": ["w10 w11 w12"]},
    {"question_id": 4, "category": "rag", "turns": ["w13 w14 w13 w14"]},
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    questions = root / "q.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return {"target": str(save_tiny_checkpoint(root / "target", seed=0)),
            "draft": str(save_tiny_checkpoint(root / "draft", seed=1, layers=1)), "questions": str(questions)}


def _bench(files, out, *extra, methods="ar,prompt-lookup"):
    return main(["bench", "--target", files["target"], "--questions", files["questions"], "--out", str(out),
                 "--methods", methods, "--dtype", "float32", "--max-new-tokens", "8", *extra])


def _answers(out, method_file):
    return read_records(out / "answers" / method_file)


@pytest.fixture(scope="module")
def full_run(files, tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    methods = f"ar,draft:{files['draft']},prompt-lookup,hf,hf-assisted:{files['draft']}"
    assert _bench(files, out, "--num-draft-tokens", "3", "--speculation", "fixed", methods=methods) == 0
    return out, json.loads((out / "summary.json").read_text())


def test_summary_json_has_the_exact_shape(files, full_run):
    _, summary = full_run
    assert set(summary) == {"setup", "methods"}
    names = ["ar", f"draft:{files['draft']}", "prompt-lookup", "hf", f"hf-assisted:{files['draft']}"]
    assert list(summary["methods"]) == names
    for m in summary["methods"].values():
        assert set(m) == {"overall", "subtasks"}
        assert list(m["subtasks"]) == ["mt_bench", "translation", "qa", "rag"]
        for metrics in [m["overall"], *m["subtasks"].values()]:
            assert REQUIRED <= set(metrics)
    setup = summary["setup"]
    assert setup["dtype"] == "float32" and setup["target"] == files["target"] and setup["max_new_tokens"] == 8
    assert setup["num_draft_tokens"] == 3 and setup["repeats"] == 1 and setup["sampling"]["greedy"] is True
    assert {"torch", "transformers", "specdraft"} <= set(setup["versions"])
    assert {"cpu", "threads", "isa"} <= set(setup["hardware"])
    assert setup["speculation"] == ["fixed"] and setup["cost_curve"]["sizes"][0] == 1  # the machine's costs


def test_adaptive_and_fixed_run_side_by_side(files, tmp_path):
    out = tmp_path / "both"
    assert _bench(files, out, "--speculation", "adaptive,fixed", "--categories", "writing",
                  methods="prompt-lookup") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["methods"]) == ["ar", "prompt-lookup", "prompt-lookup+fixed"]
    assert all(m["overall"]["greedy_equal"] is True for m in summary["methods"].values())


def test_methods_measure_what_they_can(files, full_run):
    _, summary = full_run
    overall = {name.split(":")[0]: m["overall"] for name, m in summary["methods"].items()}
    assert all(m["greedy_equal"] is True for m in overall.values())  # fp32: every method equals ar
    assert all(m["n"] == 4 for m in overall.values())
    assert overall["ar"]["block_efficiency"] == 1.0 and overall["ar"]["speedup"] == 1.0
    assert overall["hf"]["block_efficiency"] == 1.0  # one counted target forward per token
    assert overall["hf-assisted"]["block_efficiency"] >= 1.0 and overall["hf-assisted"]["acceptance_rate"] is None
    for name in ("draft", "prompt-lookup", "hf-assisted"):
        assert overall[name]["num_draft_tokens"] == 3
    assert 0 < overall["draft"]["mbsu_param_ratio"] < overall["draft"]["block_efficiency"]
    assert overall["prompt-lookup"]["mbsu_param_ratio"] == overall["prompt-lookup"]["block_efficiency"]  # c = 0
    assert overall["draft"]["acceptance_rate"] is not None and overall["draft"]["mbsu"] is not None
    assert all(m["tokens_per_second"] > 0 and m["speedup"] > 0 for m in overall.values())


def test_records_are_spec_bench_answers(full_run):
    out, _ = full_run
    records = {r["question_id"]: r for r in _answers(out, "ar.jsonl")}
    assert sorted(records) == [1, 2, 3, 4]
    two_turns = records[1]
    assert set(two_turns) >= {"question_id", "category", "subtask", "answer_id", "model_id", "tstamp", "choices"}
    assert (two_turns["category"], two_turns["subtask"], two_turns["model_id"]) == ("writing", "mt_bench", "ar")
    choice = two_turns["choices"][0]
    for key in ("turns", "new_tokens", "wall_time", "decoding_steps", "token_ids", "draft_seconds", "verify_seconds"):
        assert len(choice[key]) == 2, key
    assert sum(choice["accept_lengths"]) == sum(choice["new_tokens"]) == sum(map(len, choice["token_ids"]))
    assert len(records[2]["choices"][0]["turns"]) == 1
    (hf,) = [r for r in _answers(out, "hf.jsonl") if r["question_id"] == 1]
    assert hf["choices"][0]["accept_lengths"] is None and len(hf["choices"][0]["decoding_steps"]) == 2


def test_report_files_and_report_only(files, full_run, capsys):
    out, summary = full_run
    for png in ("speedup_by_subtask.png", "accept_lengths.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "block_efficiency_vs_num_draft_tokens.png").exists()  # no sweep
    markdown = (out / "summary.md").read_text()
    assert "## Overall" in markdown and "| prompt-lookup | 3 | 4 |" in markdown
    (out / "summary.json").unlink()
    capsys.readouterr()
    assert main(["bench", "--report-only", "--out", str(out)]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert again["methods"].keys() == summary["methods"].keys()
    assert again["methods"]["ar"]["overall"] == summary["methods"]["ar"]["overall"]
    assert "| method | γ | n |" in capsys.readouterr().out


def test_resume_after_a_kill_mid_write(files, tmp_path):
    out = tmp_path / "run"
    assert _bench(files, out) == 0
    path = out / "answers" / "prompt-lookup.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    kept = {r["question_id"]: r["answer_id"] for r in map(json.loads, lines[:-1])}
    path.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # killed in the middle of a record
    assert _bench(files, out) == 0
    records = [json.loads(line) for line in path.read_text().splitlines()]  # every line parses
    assert sorted(r["question_id"] for r in records) == [1, 2, 3, 4]  # complete, no duplicate
    assert {r["question_id"]: r["answer_id"] for r in records if r["question_id"] in kept} == kept  # not redone
    assert len(_answers(out, "ar.jsonl")) == 4


def test_config_mismatch_on_resume(files, tmp_path, capsys):
    out = tmp_path / "run"
    assert _bench(files, out, "--per-category", "1", "--categories", "qa,rag") == 0
    capsys.readouterr()
    assert _bench(files, out, "--per-category", "1", "--categories", "qa,rag", "--max-new-tokens", "6") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specdraft: error:") and "max_new_tokens: 8 -> 6" in err and "\n" not in err
    assert _bench(files, out, "--categories", "qa", "--max-new-tokens", "6", "--overwrite") == 0
    assert [r["question_id"] for r in _answers(out, "ar.jsonl")] == [3]
    assert all(r["choices"][0]["new_tokens"][0] <= 6 for r in _answers(out, "ar.jsonl"))


def test_sweep_sampling_and_repeats(files, tmp_path):
    out = tmp_path / "sweep"
    assert _bench(files, out, "--sweep", "num_draft_tokens=1,2", "--temperature", "1.0", "--repeats", "2",
                  "--categories", "mt_bench,qa") == 0
    methods = json.loads((out / "summary.json").read_text())["methods"]
    assert list(methods) == ["ar", "prompt-lookup@γ=1", "prompt-lookup@γ=2"]
    best = {methods[n]["overall"]["best_num_draft_tokens"] for n in ("prompt-lookup@γ=1", "prompt-lookup@γ=2")}
    assert len(best) == 1 and best <= {1, 2}
    assert all(m["overall"]["greedy_equal"] is None for m in methods.values())  # sampling
    assert [methods[n]["overall"]["num_draft_tokens"] for n in list(methods)[1:]] == [1, 2]
    assert all(m["overall"]["n"] == 2 and m["overall"]["n_records"] == 4 for m in methods.values())
    assert (out / "block_efficiency_vs_num_draft_tokens.png").is_file()


@pytest.mark.parametrize("extra, message", [
    (["--methods", "ar,medusa-2"], "unknown method 'medusa-2'"),
    (["--methods", "ar,medusa"], "medusa needs --drafter-option heads=PATH"),
    (["--methods", "draft"], "needs a draft model"),
    (["--methods", "hf:x"], "takes no argument"),
    (["--questions", "/nonexistent/q.jsonl"], "question file not found"),
    (["--categories", "poetry"], "unknown category poetry"),
    (["--sweep", "temperature=1,2"], "--sweep must look like"),
    (["--repeats", "0"], "repeats must be"),
    (["--num-draft-tokens", "0"], "num_draft_tokens must be"),
])
def test_bad_values_are_one_line_errors(files, tmp_path, capsys, extra, message):
    argv = ["bench", "--target", files["target"], "--questions", files["questions"], "--out", str(tmp_path / "o")]
    assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdraft: error:") and message in err and err.count("\n") == 1
    assert not (tmp_path / "o" / "run.json").exists()


def test_malformed_question_line_names_it(files, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(QUESTIONS[0]) + "\n" + '{"question_id": 2, "category": "qa"\n')
    assert main(["bench", "--target", files["target"], "--questions", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "line 2: not valid JSON" in capsys.readouterr().err


def test_training_free_methods_come_from_the_registry(files, monkeypatch, tmp_path):
    """A drafter added as a file of the drafters package (NAMED_DRAFTERS) is a benchmark method with no change here."""
    import sys

    import specdraft.drafters

    (tmp_path / "toy_lookup.py").write_text(
        "from specdraft.drafters.prompt_lookup import PromptLookupDrafter\n\n\n"
        "class ToyLookup(PromptLookupDrafter):\n    method = 'toy-lookup'\n")
    monkeypatch.setattr(specdraft.drafters, "__path__", [*specdraft.drafters.__path__, str(tmp_path)])
    specdraft.drafters.NAMED_DRAFTERS.refresh()
    try:
        _bench_a_registered_drafter(files)
    finally:
        sys.modules.pop("specdraft.drafters.toy_lookup", None)
        monkeypatch.undo()
        specdraft.drafters.NAMED_DRAFTERS.refresh()


def _bench_a_registered_drafter(files):
    assert parse_methods("toy-lookup") == ["ar", "toy-lookup"]
    ctx = BuildContext(None, None, files["target"], None)
    (ar, toy, opt) = build_methods(ctx, ["toy-lookup", "toy-lookup:max_ngram_size=1;min-ngram-size=1"], gammas=[2],
                                   sweep=False)
    assert (ar.name, toy.name, toy.num_draft_tokens, toy.param_ratio) == ("ar", "toy-lookup", 2, 0.0)
    assert toy.drafter.max_ngram_size == 3 and opt.drafter.max_ngram_size == 1
    with pytest.raises(SpecdraftError, match="unknown method"):
        parse_methods("other-lookup")
    with pytest.raises(SpecdraftError, match="unknown drafter option window; this drafter takes: max_ngram_size"):
        build_methods(ctx, ["toy-lookup:window=3"], gammas=[2], sweep=False)
    with pytest.raises(SpecdraftError, match="max_ngram_size='x': expected int"):
        build_methods(ctx, ["toy-lookup:max_ngram_size=x"], gammas=[2], sweep=False)



def test_hf_assisted_is_configured_for_a_fair_comparison(files):
    import torch

    from specdraft.api import load_target
    from specdraft.sequence import GenerationConfig

    target, tokenizer = load_target(files["target"], torch.float32)
    ctx = BuildContext(target, tokenizer, files["target"], torch.float32)
    low, assisted = build_methods(ctx, [f"hf-assisted:{files['draft']}"], gammas=[2, 5], sweep=True)[1:]
    assert (low.name, assisted.name) == (f"hf-assisted:{files['draft']}@γ=2", f"hf-assisted:{files['draft']}@γ=5")
    assert low.model is assisted.model and low.assistant is assisted.assistant  # built once, shared by the variants
    result = assisted.answer([1, 5, 6, 7, 5, 6], GenerationConfig(10), torch.Generator())
    config = assisted.assistant.generation_config
    assert (config.num_assistant_tokens, config.num_assistant_tokens_schedule) == (5, "constant")
    assert config.assistant_confidence_threshold == 0
    assert len(result.token_ids) == 10 and 1 <= result.decoding_steps <= 10
    assert 0 < assisted.param_ratio < 1


def test_each_specdraft_method_has_its_own_prefix_cache_emptied_after_the_warm_up():
    from specdraft.bench.questions import Question
    from specdraft.bench.runner import warm_up
    from specdraft.decoding import PrefixCache
    from specdraft.models.native_llama import NativeLlama
    from specdraft.models.quantized_llama import QuantizedLlama
    from specdraft.sequence import GenerationConfig
    from toys import tiny_llama, tiny_tokenizer

    target = QuantizedLlama.from_dense(NativeLlama.from_hf(tiny_llama(0)), "int4")
    tokenizer = tiny_tokenizer()
    context = BuildContext(target, tokenizer, "tiny", None)
    methods = build_methods(context, ["ar", "prompt-lookup"], [2], False)
    kept = [m.prefix_cache for m in methods]
    assert all(isinstance(k, PrefixCache) for k in kept) and kept[0] is not kept[1]
    question = Question(1, "qa", ("w1 w2 w3",))
    warm_up(methods, tokenizer, question, GenerationConfig(4))
    assert all(m.prefix_cache is not k and m.prefix_cache.cache is None for m, k in zip(methods, kept, strict=True))
    assert kept[0].cache is not None  # the warm-up did keep its prompt: the run does not read it
    off = BuildContext(target, tokenizer, "tiny", None, prefix_cache=False)
    assert build_methods(off, ["ar"], [2], False)[0].prefix_cache is None
