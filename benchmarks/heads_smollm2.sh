#!/usr/bin/env bash
# Medusa and EAGLE heads for SmolLM2-135M-Instruct, exactly as run on the 2-core CPU, and the benchmark
# behind docs/results.md's heads section. Needs the distillation data of benchmarks/smollm2_drafter.sh step (b).
# Each training step resumes when rerun with --resume. Usage: benchmarks/heads_smollm2.sh RUNS_DIR
set -euo pipefail
runs=${1:?usage: $0 RUNS_DIR}
sd=${SPECDRAFT:-.venv/bin/specdraft}
T=smollm2-135m-instruct
mkdir -p "$runs" && cd "$runs"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

# EAGLE head (one Llama block + fc; the target's embeddings and LM head are used frozen, never stored)
$sd train-heads --kind eagle --target $T --data dd-sharegpt-train-t1 --allow-incomplete --out heads-eagle \
    --steps 700 --batch-size 8 --warmup-steps 30 --target-dtype bfloat16 --eval-every 350 --checkpoint-every 50 \
    --eval-prompts 4 --no-progress
# Medusa-1: 4 heads sharing the frozen LM head
$sd train-heads --kind medusa --num-heads 4 --target $T --data dd-sharegpt-train-t1 --allow-incomplete \
    --out heads-medusa --steps 200 --batch-size 8 --warmup-steps 20 --target-dtype bfloat16 --eval-every 100 \
    --checkpoint-every 25 --eval-prompts 4 --no-progress
# Medusa-2's self-distillation (soft labels from the frozen target), same budget
$sd train-heads --kind medusa --num-heads 4 --options distill=1 --target $T --data dd-sharegpt-train-t1 \
    --allow-incomplete --out heads-medusa-distill --steps 200 --batch-size 8 --warmup-steps 20 \
    --target-dtype bfloat16 --eval-every 100 --checkpoint-every 25 --eval-prompts 4 --no-progress

# The token ranking for draft_vocab (FR-Spec). train-heads now stores it at export; these heads were exported by the
# version before that, so it is written here from the same training split (every 20th prompt held out).
for h in heads-eagle heads-medusa heads-medusa-distill; do
  "$(dirname "$sd")/python" - "$h" <<'PY'
import sys
from specdraft.draft_vocab import rank_tokens, save_token_ranking
from specdraft.training.data.records import load_distill_records, split_by_prompt
train, _ = split_by_prompt(load_distill_records("dd-sharegpt-train-t1", allow_incomplete=True), 20)
save_token_ranking(sys.argv[1] + "/heads", rank_tokens((r["response_token_ids"] for r in train), 49152))
PY
done
