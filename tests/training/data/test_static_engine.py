"""The static-batch data engine (``distill-data --engine native`` on CUDA): the same greedy answers and log-probs as
the ragged CPU engine in float32, rows that end and shrink the batch never disturb the others, and the CUDA-graph path
equals the eager one. Each test runs on the CPU and, where one is visible, on CUDA (fp32, TF32 off)."""

import pytest
import torch

from specdraft.models.registry import load_model
from specdraft.models.static_batch import StaticBatch
from specdraft.sampling import SamplingConfig
from specdraft.training.data.native_generation import (
    StaticEngine,
    generate_rows,
    generate_rows_static,
)
from toys import save_tiny_checkpoint

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
EOS = 38  # with the toy target, most rows end at it early and one runs to the length cap
PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [5, 6, 7], [20, 21], [30, 31, 32, 33], [40], [41, 42, 43, 44, 45, 46],
           [50], [51, 52]]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("target") / "t", seed=0))


def _static(target, device, prompts, eos, top, check_every=2, graphs=True, sampling=None, generator=None,
            row_steps=None, rows=None):
    """The static engine's responses in ``rows`` rows (default: one per prompt; its count of decoded rows appended
    to ``row_steps`` when given)."""
    model = load_model(target, torch.float32, backend="native", device=device)
    batch = StaticBatch(model, rows or len(prompts), max(map(len, prompts)) + 12, graphs=graphs)
    responses, decoded = generate_rows_static(batch, prompts, 12, sampling or SamplingConfig(), eos, top, generator,
                                              check_every)
    if row_steps is not None:
        row_steps.append(decoded)
    return responses


@pytest.mark.parametrize("device", DEVICES)
def test_static_engine_answers_as_the_ragged_engine_in_float32(target, device):
    reference = generate_rows(load_model(target, backend="native"), PROMPTS, 12, SamplingConfig(), eos=EOS,
                              top_logprobs=3, generator=None)
    static = _static(target, device, PROMPTS, eos=EOS, top=3)
    assert {r["finish_reason"] for r in reference} == {"eos", "length"}  # some rows leave early, some run on
    assert [r["ids"] for r in static] == [r["ids"] for r in reference]
    assert [r["finish_reason"] for r in static] == [r["finish_reason"] for r in reference]
    for a, b in zip(static, reference, strict=True):
        assert a["top_ids"] == b["top_ids"]
        assert (torch.tensor(a["top_logprobs"]) - torch.tensor(b["top_logprobs"])).abs().max() < 1e-4


@pytest.mark.parametrize("device", DEVICES)
def test_rows_leaving_and_the_batch_shrinking_never_disturb_the_others(target, device, monkeypatch):
    kept = []
    keep_rows = StaticBatch.keep_rows
    monkeypatch.setattr(StaticBatch, "keep_rows", lambda self, keep: kept.append(len(keep)) or keep_rows(self, keep))
    decoded = []
    together = _static(target, device, PROMPTS, eos=EOS, top=0, check_every=1, row_steps=decoded)
    assert kept and any(k & (k - 1) for k in kept)  # the batch shrank, to a count that runs beside ignored rows
    tokens = sum(len(r["ids"]) for r in together)  # the first token of each comes from the prefill
    assert tokens - len(PROMPTS) <= decoded[0] < len(PROMPTS) * 11  # fewer rows decoded than 10 rows x 11 steps
    alone = [_static(target, device, [p], eos=EOS, top=0)[0] for p in PROMPTS]
    assert together == alone


def test_sampling_is_reproducible_and_stops_at_eos(target):
    sampling = SamplingConfig(temperature=1.0)
    runs = [_static(target, "cpu", PROMPTS, eos=5, top=2, sampling=sampling,
                    generator=torch.Generator().manual_seed(1)) for _ in range(2)]
    assert runs[0] == runs[1]
    for response in runs[0]:
        ids = response["ids"]
        assert 1 <= len(ids) <= 12 and len(response["top_ids"]) == len(ids)
        assert (response["finish_reason"] == "eos") == (ids[-1] == 5) and 5 not in ids[:-1]


def test_sampled_answers_are_those_multinomial_draws_with_no_host_read(target, monkeypatch):
    """The static loop samples on the device (no host read per step); its answers are token for token those of
    ``torch.multinomial`` from the same generator, with rows refilled too."""
    import specdraft.training.data.native_generation as engine
    from specdraft.sampling import sample

    sampling = SamplingConfig(temperature=1.0, top_k=20)
    ours = _refill(target, "cpu", PROMPTS, 3, 5, 2, 4, sampling, torch.Generator().manual_seed(3))[0]
    monkeypatch.setattr(engine, "sample_on_device", sample)
    theirs = _refill(target, "cpu", PROMPTS, 3, 5, 2, 4, sampling, torch.Generator().manual_seed(3))[0]
    assert ours == theirs and len({tuple(r["ids"]) for r in ours}) > 1


