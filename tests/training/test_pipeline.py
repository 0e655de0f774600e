"""The whole draft-training pipeline (Goel et al. 2024) on a tiny random target, through the CLI: pretrain ->
distill-data -> finetune, then the bad inputs each stage must refuse."""

import argparse
import json
import random
import re
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdraft.errors import SpecdraftError
from specdraft.models.registry import load_model
from specdraft.training.commands import add_training_commands
from specdraft.training.data.records import load_distill_records, split_by_prompt
from specdraft.training.drafter.distillation import block_efficiency
from specdraft.training.drafter.finetune import FinetuneConfig, finetune
from specdraft.training.drafter.init_drafter import project_embeddings
from specdraft.training.drafter.pretrain import PretrainConfig, build_drafter, pretrain
from specdraft.training.runs.checkpoint import is_complete_export
from specdraft.training.runs.folders import count_and_hash
from toys import WORDS, save_tiny_checkpoint

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]

PIPELINE = """
target = "{root}/target"

[pretrain]
out = "{root}/pre"
source = "{root}/corpus.txt"
hidden_size = 64
num_heads = 2
num_kv_heads = 1
intermediate_size = 128
seq_len = 32
batch_size = 8
steps = 30
heldout_every = 10
bf16 = false
progress = false

[distill_data]
out = "{root}/data"
prompts = "{root}/prompts.jsonl"
max_new_tokens = 24
temperature = 0.0
batch_size = 16
shard_size = 32
dtype = "float32"

[finetune]
out = "{root}/fine"
loss = "fkl"
steps = 200
batch_size = 8
lr = 3e-3
warmup_steps = 5
bf16 = false
heldout_every = 8
eval_prompts = 4
eval_max_new_tokens = 24
eval_every = 100
progress = false
"""


def _parser():
    parser = argparse.ArgumentParser(prog="specdraft")
    add_training_commands(parser.add_subparsers(dest="command", required=True))
    return parser


def _cli(*argv):
    args = _parser().parse_args([str(a) for a in argv])
    args.run(args)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    save_tiny_checkpoint(root / "target", seed=0, layers=1, hidden=32)
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(200)]
    (root / "corpus.txt").write_text("\n\n".join(docs))
    prompts = [json.dumps({"prompt": " ".join(f"w{rng.randrange(60)}" for _ in range(rng.randint(1, 6)))})
               for _ in range(128)]
    (root / "prompts.jsonl").write_text("\n".join(prompts) + "\n")
    (root / "pipeline.toml").write_text(PIPELINE.format(root=root))
    _cli("train-drafter", "--config", root / "pipeline.toml")
    return root


def test_finetuning_raises_block_efficiency_on_held_out_prompts(run):
    target = load_model(str(run / "target"))
    _, heldout = split_by_prompt(load_distill_records(run / "data"), 8)
    prompts = list(dict.fromkeys(tuple(r["prompt_token_ids"]) for r in heldout))
    assert len(prompts) == 16
    tau = {}
    for stage in ("pre", "fine"):
        drafter = AutoModelForCausalLM.from_pretrained(run / stage / "model")
        tau[stage] = [block_efficiency(target, drafter, prompts, k, 24, (2,)) for k in (3, 5)]
    assert all(fine > pre + 0.1 for pre, fine in zip(tau["pre"], tau["fine"], strict=True)), tau
    logged = (run / "fine" / "eval_log.csv").read_text().splitlines()
    assert logged[0].split(",")[-2:] == ["block_efficiency@3", "block_efficiency@5"] and len(logged) == 3
    card = (run / "fine" / "model" / "README.md").read_text()
    assert "train-drafter" in card and "fkl" in card and "block_efficiency@5" in card


def test_a_second_run_skips_every_completed_stage(run):
    files = [run / "pre" / "model" / "model.safetensors", run / "data" / "manifest.json",
             run / "fine" / "model" / "model.safetensors"]
    before = [f.stat().st_mtime_ns for f in files]
    _cli("train-drafter", "--config", run / "pipeline.toml")
    assert [f.stat().st_mtime_ns for f in files] == before


