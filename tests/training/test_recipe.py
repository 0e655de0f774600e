"""``train-drafter`` as a whole recipe on a tiny target: training answers and held-out greedy answers, a drafter
copied from the target's layers, two distillation phases (forward KL, then TVD++) evaluated by their exact greedy τ on
the held-out answers at every checkpoint, EAGLE-3 heads on the same data, time budgets and ``--stages``."""

import csv
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from specdraft.cli import main
from specdraft.errors import SpecdraftError
from specdraft.training.recipe import load_pipeline_file, pipeline_configs
from toys import save_tiny_checkpoint

RECIPE = """
target = "{root}/target"
device = "cpu"

[distill_data]
out = "{root}/data"
prompts = "{root}/prompts.jsonl"
max_new_tokens = 16
temperature = 0.0
batch_size = 16
shard_size = 32
dtype = "float32"
engine = "native"

[heldout_data]
out = "{root}/heldout"
prompts = "{root}/questions.jsonl"
max_new_tokens = 16
dtype = "float32"

[init_drafter]
out = "{root}/init"
layers = "0"

[[finetune]]
out = "{root}/fkl"
loss = "fkl"
steps = 30
batch_size = 8
lr = 3e-3
bf16 = false
heldout_every = 8
eval_prompts = 0
eval_num_draft_tokens = "2,3"
freeze_embeddings = true
share_embeddings = true
draft_vocab = 48
progress = false
evals = 2

[[finetune]]
out = "{root}/tvdpp"
loss = "tvdpp"
steps = 6
batch_size = 8
lr = 1e-3
bf16 = false
heldout_every = 8
eval_prompts = 0
eval_num_draft_tokens = "3"
freeze_embeddings = true
share_embeddings = true
draft_vocab = 48
progress = false

[heads]
out = "{root}/eagle3"
steps = {head_steps}
batch_size = 4
lr = 1e-2
bf16 = false
heldout_every = 8
eval_prompts = 0
options = "ttt_steps=2;draft_vocab=40"
progress = false
evals = 2
budget_s = {head_budget}
"""


