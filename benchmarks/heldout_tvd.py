"""Held-out TVD and forward KL of several drafters on one common distill-data folder, against the real target.

``finetune`` evaluates each run on the held-out part of its own data, so runs trained on different data (the
target's responses, the drafter's, a mix) are evaluated on different text. This script puts every drafter on the
same responses: TVD(p, q) averaged over the response positions (1 − TVD is the expected acceptance rate of one draft
token, Leviathan et al. 2023, Sec. 3.5) and KL(p ‖ q), with q as the drafter runs (its shipped ``draft_vocab``).

Usage:
    python benchmarks/heldout_tvd.py --target smollm2-135m-instruct --data dd-eval \
        --drafters smollm2-135m-instruct-drafter,ft-onpolicy-fkl/model [--limit 200] [--out tvd.jsonl]
"""

from __future__ import annotations

import argparse
import json

import torch

from specdraft.draft_vocab import draft_subset
from specdraft.models.registry import resolve
from specdraft.training.finetune import (
    DistillDataset,
    FinetuneConfig,
    collate_distill,
    heldout_metrics,
    load_distill_records,
    load_models,
)


def evaluate(target: str, drafter: str, records: list[dict], batch_size: int, target_dtype: str) -> dict:
    """{"drafter", "positions", "heldout_tvd", "heldout_fkl", ...} of one drafter on ``records``."""
    from specdraft.drafters.options import folder_options

    config = FinetuneConfig(drafter=drafter, target=target, data="-", out="-", batch_size=batch_size,
                            target_dtype=target_dtype, bf16=True)
    model, target_model, target_lm, tokenizer = load_models(config)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    vocab = folder_options(resolve(drafter)).get("draft_vocab")
    keep = draft_subset(str(resolve(drafter)), target_lm.vocab_size, vocab) if vocab else None  # (N,) or None
    dataset = DistillDataset(records, config.max_seq_len)
    batches = [collate_distill([dataset[i] for i in range(s, min(s + batch_size, len(dataset)))], pad_id)
               for s in range(0, len(dataset), batch_size)]
    with torch.no_grad():
        metrics = heldout_metrics(model.eval(), target_model, batches, config, keep)
    positions = sum(int(b["mask"].sum()) for b in batches)
    return {"drafter": drafter, "draft_vocab": vocab, "positions": positions} | metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--data", required=True, help="a distill-data folder (e.g. the target's held-out responses)")
    parser.add_argument("--drafters", required=True, help="comma-separated drafter names or folders")
    parser.add_argument("--limit", type=int, default=None, help="first N records")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--target-dtype", default="bfloat16")
    parser.add_argument("--out", default=None, help="append one JSON line per drafter here")
    args = parser.parse_args()
    records = load_distill_records(args.data, allow_incomplete=True)[: args.limit]
    for drafter in [d.strip() for d in args.drafters.split(",") if d.strip()]:
        row = {"data": args.data, "records": len(records)} | evaluate(args.target, drafter, records,
                                                                       args.batch_size, args.target_dtype)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as file:
                file.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