def _finetune(run, out, **kwargs):
    defaults = dict(drafter=str(run / "pre" / "model"), target=str(run / "target"), data=str(run / "data"),
                    out=str(out), steps=2, batch_size=4, bf16=False, heldout_every=8, eval_prompts=1,
                    eval_max_new_tokens=4, progress=False)
    return finetune(FinetuneConfig(**(defaults | kwargs)))


def _assert_nothing_complete(out):
    assert not is_complete_export(out / "model")


def test_a_drafter_with_another_vocabulary_is_refused_at_the_start(run, tmp_path):
    other = save_tiny_checkpoint(tmp_path / "other", seed=3, vocab_size=80)
    with pytest.raises(SpecdraftError, match="vocabulary mismatch"):
        _finetune(run, tmp_path / "out", drafter=str(other))
    assert not (tmp_path / "out").exists()


def test_missing_drafter_checkpoint(run, tmp_path):
    with pytest.raises(SpecdraftError, match="nope"):
        _finetune(run, tmp_path / "out", drafter=str(tmp_path / "nope"))
    _assert_nothing_complete(tmp_path / "out")


def _data_copy(run, tmp_path):
    return shutil.copytree(run / "data", tmp_path / "data")


def test_incomplete_or_missing_manifest(run, tmp_path):
    data = _data_copy(run, tmp_path)
    manifest = json.loads((data / "manifest.json").read_text())
    (data / "manifest.json").write_text(json.dumps(manifest | {"complete": False}))
    with pytest.raises(SpecdraftError, match=r"incomplete.*--allow-incomplete"):
        _finetune(run, tmp_path / "out", data=str(data))
    (data / "manifest.json").unlink()
    with pytest.raises(SpecdraftError, match="not a distill-data folder"):
        _finetune(run, tmp_path / "out", data=str(data))
    _assert_nothing_complete(tmp_path / "out")


@pytest.mark.parametrize(("content", "message"), [("", "no records"), ('{"prompt_token_ids": [1]\n', "invalid JSON"),
                                                  ('{"prompt_token_ids": [1, 2]}\n', "response_token_ids"),
                                                  ('{"prompt_token_ids": [1, 999], "response_token_ids": [5]}\n',
                                                   "outside the target's vocabulary")])
def test_empty_or_malformed_data_files(run, tmp_path, content, message):
    """Shards of bad records whose manifest agrees (made by another tool): each record is checked."""
    data = _data_copy(run, tmp_path)
    (data / "shard-00001.jsonl").write_text(content)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["shards"]["shard-00001.jsonl"], manifest["sha256"]["shard-00001.jsonl"] = count_and_hash(
        data / "shard-00001.jsonl")
    (data / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SpecdraftError, match=message):
        _finetune(run, tmp_path / "out", data=str(data))
    _assert_nothing_complete(tmp_path / "out")


def test_stored_topk_is_required_for_use_stored_topk(run, tmp_path):
    with pytest.raises(SpecdraftError, match="top-k"):
        _finetune(run, tmp_path / "out", use_stored_topk=True)


@pytest.mark.parametrize("device", DEVICES)
def test_stored_topk_training_through_the_cli(run, tmp_path, device):
    """On the device asked for: TVD++ sampling draws from the trainer's CPU generator whatever the logits' device."""
    _cli("distill-data", "--target", run / "target", "--out", tmp_path / "data", "--prompts", run / "prompts.jsonl",
         "--limit", 16, "--max-new-tokens", 8, "--top-logprobs", 5, "--dtype", "float32", "--shard-size", 8,
         "--device", device)
    _cli("finetune", "--drafter", run / "pre" / "model", "--target", run / "target", "--data", tmp_path / "data",
         "--out", tmp_path / "fine", "--use-stored-topk", "--loss", "tvdpp", "--weighting", "sample", "--steps", 3,
         "--batch-size", 4, "--no-bf16", "--heldout-every", 4, "--eval-prompts", 1, "--eval-max-new-tokens", 4,
         "--no-progress", "--device", device)
    assert json.loads((tmp_path / "fine" / "run.json").read_text())["device"]["device"].startswith(device)
    card = (tmp_path / "fine" / "model" / "README.md").read_text()
    assert "approximated from the stored top-k" in card and "--use-stored-topk" in card and "'sample'" in card


