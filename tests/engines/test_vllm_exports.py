"""specdraft's exports inside the real vLLM (``make engines`` builds it; ``make test-engines`` runs these; skipped
when its environment is not built). In float32, greedy, γ 3, 128 tokens, on the first 8 held-out ShareGPT prompts:

- the ``--format hf`` export (vLLM's ``draft_model``) and the ``--format eagle3`` export (``eagle3``) load and
  decode, and their text equals vLLM's plain decoding token for token;
- vLLM accepts their drafts within 5 points of specdraft's acceptance with the same drafter and γ (specdraft's
  drafter with the options that make it draft as vLLM does: full vocabulary, no confidence cut-off, no prompt
  lookup; the EAGLE-3 heads as a chain), by vLLM's own counters;
- the ``--format speculators`` export is refused by vLLM 0.32 (``ValueError: Must provide
  transformer_layer_config``: its speculators loader reads the layout of EAGLE-family heads, and behind that check
  it knows the algorithms eagle3, peagle, dflash, dflash2 and dspark only, not an independent draft model); the
  exact error is asserted, so a vLLM that learns the format fails this test and it can become a positive one.

Every vLLM engine here starts eagerly (``enforce_eager``: no compilation, which costs minutes per start on 2 CPU
cores) unless ``$SPECDRAFT_VLLM_ARGS`` says otherwise; ``bench`` measures the compiled engines."""

import json
import os

import pytest

from specdraft.errors import SpecdraftError
from specdraft.export import ExportConfig, export
from specdraft.models.registry import SMOLLM2, SMOLLM2_DRAFTER

pytestmark = pytest.mark.engines
EAGLE3_HEADS = "smollm2-135m-instruct-eagle3"
PLAIN = "draft_vocab=0;confidence_threshold=0;prompt_lookup=0;prompt_lookup_alone=0"  # vLLM's kind of draft
GAMMA = 3
SPECULATORS_REFUSAL = "ValueError: Must provide transformer_layer_config"  # vLLM 0.32's exact error


@pytest.fixture(scope="module", autouse=True)
def vllm_environment():
    from specdraft.engines.vllm import vllm_python

    try:
        vllm_python()
    except SpecdraftError as exc:
        pytest.skip(str(exc))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDRAFT_VLLM_ARGS", os.environ.get("SPECDRAFT_VLLM_ARGS", '{"enforce_eager": true}'))
        yield


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    return {"hf": export(ExportConfig(SMOLLM2_DRAFTER, "hf", str(root / "hf"))),
            "eagle3": export(ExportConfig(EAGLE3_HEADS, "eagle3", str(root / "eagle3"))),
            "speculators": export(ExportConfig(SMOLLM2_DRAFTER, "speculators", str(root / "speculators"),
                                               num_draft_tokens=GAMMA))}


@pytest.fixture(scope="module")
def run(exports, tmp_path_factory):
    """One interleaved bench run: specdraft's plain decoding and both drafters, vLLM's plain decoding and both
    exports."""
    from specdraft.bench.config import BenchConfig
    from specdraft.bench.runner import run_bench

    methods = {"draft": f"draft:{SMOLLM2_DRAFTER};{PLAIN}", "eagle3": f"eagle3:heads={EAGLE3_HEADS};top_k=1",
               "vllm": "vllm", "vllm-draft": f"vllm-draft:{exports['hf']}",
               "vllm-eagle3": f"vllm-eagle3:{exports['eagle3']}"}
    out = tmp_path_factory.mktemp("bench") / "run"
    config = BenchConfig(out=str(out), target=SMOLLM2, methods=tuple(methods.values()), questions="sharegpt-heldout",
                         per_category=8, max_new_tokens=128, num_draft_tokens=GAMMA, dtype="float32",
                         speculation=("fixed",))
    summary = run_bench(config, progress=False, plots=False)
    records = {}
    for path in (out / "answers").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            records.setdefault(record["model_id"], {})[record["question_id"]] = record["choices"][0]["token_ids"]
    return methods, summary["methods"], records


@pytest.mark.parametrize("kind", ["vllm-draft", "vllm-eagle3"])
def test_the_export_loads_decodes_and_equals_vllms_plain_greedy_text(run, kind):
    methods, summary, records = run
    row = summary[methods[kind]]["overall"]
    assert row["n"] == 8 and row["new_tokens"] > 8 * 16 and row["num_draft_tokens"] == GAMMA
    counters = row["engine_counters"]
    assert counters["draft_tokens"] > 0 and counters["accepted_tokens"] > 0  # vLLM's own counters
    assert row["acceptance_rate"] == pytest.approx(row["engine_acceptance_rate"], abs=0.01)
    plain, drafted = records["vllm"], records[methods[kind]]
    assert plain.keys() == drafted.keys() and all(drafted[q] == plain[q] for q in plain)


@pytest.mark.parametrize("kind", ["draft", "eagle3"])
def test_vllm_accepts_within_5_points_of_specdraft(run, kind):
    methods, summary, _ = run
    ours, theirs = summary[methods[kind]]["overall"], summary[methods[f"vllm-{kind}"]]["overall"]
    assert ours["greedy_equal"] is True
    assert abs(ours["acceptance_rate"] - theirs["engine_acceptance_rate"]) <= 0.05, (kind, ours, theirs)


def test_vllm_refuses_the_speculators_export_of_an_independent_drafter(exports):
    """vLLM's own way to serve a speculators folder (``LLM(model=FOLDER)``, ``vllm serve FOLDER``)."""
    from specdraft.engines.vllm import EngineSettings, VllmEngine

    with pytest.raises(SpecdraftError, match=SPECULATORS_REFUSAL):
        VllmEngine(EngineSettings(model=str(exports["speculators"]), dtype="float32")).close()


def test_distill_data_from_vllm_equals_the_native_engines_in_float32(tmp_path):
    """The first 4 ShareGPT training prompts, greedy, 32 tokens, top-4: the same records, and log p within 1e-3
    where the answers agree (vLLM's raw log-probabilities are the target's own)."""
    from specdraft.training.data.distill_data import DistillDataConfig, generate_distillation_data

    def run(engine: str) -> list[dict]:
        config = DistillDataConfig(target=SMOLLM2, out=str(tmp_path / engine), limit=4, max_new_tokens=32,
                                   temperature=0.0, top_logprobs=4, dtype="float32", engine=engine)
        assert generate_distillation_data(config, progress=False)["complete"]
        return [json.loads(line) for line in (tmp_path / engine / "shard-00000.jsonl").read_text().splitlines()]

    native, vllm = run("native"), run("vllm")
    assert [sorted(r) for r in vllm] == [sorted(r) for r in native]
    agree = 0
    for a, b in zip(vllm, native, strict=True):
        assert a["prompt_token_ids"] == b["prompt_token_ids"]
        same = 0
        while same < min(len(a["response_token_ids"]), len(b["response_token_ids"])) and \
                a["response_token_ids"][same] == b["response_token_ids"][same]:
            same += 1
        agree += a["response_token_ids"] == b["response_token_ids"]
        assert a["top_ids"][:same] == b["top_ids"][:same]
        for mine, theirs in zip(a["top_logprobs"][:same], b["top_logprobs"][:same], strict=True):
            assert max(abs(x - y) for x, y in zip(mine, theirs, strict=True)) < 1e-3
    assert agree >= 3
