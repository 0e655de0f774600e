"""The static data engine's schedule, replayed without a model: what a GPU would be asked to do for given prompt
and answer lengths. The real decode loop (:func:`specdraft.training.data.native_generation.generate_rows_static`, with
``distill-data``'s batching: prompts sorted by length, batches of ``--rows``, or one refilled batch) runs over a
stand-in for :class:`~specdraft.models.static_batch.StaticBatch` that ends each answer at its known length and counts
the work instead of doing it: decode steps, rows decoded, cache slots attended (each one a read of its keys and
values in every layer; ``slots_own``: had each row read only its own), CUDA graph shapes (a capture each), prefill
calls and tokens, compactions. Counts only: the seconds they cost on a device are the device's to measure
(``bench_distill_data.py --ledger``).

Lengths come from a JSON Lines file of ``{"prompt" | "messages", "answer_ids"}`` (the target's answers, e.g.
/work/shared/data/smollm2_answers/answers.jsonl.gz, with the target's chat template) or a distill-data folder;
``--prompts`` pairs other prompts with those answers' lengths, in order.

    python benchmarks/static_schedule.py --answers answers.jsonl.gz --limit 4096 --rows 1024,2048 --refill both
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import torch

from specdraft.models.static_batch import END_STEP, PREFILL_TOKENS
from specdraft.sampling import SamplingConfig
from specdraft.training.data.native_generation import generate_rows_static

EOS = 1  # the stand-in's vocabulary: 0 continues, 1 ends the answer


class ReplayBatch:
    """Stands in for a StaticBatch of ``rows`` x ``capacity`` slots: row r writes the answer of the prompt whose
    first id it was given, and its logits choose EOS at that answer's length; every call is counted in ``counts``."""

    def __init__(self, rows: int, capacity: int, lengths: list[int]) -> None:
        self.rows, self.capacity, self.device, self.lengths = rows, capacity, torch.device("cpu"), lengths
        self.positions = torch.zeros(rows, dtype=torch.long)  # (R,)
        self.owner, self.written = [-1] * rows, [0] * rows
        self.shapes: set[tuple[int, int]] = set()
        self.counts = {"steps": 0, "rows_decoded": 0, "slots_attended": 0, "slots_own": 0, "prefill_calls": 0,
                       "prefill_chunks": 0, "prefill_tokens": 0, "prefill_padded_tokens": 0, "compactions": 0,
                       "slots_moved": 0}

    def _logits(self, rows: list[int]) -> torch.Tensor:
        logits = torch.zeros(len(rows), 2)  # (n, 2)
        for i, row in enumerate(rows):
            done = self.owner[row] >= 0 and self.written[row] >= self.lengths[self.owner[row]]
            logits[i, EOS if done else 0] = 1.0
        return logits

    def prefill(self, prompts: list[list[int]], rows: list[int] | None = None) -> torch.Tensor:
        rows = list(range(len(prompts))) if rows is None else rows
        for prompt, row in zip(prompts, rows, strict=True):
            self.owner[row], self.written[row] = prompt[0], 1
        self.positions[torch.tensor(rows)] = torch.tensor([len(p) for p in prompts])
        chunks = _chunk_widths(sorted(len(p) for p in prompts))
        self.counts["prefill_calls"] += 1
        self.counts["prefill_chunks"] += len(chunks)
        self.counts["prefill_tokens"] += sum(len(p) for p in prompts)
        self.counts["prefill_padded_tokens"] += sum(count * width for count, width in chunks)
        return self._logits(rows)

    def decode(self, tokens: torch.Tensor, n: int, end: int) -> torch.Tensor:
        end = min(self.capacity, -(-end // END_STEP) * END_STEP)
        self.shapes.add((n, end))
        self.counts["steps"] += 1
        self.counts["rows_decoded"] += n
        self.counts["slots_attended"] += n * end
        self.counts["slots_own"] += int(self.positions[:n].sum()) + n  # had each row read only its own slots
        for row in range(n):
            self.written[row] += 1
        self.positions[:n] += 1
        return self._logits(list(range(n)))

    def keep_rows(self, keep: torch.Tensor) -> None:
        kept = keep.tolist()
        self.owner[: len(kept)] = [self.owner[r] for r in kept]
        self.written[: len(kept)] = [self.written[r] for r in kept]
        self.positions[: len(kept)] = self.positions[keep]
        self.counts["compactions"] += 1
        self.counts["slots_moved"] += len(kept) * self.capacity


def _chunk_widths(lengths: list[int]) -> list[tuple[int, int]]:
    """(prompts, padded width) of each prefill chunk, as :func:`specdraft.models.static_batch._chunks` cuts them."""
    chunks, chunk = [], []
    for length in lengths:
        if chunk and (len(chunk) + 1) * length > PREFILL_TOKENS:
            chunks.append((len(chunk), chunk[-1]))
            chunk = []
        chunk.append(length)
    return chunks + [(len(chunk), chunk[-1])]


def replay(prompt_lengths: list[int], answer_lengths: list[int], rows: int, refill: bool,
           max_new_tokens: int = 256) -> dict:
    """The counts of answering every prompt as ``distill-data --engine native`` does on CUDA (a shard of them all)."""
    order = sorted(range(len(prompt_lengths)), key=lambda i: prompt_lengths[i])
    lengths = [min(a, max_new_tokens) for a in answer_lengths]
    capacity = -(-(max(prompt_lengths) + max_new_tokens) // 256) * 256
    batch = ReplayBatch(rows if refill else min(rows, len(order)), capacity, lengths)
    step = len(order) if refill else rows
    for start in range(0, len(order), step):
        chosen = order[start : start + step]
        prompts = [[i] + [0] * (prompt_lengths[i] - 1) for i in chosen]
        responses, _ = generate_rows_static(batch, prompts, max_new_tokens, SamplingConfig(), EOS, 0, None,
                                            rows=rows if refill else len(chosen))
        assert [len(r["ids"]) for r in responses] == [lengths[i] for i in chosen], "the replay lost an answer"
    counts = batch.counts
    return {"rows": rows, "refill": refill, "prompts": len(order), "answer_tokens": sum(lengths),
            "graph_shapes": len(batch.shapes), **counts,
            "mean_rows_per_step": round(counts["rows_decoded"] / counts["steps"], 1),
            "mean_slots_per_row": round(counts["slots_attended"] / counts["rows_decoded"], 1),
            "row_step_use": round((sum(lengths) - len(order)) / counts["rows_decoded"], 3)}


def read_lengths(path: Path, target: str, limit: int | None) -> tuple[list[int], list[int]]:
    """(prompt lengths, answer lengths) from a distill-data folder or a JSON Lines file of answers."""
    if path.is_dir():
        from specdraft.training.data.records import load_distill_records

        records = load_distill_records(path, allow_incomplete=True)[:limit]
        return [len(r["prompt_token_ids"]) for r in records], [len(r["response_token_ids"]) for r in records]
    rows = _json_lines(path, limit)
    return prompt_lengths(rows, target), [len(r["answer_ids"]) for r in rows]


def _json_lines(path: Path, limit: int | None) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as file:
        return [json.loads(line) for _, line in zip(range(limit or 1 << 62), file, strict=False)]


def prompt_lengths(rows: list[dict], target: str) -> list[int]:
    """Each ``{"prompt"}`` or ``{"messages"}`` record's length in the target's chat template."""
    from specdraft.models.registry import load_tokenizer
    from specdraft.prompts import encode_prompts

    conversations = [r.get("messages") or [{"role": "user", "content": r["prompt"]}] for r in rows]
    return [len(ids) for ids in encode_prompts(load_tokenizer(target), conversations)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", required=True, help="a JSON Lines file of answers, or a distill-data folder")
    parser.add_argument("--prompts", help="other prompts (a JSON Lines file) paired in order with the answers' "
                                          "lengths: the schedule of prompts whose answers are not at hand")
    parser.add_argument("--target", default="smollm2-135m-instruct", help="its chat template encodes the prompts")
    parser.add_argument("--limit", type=int, default=4096)
    parser.add_argument("--rows", default="1024,2048")
    parser.add_argument("--refill", choices=("no", "yes", "both"), default="both")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--json-out", help="append one JSON line per setting here")
    args = parser.parse_args()
    prompts, answers = read_lengths(Path(args.answers), args.target, args.limit)
    if args.prompts:
        prompts = prompt_lengths(_json_lines(Path(args.prompts), args.limit), args.target)
        answers = answers[: len(prompts)]
        prompts = prompts[: len(answers)]
    for rows in (int(r) for r in args.rows.split(",")):
        for refill in {"no": [False], "yes": [True], "both": [False, True]}[args.refill]:
            row = replay(prompts, answers, rows, refill, args.max_new_tokens)
            print(json.dumps(row), flush=True)
            if args.json_out:
                with open(args.json_out, "a") as file:
                    file.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