def test_a_registered_loss_brings_its_settings_as_flags(run, tmp_path):
    """DistiLLM's skew KL through the CLI: ``--loss skl --alpha 0.2`` trains and exports, the run records the
    setting among its settings and the card names it; a bad value is refused at parse time."""
    flags = ["--drafter", run / "pre" / "model", "--target", run / "target", "--data", run / "data", "--steps", 3,
             "--batch-size", 4, "--no-bf16", "--heldout-every", 8, "--eval-prompts", 1, "--eval-max-new-tokens", 4,
             "--no-progress", "--loss", "skl"]
    _cli("finetune", *flags, "--alpha", 0.2, "--out", tmp_path / "skl")
    assert json.loads((tmp_path / "skl" / "run.json").read_text())["settings"]["alpha"] == 0.2
    card = (tmp_path / "skl" / "model" / "README.md").read_text()
    assert "skl {'alpha': 0.2}" in card and "--alpha 0.2" in card and "heldout_loss" in card
    with pytest.raises(SpecdraftError, match=r"alpha must be a number in \[0, 1\)"):
        _cli("finetune", *flags, "--alpha", 1.0, "--out", tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_a_drafter_trained_on_a_draft_vocabulary_ships_it_as_its_default_option(run, tmp_path):
    from specdraft.api import load_drafter
    from specdraft.draft_vocab import load_token_ranking
    from specdraft.models.registry import load_tokenizer

    out = _finetune(run, tmp_path / "fine", draft_vocab=16, loss="fkl")
    assert json.loads((out / "drafter_options.json").read_text()) == {"draft_vocab": 16, "quantize": "int8"}
    card = (out / "README.md").read_text()
    assert "heldout_coverage" in card and '"draft_vocab": 16' in card
    target, tokenizer = load_model(str(run / "target")), load_tokenizer(str(run / "target"))
    drafter = load_drafter(target, tokenizer, draft=str(out))
    assert torch.equal(drafter.vocab_keep, load_token_ranking(out, 64)[:16])
    assert load_drafter(target, tokenizer, draft=str(out), options={"draft_vocab": "0"}).vocab_keep is None
    with pytest.raises(SpecdraftError, match="draft_vocab"):
        _finetune(run, tmp_path / "bad", draft_vocab=-1)


def test_cross_entropy_on_a_draft_vocabulary_is_evaluated_on_the_same_columns(run, tmp_path):
    """The held-out loss maps labels into the draft vocabulary as training does (labels outside it do not count)."""
    out = _finetune(run, tmp_path / "ce", draft_vocab=16, loss="ce")
    assert "heldout_loss" in (out / "README.md").read_text()


def test_cli_bad_values_name_the_field(run, tmp_path):
    with pytest.raises(SpecdraftError, match="steps"):
        _cli("pretrain", "--target", run / "target", "--out", tmp_path / "p", "--steps", "0")
    with pytest.raises(SpecdraftError, match="loss"):
        _cli("finetune", "--drafter", "d", "--target", "t", "--data", "x", "--out", tmp_path / "f", "--loss", "kl")
    with pytest.raises(SystemExit):  # argparse rejects a non-integer at parse time
        _parser().parse_args(["pretrain", "--target", "t", "--out", "o", "--steps", "many"])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"pretrain": {"out": "x", "colour": "red"}, "distill_data": {}, "finetune": {}}))
    with pytest.raises(SpecdraftError, match="colour"):
        _cli("train-drafter", "--config", bad)
    with pytest.raises(SpecdraftError, match="cannot read"):
        _cli("train-drafter", "--config", tmp_path / "missing.toml")
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("name", ["init-drafter", "pretrain", "distill-data", "task-prompts", "finetune",
                                  "train-drafter"])