def _write(root, head_steps=40, head_budget=1e6):
    (root / "recipe.toml").write_text(RECIPE.format(root=root, head_steps=head_steps, head_budget=head_budget))
    return root / "recipe.toml"


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe")
    save_tiny_checkpoint(root / "target", seed=0, layers=4, hidden=32)
    rng = random.Random(0)
    lines = [json.dumps({"prompt": " ".join(f"w{rng.randrange(60)}" for _ in range(rng.randint(1, 6)))})
             for _ in range(96)]
    (root / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    questions = [json.dumps({"turns": [" ".join(f"w{rng.randrange(60)}" for _ in range(4))]}) for _ in range(12)]
    (root / "questions.jsonl").write_text("\n".join(questions) + "\n")
    assert main(["train-drafter", "--config", str(_write(root))]) == 0
    return root


def _rows(path):
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def test_the_recipe_exports_a_drafter_and_heads_with_a_learning_curve_of_exact_tau(recipe):
    assert (recipe / "tvdpp" / "model" / "model.safetensors").is_file()
    assert (recipe / "eagle3" / "heads" / "heads.json").is_file()
    curve = _rows(recipe / "fkl" / "eval_log.csv")
    assert [int(r["step"]) for r in curve] == [15, 30]  # evals = 2: the learning curve
    for row in curve:
        assert 1.0 <= float(row["greedy_tau@2"]) <= 3.0 and 1.0 <= float(row["greedy_tau@3"]) <= 4.0
        assert 0.0 <= float(row["greedy_first_accept@3"]) <= 1.0 and "heldout_tvd" in row
    assert float(curve[-1]["greedy_first_accept@3"]) > float(curve[0]["greedy_first_accept@3"]) - 0.05
    second = json.loads((recipe / "tvdpp" / "run.json").read_text())
    assert second["sources"]["drafter"] == str(recipe / "fkl" / "model")  # the phases chain
    assert "greedy_tau@3" in _rows(recipe / "tvdpp" / "eval_log.csv")[-1]
    heads = _rows(recipe / "eagle3" / "eval_log.csv")
    assert [int(r["step"]) for r in heads] == [20, 40] and "greedy_tau@2" in heads[-1]
    held = json.loads((recipe / "heldout" / "distill_config.json").read_text())
    assert held["temperature"] == 0.0 and held["device_choice"]["device"] == "cpu"


def test_exact_tau_equals_the_tau_of_decoding_the_held_out_questions(recipe):
    """The learning curve's τ is exact: greedy speculative decoding of the held-out questions with the exported
    drafter (fp32 weights, its draft vocabulary, fixed γ) makes the same tokens per target forward."""
    from specdraft.decoding import GenerationConfig, generate
    from specdraft.drafters import load_drafter
    from specdraft.models.registry import load_target
    from specdraft.training.data.records import load_distill_records

    target, tokenizer = load_target(str(recipe / "target"))
    drafter = load_drafter(target, tokenizer, draft=str(recipe / "tvdpp" / "model"), options={"quantize": "none"})
    tokens = forwards = 0
    for record in load_distill_records(recipe / "heldout"):
        config = GenerationConfig(16, 3, speculation="fixed", eos_token_ids=(tokenizer.eos_token_id,))
        stats = generate(target, record["prompt_token_ids"], drafter, config).stats
        tokens, forwards = tokens + stats.new_tokens, forwards + stats.target_forward_calls
    logged = float(_rows(recipe / "tvdpp" / "eval_log.csv")[-1]["greedy_tau@3"])
    assert tokens / forwards == pytest.approx(logged, abs=1e-3)


def test_the_exported_drafter_drafts_on_int8_blocks_by_default_and_stays_lossless(recipe):
    """The folder ships ``quantize: int8`` (its shapes fit Q8_0 blocks): loaded by default the draft model is a
    :class:`QuantizedLlama` (``quantize=none`` keeps the dense one), and greedy speculative decoding with it gives
    plain decoding's tokens."""
    from specdraft.decoding import GenerationConfig, generate
    from specdraft.drafters import load_drafter
    from specdraft.models.quantized import available
    from specdraft.models.quantized_llama import QuantizedLlama
    from specdraft.models.registry import load_target
    from specdraft.training.data.records import load_distill_records

    options = json.loads((recipe / "tvdpp" / "model" / "drafter_options.json").read_text())
    assert options == {"draft_vocab": 48, "quantize": "int8"}
    if not available():
        pytest.skip("the int8 kernels cannot run here")
    target, tokenizer = load_target(str(recipe / "target"))
    folder = str(recipe / "tvdpp" / "model")
    drafter = load_drafter(target, tokenizer, draft=folder)
    assert isinstance(drafter.model, QuantizedLlama)
    dense = load_drafter(target, tokenizer, draft=folder, options={"quantize": "none"})
    assert not isinstance(dense.model, QuantizedLlama)
    for record in load_distill_records(recipe / "heldout")[:4]:
        config = GenerationConfig(16, 3, speculation="fixed", eos_token_ids=(tokenizer.eos_token_id,))
        plain = generate(target, record["prompt_token_ids"], None, config).token_ids
        assert generate(target, record["prompt_token_ids"], drafter, config).token_ids == plain


def test_a_rerun_reuses_every_stage_and_stages_reruns_only_those_named(recipe, capsys):
    files = [recipe / name / "manifest.json" for name in ("data", "heldout")] + [
        recipe / "init" / "model.safetensors", recipe / "fkl" / "model" / "model.safetensors",
        recipe / "tvdpp" / "model" / "model.safetensors", recipe / "eagle3" / "heads" / "heads.safetensors"]
    before = [f.stat().st_mtime_ns for f in files]
    assert main(["train-drafter", "--config", str(recipe / "recipe.toml")]) == 0
    assert [f.stat().st_mtime_ns for f in files] == before
    printed = capsys.readouterr().out.split()
    assert printed[-2:] == [str(recipe / "tvdpp" / "model"), str(recipe / "eagle3" / "heads")]
    _write(recipe, head_steps=50)
    assert main(["train-drafter", "--config", str(recipe / "recipe.toml"), "--stages", "heads", "--overwrite"]) == 0
    assert [f.stat().st_mtime_ns for f in files[:-1]] == before[:-1]
    assert "50 steps" in (recipe / "eagle3" / "heads" / "README.md").read_text()


def _linked(recipe, root):
    """A recipe folder in ``root`` sharing the module recipe's target, prompts and data."""
    for name in ("target", "prompts.jsonl", "questions.jsonl", "data", "heldout"):
        source = recipe / name
        (root / name).symlink_to(source, target_is_directory=source.is_dir())
    return root


def test_a_time_budget_lowers_the_steps_after_timing_the_first_ones(recipe, tmp_path, capsys):
    root = _linked(recipe, tmp_path)
    config = _write(root, head_steps=400, head_budget=0.001)
    assert main(["train-drafter", "--config", str(config), "--stages", "heads"]) == 0
    assert "started again" in capsys.readouterr().err
    card = (root / "eagle3" / "heads" / "README.md").read_text()
    assert "21 steps" in card  # the 20 timed steps, then the fewest that a new run may take
    assert [int(r["step"]) for r in _rows(root / "eagle3" / "eval_log.csv")] == [11, 21]


def test_a_budgeted_stage_stopped_part_way_continues_with_its_fitted_steps_and_is_reused_after(recipe, tmp_path,
                                                                                              monkeypatch):
    """A recipe killed while a stage runs the steps its budget allowed, run again, continues that run from its last
    checkpoint (not the recipe's steps from the timed ones); run once more, it reuses the finished stage."""
    import specdraft.training.recipe as recipe_module

    root = _linked(recipe, tmp_path)
    config = _write(root, head_steps=400, head_budget=0.001)
    real = recipe_module.training_stage

    def stopped(run, config, inputs, export, overwrite, command):  # the fitted run stops at its first checkpoint
        real(run, replace(config, stop_after=config.eval_every), inputs, export, overwrite, command)

    monkeypatch.setattr(recipe_module, "training_stage", stopped)
    assert main(["train-drafter", "--config", str(config), "--stages", "heads"]) == 0
    staging = root / ".eagle3.staging"
    assert [int(r["step"]) for r in _rows(staging / "eval_log.csv")] == [11]
    monkeypatch.setattr(recipe_module, "training_stage", real)
    assert main(["train-drafter", "--config", str(config), "--stages", "heads"]) == 0
    assert not staging.exists() and "21 steps" in (root / "eagle3" / "heads" / "README.md").read_text()
    assert [int(r["step"]) for r in _rows(root / "eagle3" / "eval_log.csv")] == [11, 21]
    exported = (root / "eagle3" / "heads" / "heads.safetensors").stat().st_mtime_ns
    assert main(["train-drafter", "--config", str(config), "--stages", "heads"]) == 0
    assert (root / "eagle3" / "heads" / "heads.safetensors").stat().st_mtime_ns == exported


def test_bad_recipes_are_refused_naming_the_section(recipe, capsys):
    spec = load_pipeline_file(recipe / "recipe.toml")
    with pytest.raises(SpecdraftError, match="one of \\[pretrain\\] and \\[init_drafter\\]"):
        pipeline_configs({k: v for k, v in spec.items() if k != "init_drafter"})
    with pytest.raises(SpecdraftError, match="budget_s"):
        pipeline_configs(spec | {"heads": spec["heads"] | {"budget_s": -1}})
    with pytest.raises(SpecdraftError, match="\\[finetune\\] has no setting 'colour'"):
        pipeline_configs(spec | {"finetune": [spec["finetune"][0] | {"colour": 1}]})
    assert main(["train-drafter", "--config", str(recipe / "recipe.toml"), "--stages", "pretraining"]) == 2
    assert "unknown stage 'pretraining'" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["smollm2-gpu.toml", "llama-8b.toml"])
