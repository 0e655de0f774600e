"""Held-out TVD and forward KL of several drafters on one common distill-data folder, against the real target.

``finetune`` evaluates each run on the held-out part of its own data, so runs trained on different data (the
target's responses, the drafter's, a mix) are evaluated on different text. This script puts every drafter on the
same responses: TVD(p, q) averaged over the response positions (1 − TVD is the expected acceptance rate of one draft
token, Leviathan et al. 2023, Sec. 3.5) and KL(p ‖ q), with q as the drafter runs (its shipped ``draft_vocab``).

When the responses are the target's own greedy ones (``distill-data --temperature 0 --policy target``), it also
gives the drafter's model-alone greedy block efficiency τ at each γ exactly, without decoding: in greedy chain
drafting every draft token after an accepted one is predicted from the target's own prefix, so the accepted length
of a block starting at position t is the run of consecutive positions from t where the drafter's argmax equals the
target's token, capped at γ; the target then adds one token and the next block starts after it
(:func:`greedy_blocks`). ``greedy_first_accept@γ`` is the fraction of blocks whose first draft token is accepted.
With ``--siblings k``, ``greedy_tau@γ+k`` is the same for the chain with the drafter's k runners-up beside it at every
depth (the ``siblings=k`` option): a block whose chain stops short of γ also accepts the target's token where it is
among the runners-up at the first rejected depth (a leaf: the target's bonus token follows it).
With ``--chain-copy m``, ``greedy_tau@γ:copym`` is the same for the ``chain_copy=m`` option: a depth whose prefix ends
in an n-gram (n >= m) seen earlier in the prompt and response so far drafts its continuation, the others the
drafter's argmax; on the target's own text the prefix of every drafted depth is the target's, so this is exact too.

Usage:
    python benchmarks/heldout_tvd.py --target smollm2-135m-instruct --data dd-eval \
        --drafters smollm2-135m-instruct-drafter,ft-onpolicy-fkl/model [--limit 200] [--out tvd.jsonl]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdraft.draft_vocab import draft_subset
from specdraft.hardware import resolve_device
from specdraft.models.registry import resolve
from specdraft.training.data.batches import DistillDataset, collate_distill
from specdraft.training.data.records import load_distill_records
from specdraft.training.drafter.distillation import draft_logits_fn, heldout_metrics
from specdraft.training.drafter.finetune import FinetuneConfig, load_models
from specdraft.training.objectives.tau import greedy_blocks, greedy_tau, response_ranks  # noqa: F401 (greedy_blocks: tests)


def copy_hits(records: list[dict], smallest: int) -> list[list[int]]:
    """Per response and position: -1 where no n-gram (n from max(``smallest``, 4) down to ``smallest``) ending there
    was seen earlier in the prompt and response so far, else 1 if the continuation of its most recent occurrence is
    the response token, 0 if not (what ``chain_copy`` drafts, :class:`~specdraft.drafters.WithChainCopies`)."""
    from specdraft.drafters import PromptLookupDrafter

    lookup, out = PromptLookupDrafter(max(smallest, 4), smallest), []
    for record in records:
        prompt, response = record["prompt_token_ids"], record["response_token_ids"]
        ids = torch.tensor(prompt + response)  # (P + R,)
        hits = []
        for t in range(len(response)):
            size, copied = lookup.match(ids[: len(prompt) + t], 1)
            hits.append(int(copied.tokens[0] == response[t]) if size else -1)
        out.append(hits)
    return out


def evaluate(target: str, drafter: str, records: list[dict], batch_size: int, target_dtype: str,
             gammas: list[int] | None = None, siblings: list[int] = (),
             copies: dict[int, list[list[int]]] | None = None, max_seq_len: int = 512, device: str = "cpu") -> dict:
    """{"drafter", "positions", "heldout_tvd", "heldout_fkl", ...} of one drafter on ``records``, the drafter and the
    target on ``device``."""
    from specdraft.drafters.options import folder_options

    config = FinetuneConfig(drafter=drafter, target=target, data="-", out="-", batch_size=batch_size,
                            target_dtype=target_dtype, bf16=True, max_seq_len=max_seq_len, device=device)
    model, target_model, target_lm, tokenizer = load_models(config)
    model, target_model = model.to(device), target_model.to(device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    vocab = folder_options(resolve(drafter)).get("draft_vocab")
    keep = draft_subset(str(resolve(drafter)), target_lm.vocab_size, vocab).to(device) if vocab else None  # (N,)
    dataset = DistillDataset(records, config.max_seq_len)
    batches = [collate_distill([dataset[i] for i in range(s, min(s + batch_size, len(dataset)))], pad_id)
               for s in range(0, len(dataset), batch_size)]
    with torch.no_grad():
        metrics = heldout_metrics(model.eval(), target_model, batches, config.objective(), True, keep)
        top = max(siblings, default=0) + 1  # the greedy token and k runners-up
        ranks = response_ranks(draft_logits_fn(model, keep, bf16=True), batches, keep, top) if gammas else None
        tau = greedy_tau(ranks, gammas, siblings, copies) if gammas else {}
    positions = sum(int(b["mask"].sum()) for b in batches)
    return {"drafter": drafter, "draft_vocab": vocab, "positions": positions} | metrics | tau


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--data", required=True, help="a distill-data folder (e.g. the target's held-out responses)")
    parser.add_argument("--drafters", required=True, help="comma-separated drafter names or folders")
    parser.add_argument("--limit", type=int, default=None, help="first N records")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--target-dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu", help="where the drafter and the target run: cpu, cuda, cuda:N, "
                                                        "auto (CUDA when visible)")
    parser.add_argument("--out", default=None, help="append one JSON line per drafter here")
    parser.add_argument("--num-draft-tokens", default="3,4,5",
                        help="γ values of the exact greedy τ (only for the target's greedy responses)")
    parser.add_argument("--siblings", default="", help="k values: also the exact greedy τ with k siblings per depth")
    parser.add_argument("--chain-copy", default="", help="m values: also the exact greedy τ of chain_copy=m")
    parser.add_argument("--max-seq-len", type=int, default=512,
                        help="prompt + response tokens the drafter sees per answer (a longer prompt loses its start; "
                             "copies always read the whole prompt, as in decoding)")
    args = parser.parse_args()
    try:
        args.device = str(resolve_device(args.device).device)
    except ValueError as exc:
        parser.error(str(exc))
    records = load_distill_records(args.data, allow_incomplete=True)[: args.limit]
    setup = json.loads((Path(args.data) / "distill_config.json").read_text())
    greedy = setup.get("temperature") == 0 and setup.get("policy", "target") == "target"
    gammas = [int(g) for g in args.num_draft_tokens.split(",") if g] if greedy else None
    siblings = [int(k) for k in args.siblings.split(",") if k]
    copies = {m: copy_hits(records, m) for m in (int(k) for k in args.chain_copy.split(",") if k)} if gammas else {}
    for drafter in [d.strip() for d in args.drafters.split(",") if d.strip()]:
        row = {"data": args.data, "records": len(records), "max_seq_len": args.max_seq_len} | evaluate(
            args.target, drafter, records, args.batch_size, args.target_dtype, gammas, siblings, copies,
            args.max_seq_len, args.device)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as file:
                file.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
