#!/usr/bin/env bash
# DistiLLM's skew KL and skew reverse KL (finetune --loss skl|srkl) against forward KL at one budget, on SmolLM2's
# own greedy answers: the shipped drafter's design (layers 0-1 of the target, embeddings frozen and shared, an
# 8,192-token draft vocabulary), p from the top-32 stored with the answers, the exact greedy τ (greedy_tau@γ) at the
# end on held-out greedy answers. Each step resumes when rerun.
# Usage: benchmarks/skew_kl.sh RUNS_DIR ANSWERS.jsonl.gz [TRAIN_ANSWERS] [STEPS]
#   ANSWERS: {"prompt", "answer_ids"} lines of the target's greedy answers (distill-data --answers); the first
#   TRAIN_ANSWERS (default 512) train, the last 64 are held out.
set -euo pipefail
runs=${1:?usage: $0 RUNS_DIR ANSWERS.jsonl.gz [TRAIN_ANSWERS] [STEPS]}
answers=$(realpath "${2:?usage: $0 RUNS_DIR ANSWERS.jsonl.gz [TRAIN_ANSWERS] [STEPS]}")
train=${3:-512}
steps=${4:-96}
sd=${SPECDRAFT:-$(realpath .venv/bin/specdraft)}
py=${PYTHON:-$(realpath .venv/bin/python)}
T=smollm2-135m-instruct
mkdir -p "$runs" && cd "$runs"

# the answers split in two files: training answers first, the last 64 held out
[ -f heldout.jsonl ] || "$py" - "$answers" "$train" <<'EOF'
import gzip, sys
lines = gzip.open(sys.argv[1], "rt").read().splitlines()
open("train.jsonl", "w").write("\n".join(lines[: int(sys.argv[2])]) + "\n")
open("heldout.jsonl", "w").write("\n".join(lines[-64:]) + "\n")
EOF
$sd distill-data --target $T --answers train.jsonl --out data --temperature 0 --max-new-tokens 256 \
    --top-logprobs 32 --batch-size 8 --shard-size 128 --dtype float32
$sd distill-data --target $T --answers heldout.jsonl --out heldout --temperature 0 --max-new-tokens 256 \
    --batch-size 8 --shard-size 128 --dtype float32
[ -d init/model ] || $sd init-drafter --target $T --layers 0,1 --out init

for loss in fkl skl srkl; do
  resume=(); [ -f ft-$loss/run.json ] && resume=(--resume)
  $sd finetune --drafter init/model --target $T --data data --use-stored-topk --eval-data heldout \
      --loss $loss --out ft-$loss --steps "$steps" --batch-size 8 --lr 1e-3 --warmup-steps 5 --group-by-length \
      --max-seq-len 576 --freeze-embeddings --share-embeddings --draft-vocab 8192 --eval-prompts 0 \
      --eval-num-draft-tokens 3,4 --checkpoint-every 16 --no-progress "${resume[@]}"
done
for loss in fkl skl srkl; do echo "== $loss"; cat ft-$loss/eval_log.csv; done
