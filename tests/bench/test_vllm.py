"""The vLLM methods without vLLM: method specs, the speculative configs and folder checks, the parsing of vLLM's
per-request spec-decode metrics and counters into the records, the summary's engine counters, and ``bench``
writing vLLM rows beside specdraft's through a stand-in engine (tests/fake_vllm).
tests/engines/test_vllm_exports.py runs the real one."""

import json

import pytest

from fake_vllm import fake_vllm_python
from specdraft.bench.methods import TurnResult, parse_methods
from specdraft.bench.report import engine_counters
from specdraft.bench.vllm import check_draft_folder, sampling_fields, speculative_config, turn_result
from specdraft.cli import main
from specdraft.errors import SpecdraftError
from specdraft.sampling import SamplingConfig
from toys import save_tiny_checkpoint


def test_method_specs_parse():
    specs = "vllm,vllm-ngram,vllm-draft:/x/hf,vllm-eagle3:/x/e3"
    assert parse_methods(specs) == ["ar", *specs.split(",")]
    assert parse_methods("vllm-ngram:prompt_lookup_max=4") == ["ar", "vllm-ngram:prompt_lookup_max=4"]
    with pytest.raises(SpecdraftError, match="needs a draft model"):
        parse_methods("vllm-eagle3")
    with pytest.raises(SpecdraftError, match="takes no argument"):
        parse_methods("vllm:/x")


def test_speculative_configs_and_folder_checks(tmp_path):
    assert speculative_config("vllm", None, None) is None
    assert speculative_config("vllm-ngram", "prompt_lookup_max=4", 3) == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    with pytest.raises(SpecdraftError, match="prompt_lookup_max=N"):
        speculative_config("vllm-ngram", "n=2", 3)
    with pytest.raises(SpecdraftError, match="--format hf"):
        speculative_config("vllm-draft", str(tmp_path / "missing"), 4)
    heads = tmp_path / "e3"
    heads.mkdir()
    (heads / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    assert speculative_config("vllm-eagle3", str(heads), 3) == {"method": "eagle3", "num_speculative_tokens": 3,
                                                                "model": str(heads)}
    with pytest.raises(SpecdraftError, match="not a draft model"):
        check_draft_folder("vllm-draft", str(heads))
    draft = save_tiny_checkpoint(tmp_path / "d", seed=1, layers=1)
    with pytest.raises(SpecdraftError, match="not EAGLE-3 heads"):
        check_draft_folder("vllm-eagle3", str(draft))


def test_sampling_fields():
    greedy = sampling_fields(16, (2, 7), SamplingConfig(), seed=5)
    assert greedy == {"max_tokens": 16, "stop_token_ids": [2, 7], "detokenize": False, "temperature": 0.0,
                      "top_p": 1.0, "top_k": 0, "seed": 5}
    sampled = sampling_fields(16, (2,), SamplingConfig(temperature=0.7, top_k=5, top_p=0.9), seed=5)
    assert (sampled["temperature"], sampled["top_k"], sampled["top_p"]) == (0.7, 5, 0.9)


def test_vllms_metrics_become_the_records_counts():
    """Three verify steps of γ 3 accepting 2, 0 and 3 drafts, one plain step, and the prefill's token: 11 tokens."""
    spec = {"num_accepted_draft_tokens": 5, "num_draft_tokens": 9, "per_step_accepted": [2, 0, 3],
            "per_step_drafted": [3, 3, 3]}
    counters = {"vllm:spec_decode_num_drafts": 3, "vllm:spec_decode_num_draft_tokens": 9,
                "vllm:spec_decode_num_accepted_tokens": 5, "vllm:spec_decode_num_accepted_tokens_per_pos": [2, 2, 1],
                "vllm:other": 1}
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 2]
    answer = {"outputs": [[{"ids": tokens, "finish_reason": "stop", "prefill_seconds": 0.02,
                            "spec_decode": spec}]], "counters": counters}
    turn = turn_result(answer, 0.5, (2,), True, TurnResult)
    assert turn.token_ids == tokens and turn.finish_reason == "eos" and turn.prefill_seconds == 0.02
    assert (turn.draft_tokens_proposed, turn.draft_tokens_accepted, turn.decoding_steps) == (9, 5, 6)
    assert turn.accept_lengths == [1, 1, 1, 3, 1, 4]  # the prefill's and the plain step's tokens first
    assert sum(turn.accept_lengths) == len(tokens) and len(turn.accept_lengths) == turn.decoding_steps
    assert turn.accepted_per_position == [2, 2, 1] and turn.reached_per_position == [3, 2, 2]
    assert turn.engine_counters == {"drafts": 3, "draft_tokens": 9, "accepted_tokens": 5,
                                    "accepted_tokens_per_pos": [2, 2, 1]}
    plain = turn_result({"outputs": [[{"ids": [5, 6], "finish_reason": "length"}]], "counters": {}}, 0.1, (2,),
                        False, TurnResult)
    assert plain.token_ids == [5, 6] and plain.finish_reason == "length" and plain.decoding_steps == 2
    assert plain.draft_tokens_proposed is None and plain.engine_counters is None


def test_the_summary_sums_engine_counters():
    def record(*turns):
        return {"choices": [{"engine_counters": list(turns)}]}

    records = [record({"draft_tokens": 8, "accepted_tokens": 3, "accepted_tokens_per_pos": [2, 1]}),
               record({"draft_tokens": 4, "accepted_tokens": 1, "accepted_tokens_per_pos": [1, 0, 0]}, None)]
    assert engine_counters(records) == {"draft_tokens": 12, "accepted_tokens": 4, "accepted_tokens_per_pos": [3, 1, 0]}
    assert engine_counters([{"choices": [{"engine_counters": None}]}]) is None


def test_bench_writes_vllm_rows_beside_specdrafts(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_VLLM_PYTHON", str(fake_vllm_python(tmp_path / "venv")))
    target = save_tiny_checkpoint(tmp_path / "target", seed=0)
    draft = save_tiny_checkpoint(tmp_path / "draft", seed=1, layers=1)
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["w1 w2 w3", "w4 w5"]}) + "\n")
    out = tmp_path / "run"
    code = main(["bench", "--target", str(target), "--questions", str(questions), "--out", str(out), "--methods",
                 f"ar,vllm,vllm-draft:{draft}", "--dtype", "float32", "--max-new-tokens", "6",
                 "--num-draft-tokens", "2"])
    assert code == 0
    methods = json.loads((out / "summary.json").read_text())["methods"]
    assert list(methods) == ["ar", "vllm", f"vllm-draft:{draft}"]
    plain, drafted = methods["vllm"]["overall"], methods[f"vllm-draft:{draft}"]["overall"]
    assert plain["greedy_equal"] is True and plain["engine_counters"] is None  # transformers underneath, fp32
    assert drafted["num_draft_tokens"] == 2 and drafted["engine_counters"]["draft_tokens"] == 8  # 2 turns, 2 steps
    assert drafted["engine_acceptance_rate"] == pytest.approx(0.5) == drafted["acceptance_rate"]
    record = json.loads(next((out / "answers").glob("vllm-draft*.jsonl")).read_text().splitlines()[0])
    assert record["choices"][0]["engine_counters"][0]["drafts"] == 2