def test_the_recipes_shipped_with_the_benchmarks_build_their_stages(name):
    """Every key of the benchmark recipes is a setting of its stage (a misspelt key is refused, not ignored)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "recipes" / name
    stages = pipeline_configs(load_pipeline_file(path))
    assert [s.name for s in stages][:3] == ["heldout_data", "distill_data", "init_drafter"]
    trained = [s.config for s in stages if s.name.startswith(("finetune", "heads"))]
    assert trained and all(config.group_by_length for config in trained)


def test_the_step_rate_is_timed_past_the_first_steps_warm_up(tmp_path):
    """A device's first steps (kernel selection, caches) are slow: a budget is fitted to the later half's rate."""
    from specdraft.training.recipe import _step_seconds

    wall, rows = 0.0, []
    for step in range(1, 21):
        wall += 1.5 if step <= 3 else 0.05  # three slow first steps, then 50 ms a step
        rows.append(f"{step},{step * 100},0.001,1.0,1.0,1000,{wall}")
    (tmp_path / "train_log.csv").write_text("step,tokens,lr,loss,grad_norm,tokens_per_s,wall_s\n" + "\n".join(rows))
    assert _step_seconds(tmp_path) == pytest.approx(0.05)
    (tmp_path / "train_log.csv").write_text("step,tokens,lr,loss,grad_norm,tokens_per_s,wall_s\n20,2000,0,1,1,1,5.0\n")
    assert _step_seconds(tmp_path) == pytest.approx(0.25)  # one row: the whole span's