def test_an_engine_keeps_its_batch_until_a_call_needs_more(target):
    engine = StaticEngine(load_model(target, torch.float32, backend="native"))
    first = engine.generate(PROMPTS[:4], 12, SamplingConfig(), 5, 0, None)
    batch = engine.batch
    assert engine.row_steps > 0
    assert engine.generate(PROMPTS[:4], 12, SamplingConfig(), 5, 0, None) == first and engine.batch is batch
    engine.generate(PROMPTS, 12, SamplingConfig(), 5, 0, None)
    assert engine.batch is not batch and engine.batch.rows == len(PROMPTS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_cuda_graphs_replay_the_eager_step(target):
    assert _static(target, "cuda", PROMPTS, eos=5, top=3) == _static(target, "cuda", PROMPTS, eos=5, top=3,
                                                                     graphs=False)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_smollm2_static_engine_answers_as_transformers_in_float32(device):
    """The real target: the static batch (eager on the CPU, CUDA graphs on CUDA) gives transformers' greedy answers
    to chat prompts of different lengths, in one batch."""
    from specdraft.models.registry import SMOLLM2, load_tokenizer

    tokenizer = load_tokenizer(SMOLLM2)
    texts = ["What is the capital of France?", "Give me two tips for sleeping well, and say why each one works.",
             "Translate German to English: Das Wetter ist heute schön.", "2+2?"]
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                  return_dict=True)["input_ids"]) for t in texts]
    engine = StaticEngine(load_model(SMOLLM2, torch.float32, backend="native", device=device))
    static = engine.generate(prompts, 24, SamplingConfig(), tokenizer.eos_token_id, 0, None)
    hf = load_model(SMOLLM2, torch.float32, backend="hf", device=device).model
    for prompt, response in zip(prompts, static, strict=True):
        ids = torch.tensor([prompt], device=hf.device)
        out = hf.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.eos_token_id)[0, len(prompt):].tolist()
        assert response["ids"] == out[: out.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in out
                                      else len(out)]


def _refill(target, device, prompts, rows, eos, top, check_every, sampling=None, generator=None):
    """(responses, rows decoded) of more prompts than the batch's ``rows``."""
    decoded = []
    responses = _static(target, device, prompts, eos, top, check_every, sampling=sampling, generator=generator,
                        row_steps=decoded, rows=rows)
    return responses, decoded[0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("rows", "check_every"), [(3, 1), (3, 5), (4, 16), (16, 2)])
def test_rows_refilled_with_waiting_prompts_answer_as_the_ragged_engine(target, device, rows, check_every):
    """More prompts than rows: a row whose answer ended takes the next prompt (checked every ``check_every`` steps
    and at each row's length cap, 12 tokens here: 5 and 16 do not divide it), in float32 the same answers and
    log-probabilities as each prompt decoded on the ragged engine."""
    prompts = PROMPTS + PROMPTS[::-1][:7]  # 17 prompts, some twice
    reference = generate_rows(load_model(target, backend="native"), prompts, 12, SamplingConfig(), eos=EOS,
                              top_logprobs=3, generator=None)
    refilled, decoded = _refill(target, device, prompts, rows, EOS, 3, check_every)
    assert {r["finish_reason"] for r in reference} == {"eos", "length"}
    assert [r["ids"] for r in refilled] == [r["ids"] for r in reference]
    assert [r["finish_reason"] for r in refilled] == [r["finish_reason"] for r in reference]
    for a, b in zip(refilled, reference, strict=True):
        assert a["top_ids"] == b["top_ids"]
        assert (torch.tensor(a["top_logprobs"]) - torch.tensor(b["top_logprobs"])).abs().max() < 1e-4
    tokens = sum(len(r["ids"]) for r in refilled)
    assert tokens - len(prompts) <= decoded


def test_refilling_decodes_fewer_idle_rows_than_batches_that_wait_for_their_longest_answer(target):
    prompts = PROMPTS * 3  # 30 prompts, most ending early, a few running to the cap
    _, refilled = _refill(target, "cpu", prompts, 4, EOS, 0, 2)
    model = load_model(target, torch.float32, backend="native")
    batched = 0
    for start in range(0, len(prompts), 4):
        chunk = prompts[start : start + 4]
        batched += generate_rows_static(StaticBatch(model, 4, max(map(len, chunk)) + 12), chunk, 12, SamplingConfig(),
                                        EOS, 0, None, 2)[1]
    assert refilled < batched


def test_refilled_sampling_is_reproducible_and_stops_at_eos(target):
    sampling = SamplingConfig(temperature=1.0)
    runs = [_refill(target, "cpu", PROMPTS, 3, 5, 2, 4, sampling, torch.Generator().manual_seed(1))[0]
            for _ in range(2)]
    assert runs[0] == runs[1]
    for response in runs[0]:
        ids = response["ids"]
        assert 1 <= len(ids) <= 12 and len(response["top_ids"]) == len(ids)
        assert (response["finish_reason"] == "eos") == (ids[-1] == 5) and 5 not in ids[:-1]


def test_a_refilling_engine_answers_a_whole_shard_in_its_rows(target, monkeypatch):
    """``distill-data --refill``: the shard goes to the engine in one call, decoded in ``batch_size`` rows; the
    records are those of the ragged engine (float32, greedy)."""
    from specdraft.models.registry import load_tokenizer
    from specdraft.training.data.distill_data import DistillDataConfig, generate_shard

    prompts = [(f"p:{i}", [{"role": "user", "content": " ".join(f"w{(i * 7 + j) % 60}" for j in range(1 + i % 5))}])
               for i in range(9)]
    config = DistillDataConfig(target=target, out="-", max_new_tokens=12, temperature=0.0, batch_size=4,
                               shard_size=9, dtype="float32", engine="native", refill=True)
    tokenizer, model = load_tokenizer(target), load_model(target, torch.float32, backend="native")
    engine, calls = StaticEngine(model, refill=True), []
    generate = engine.generate
    monkeypatch.setattr(engine, "generate", lambda prompts, *a, **k: calls.append(len(prompts)) or generate(prompts,
                                                                                                          *a, **k))
    refilled = generate_shard(engine, tokenizer, prompts, config, seed=0)
    assert calls == [9] and engine.batch.rows == 4
    ragged = generate_shard(model, tokenizer, prompts, config, seed=0)
    assert [r["response_token_ids"] for r in refilled] == [r["response_token_ids"] for r in ragged]
    assert [r["prompt_id"] for r in refilled] == [f"p:{i}" for i in range(9)]