def test_every_subcommand_documents_its_flags(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args([name, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    flags = {"pretrain": ["--preset", "--tokens", "--init-from-target", "--no-bf16", "--resume", "--stop-after"],
             "distill-data": ["--top-logprobs", "--overwrite"],
             "finetune": ["--loss", "--beta", "--use-stored-topk", "--allow-incomplete", "--eval-num-draft-tokens",
                          "--freeze-embeddings", "--share-embeddings", "--draft-vocab", "--alpha", "skl, srkl:"],
             "init-drafter": ["--layers", "--target", "--grow"],
             "task-prompts": ["--out", "--per-task", "--seed"],
             "train-drafter": ["--config"]}[name]
    assert all(flag in text for flag in flags), text


def _pretrain_config(run, out, **kwargs):
    defaults = dict(target=str(run / "target"), out=str(out), source=str(run / "corpus.txt"), hidden_size=16,
                    num_heads=2, num_kv_heads=1, intermediate_size=32, num_layers=1, seq_len=16, batch_size=4, steps=4,
                    heldout_every=10, bf16=False, progress=False)
    return PretrainConfig(**(defaults | kwargs))


def test_an_interrupted_pretrain_exports_nothing_until_resumed(run, tmp_path):
    pretrain(_pretrain_config(run, tmp_path / "p", stop_after=2))
    assert (tmp_path / "p" / "checkpoint.pt").is_file() and not (tmp_path / "p" / "model").exists()
    out = pretrain(_pretrain_config(run, tmp_path / "p", resume=True))
    assert is_complete_export(out) and "4 steps" in (out / "README.md").read_text()


def test_token_budget_sets_steps_and_init_from_target_copies_the_projection(run, tmp_path):
    config = _pretrain_config(run, tmp_path, tokens=1000, stop_after=3)
    assert config.with_budget().steps == 16 and config.with_budget(world=2).steps == 8  # ceil(1000 / (4 * 16))
    drafter = build_drafter(_pretrain_config(run, tmp_path, init_from_target=True))
    target = AutoModelForCausalLM.from_pretrained(run / "target")
    expected = project_embeddings(target.get_input_embeddings().weight, 16)
    torch.testing.assert_close(drafter.get_input_embeddings().weight, expected)
    with pytest.raises(SpecdraftError, match="heldout_every"):
        _pretrain_config(run, tmp_path, heldout_every=1)
    with pytest.raises(SpecdraftError, match="at least heldout_every"):
        pretrain(_pretrain_config(run, tmp_path / "few", max_docs=5))


def test_distill_topk_matches_the_log_probs_stored_during_generation(run, tmp_path):
    """The teacher pass (right-padded teacher forcing) reproduces the top-k that generation stored (left-padded
    sampling), so fine-tuning runs can share one pass of the target; a killed pass resumes shard by shard."""
    _cli("distill-data", "--target", run / "target", "--out", tmp_path / "gen", "--prompts", run / "prompts.jsonl",
         "--limit", 12, "--max-new-tokens", 6, "--top-logprobs", 4, "--dtype", "float32", "--shard-size", 8)
    _cli("distill-data", "--target", run / "target", "--out", tmp_path / "plain", "--prompts",
         run / "prompts.jsonl", "--limit", 12, "--max-new-tokens", 6, "--dtype", "float32", "--shard-size", 8)
    _cli("distill-topk", "--data", tmp_path / "plain", "--out", tmp_path / "topk", "--target", run / "target",
         "--k", 4, "--dtype", "float32", "--batch-size", 5)
    stored = load_distill_records(tmp_path / "gen", need_topk=True)
    annotated = load_distill_records(tmp_path / "topk", need_topk=True)
    assert [r["response_token_ids"] for r in stored] == [r["response_token_ids"] for r in annotated]
    for a, b in zip(stored, annotated, strict=True):
        assert a["top_ids"] == b["top_ids"]
        torch.testing.assert_close(torch.tensor(b["top_logprobs"]), torch.tensor(a["top_logprobs"]), atol=2e-4,
                                   rtol=0)
    first, second = tmp_path / "topk" / "shard-00000.jsonl", tmp_path / "topk" / "shard-00001.jsonl"
    kept, redone = first.stat().st_mtime_ns, second.read_text()
    second.write_text(redone[: len(redone) // 2])  # cut short from outside: set aside and annotated again
    _cli("distill-topk", "--data", tmp_path / "plain", "--out", tmp_path / "topk", "--target", run / "target",
         "--k", 4, "--dtype", "float32")
    assert first.stat().st_mtime_ns == kept and second.read_text() == redone
    assert (tmp_path / "topk" / "shard-00001.jsonl.damaged").read_text() == redone[: len(redone) // 2]
    with pytest.raises(SpecdraftError, match=r"other inputs or settings: k \(4 -> 3\)"):
        _cli("distill-topk", "--data", tmp_path / "plain", "--out", tmp_path / "topk", "--target", run / "target",
             "--k", 3, "--dtype", "float32")
    with pytest.raises(SpecdraftError, match="must differ"):
        _cli("distill-topk", "--data", tmp_path / "plain", "--out", tmp_path / "plain", "--target", run / "target")


def test_a_layer_copy_fine_tuned_with_shared_embeddings_loads_from_its_target(run, tmp_path):
    """init-drafter -> finetune --freeze-embeddings --share-embeddings: the export stores no embedding table, the
    drafter takes its target's (natively and through transformers), and refuses to load without it or with a
    target whose table differs."""
    from safetensors.torch import load_file

    from specdraft.api import load_draft_model
    from specdraft.draft_vocab import load_token_ranking, rank_tokens
    from specdraft.models.registry import load_tokenizer
    from specdraft.models.shared_embeddings import EMBEDDING_KEY, SHARED_EMBEDDINGS_FILE

    _cli("init-drafter", "--target", run / "target", "--out", tmp_path / "init", "--layers", "0")
    target_hf = AutoModelForCausalLM.from_pretrained(run / "target")
    copy = AutoModelForCausalLM.from_pretrained(tmp_path / "init")
    ids = torch.tensor([[1, 5, 9, 4]])
    torch.testing.assert_close(copy(ids).logits, target_hf(ids).logits)  # the target's only layer: the same model
    out = _finetune(run, tmp_path / "fine", drafter=str(tmp_path / "init"), steps=3, lr=1e-2,
                    freeze_embeddings=True, share_embeddings=True)
    assert EMBEDDING_KEY not in load_file(out / "model.safetensors") and (out / SHARED_EMBEDDINGS_FILE).is_file()
    assert (out / "model.safetensors").stat().st_mode == (out / "config.json").stat().st_mode  # not left 0600
    ranking = load_token_ranking(out, 64)  # the training responses' token ranking, for draft_vocab
    train, _ = split_by_prompt(load_distill_records(run / "data"), 8)
    assert torch.equal(ranking, rank_tokens([r["response_token_ids"] for r in train], 64))
    target, tokenizer = load_model(str(run / "target")), load_tokenizer(str(run / "target"))
    native = load_draft_model(target, tokenizer, str(out))
    hf = load_draft_model(target, tokenizer, str(out), backend="hf")
    torch.testing.assert_close(native.embed_weight, target.embed_weight)
    assert not torch.equal(native.lm_head_weight, target.lm_head_weight)  # trained (the toy's head is untied)
    logits = native(ids, native.new_cache(8))
    torch.testing.assert_close(hf.forward(ids, hf.new_cache(8)), logits, rtol=1e-4, atol=1e-4)
    with pytest.raises(SpecdraftError, match="shares its target's token embeddings"):
        load_model(str(out))
    kept = _finetune(run, tmp_path / "frozen", drafter=str(tmp_path / "init"), steps=3, lr=1e-2, freeze_embeddings=True)
    torch.testing.assert_close(load_file(kept / "model.safetensors")[EMBEDDING_KEY], target.embed_weight)
    other = load_model(str(save_tiny_checkpoint(tmp_path / "other", seed=5, layers=1, hidden=32)))
    with pytest.raises(SpecdraftError, match="fingerprint"):
        load_draft_model(other, tokenizer, str(out))


def test_init_drafter_grow_deepens_a_shared_embeddings_drafter_without_changing_it(run, tmp_path):
    """init-drafter --grow on a fine-tuned drafter that ships no embedding table: the grown checkpoint has one
    layer more, carries the target's table, and gives the drafter's logits."""
    from specdraft.api import load_draft_model
    from specdraft.models.registry import load_tokenizer

    _cli("init-drafter", "--target", run / "target", "--out", tmp_path / "init", "--layers", "0")
    fine = _finetune(run, tmp_path / "fine", drafter=str(tmp_path / "init"), steps=3, lr=1e-2,
                     freeze_embeddings=True, share_embeddings=True)
    _cli("init-drafter", "--target", run / "target", "--grow", fine, "--layers", "0", "--out", tmp_path / "grown")
    grown = AutoModelForCausalLM.from_pretrained(tmp_path / "grown")
    assert grown.config.num_hidden_layers == 2
    target, tokenizer = load_model(str(run / "target")), load_tokenizer(str(run / "target"))
    ids = torch.tensor([[1, 5, 9, 4]])
    drafter = load_draft_model(target, tokenizer, str(fine), backend="hf")
    expected = drafter.forward(ids, drafter.new_cache(8))
    torch.testing.assert_close(grown(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_share_embeddings_needs_frozen_embeddings_of_the_targets_width(run, tmp_path):
    with pytest.raises(SpecdraftError, match="needs --freeze-embeddings"):
        _finetune(run, tmp_path / "a", share_embeddings=True)
    with pytest.raises(SpecdraftError, match="does not have the target's token embeddings"):
        _finetune(run, tmp_path / "b", freeze_embeddings=True, share_embeddings=True)  # the pretrained drafter
    _assert_nothing_complete(tmp_path / "b")


def test_finetune_pools_several_data_folders(run, tmp_path):
    _cli("distill-data", "--target", run / "target", "--out", tmp_path / "more", "--prompts", run / "prompts.jsonl",
         "--limit", 16, "--max-new-tokens", 8, "--dtype", "float32", "--shard-size", 8)
    _cli("finetune", "--drafter", run / "pre" / "model", "--target", run / "target", "--data",
         f"{run / 'data'},{tmp_path / 'more'}", "--out", tmp_path / "fine", "--steps", 2, "--batch-size", 4,
         "--no-bf16", "--heldout-every", 8, "--eval-prompts", 1, "--eval-max-new-tokens", 4, "--no-progress")
    total = len(load_distill_records(run / "data")) + 16
    card = (tmp_path / "fine" / "model" / "README.md").read_text()
    train, heldout = (int(n) for n in re.search(r"(\d+) responses for training, (\d+) held out", card).groups())
    assert train + heldout == total


def test_pretrain_tokenises_only_what_its_steps_need(run, tmp_path):
    from specdraft.models.registry import load_tokenizer
    from specdraft.training.drafter.pretrain import load_corpus

    rng = random.Random(1)
    (tmp_path / "big.txt").write_text("\n\n".join(" ".join(rng.choice(WORDS) for _ in range(20))
                                                  for _ in range(3000)))
    tokenizer = load_tokenizer(str(run / "target"))
    config = _pretrain_config(run, tmp_path / "p", source=str(tmp_path / "big.txt"), steps=3, max_eval_rows=2)
    train_rows, heldout_rows, docs = load_corpus(config, tokenizer)
    assert docs == 256 and train_rows.shape[0] >= 3 * 4 and heldout_rows.shape[0] == 2  # one block of documents
    everything = _pretrain_config(run, tmp_path / "p", source=str(tmp_path / "big.txt"), steps=10_000)
    assert load_corpus(everything, tokenizer)[2] == 3000  # a corpus smaller than the run needs is used whole
