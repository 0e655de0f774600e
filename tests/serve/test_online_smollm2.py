"""Online distillation with the real target and the shipped drafter (slow): recorded p lines up with the greedy
fp32 output, a training round on it runs, and the retrained drafter leaves the output unchanged."""

import pytest
import torch

from specdraft.api import encode_prompt, eos_token_ids, load_drafter, load_target
from specdraft.batching import BatchDecoder, drafter_factory
from specdraft.decoding import generate
from specdraft.models.registry import SMOLLM2, SMOLLM2_DRAFTER
from specdraft.prompts import BUILTIN_PROMPTS
from specdraft.sequence import GenerationConfig
from specdraft.serve import OnlineDistillConfig
from specdraft.serve.online import OnlineDistiller
from specdraft.serve.online_train import finetune_copy

pytestmark = pytest.mark.slow


def _serve(target, distiller, prompts, config) -> list[list[int]]:
    decoder = BatchDecoder(target, 3, 512)
    decoder.on_verify = distiller.on_verify
    outputs, waiting = {}, list(range(len(prompts)))
    while waiting or decoder.rows:
        while waiting and decoder.free_rows:
            i = waiting.pop(0)
            decoder.add(prompts[i], distiller.make_drafter(), config).tag = i
        for seq, _ in decoder.step():
            if seq.finish_reason is not None:
                distiller.finished(seq)
                outputs[seq.tag] = seq.generated
    return [outputs[i] for i in range(len(prompts))]


def test_a_round_on_served_traffic_keeps_greedy_output(tmp_path):
    target, tokenizer = load_target(SMOLLM2, torch.float32)
    prototype = load_drafter(target, tokenizer, draft=SMOLLM2_DRAFTER)
    online = OnlineDistillConfig(folder=str(tmp_path), steps=4, heldout_every=3, lr=3e-4)
    distiller = OnlineDistiller(online, prototype, SMOLLM2_DRAFTER, drafter_factory, tokenizer.eos_token_id)
    config = GenerationConfig(32, 4, eos_token_ids=eos_token_ids(tokenizer, SMOLLM2))
    prompts = [encode_prompt(tokenizer, p.text, chat=True) for p in BUILTIN_PROMPTS[:6]]
    plain = [generate(target, ids, None, config).token_ids for ids in prompts]
    assert _serve(target, distiller, prompts, config) == plain
    train, heldout = distiller.buffer.records()
    assert len(train) == 4 and len(heldout) == 2
    for record in train + heldout:
        assert [row[0] for row in record["top_ids"]] == record["response_token_ids"]
    entry = distiller.train_round()
    assert entry["positions"] > 0 and 0 <= entry["candidate_agreement"] <= 1
    if not entry["accepted"]:  # serve a retrained drafter whatever the round decided
        distiller._accept(finetune_copy(distiller._current, train, loss="tvdpp", steps=4, batch_size=4, lr=1e-3,
                                        max_seq_len=512, keep=prototype.vocab_keep, pad_id=tokenizer.eos_token_id,
                                        seed=0))
    assert distiller.make_drafter().online_version == 1
    assert _serve(target, distiller, prompts, config) == plain
