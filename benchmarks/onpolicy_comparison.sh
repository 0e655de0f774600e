#!/usr/bin/env bash
# On-policy distillation against the target's own responses (docs/onpolicy.md): the same starting drafter (the shipped
# smollm2-135m-instruct-drafter), the same budget (steps x batch size sequences, learning rate, schedule), three
# data sets (the target's greedy responses, the drafter's own greedy responses scored by the target, and a GKD mix
# with λ = 0.5), three losses (forward KL, TVD, TVD++), plus one run that regenerates a pool of on-policy examples
# from the current drafter every 100 steps. Evaluation: held-out TVD on one common set of the target's responses to
# held-out ShareGPT prompts; τ of the drafter alone at γ 3 and 5, greedy and temperature 1, on Spec-Bench and the
# held-out ShareGPT prompts; τ against training tokens from each run's eval_log.csv.
# Every step resumes when rerun (distill-data by shard; finetune with --resume once a checkpoint exists).
# Usage: benchmarks/onpolicy_comparison.sh RUNS_DIR [SPEC_BENCH_QUESTIONS]
#   env: STEPS (default 600), LIMIT (prompts for on-policy and mixed data; default all 5,880 train prompts),
#        SPECDRAFT (the CLI), PYTHON (for the evaluation scripts)
set -euo pipefail
runs=${1:?usage: $0 RUNS_DIR [SPEC_BENCH_QUESTIONS]}
here=$(cd "$(dirname "$0")" && pwd)
Q=${2:-$here/../../shared/data/spec_bench/question.jsonl}
sd=${SPECDRAFT:-.venv/bin/specdraft}
py=${PYTHON:-.venv/bin/python}
T=smollm2-135m-instruct
D=smollm2-135m-instruct-drafter
STEPS=${STEPS:-600}
limit=${LIMIT:+--limit $LIMIT}
ALONE="prompt_lookup=0;prompt_lookup_alone=0;confidence_threshold=0"  # the drafter's model alone
mkdir -p "$runs" && cd "$runs"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
DATA="--target $T --prompts sharegpt --split train --max-new-tokens 128 --temperature 0 --top-logprobs 32 \
      --batch-size 32 --shard-size 64 --dtype bfloat16"

# (a) data: the target's greedy responses (as in benchmarks/smollm2_drafter.sh (d)), the drafter's (from its
#     8,192-token draft vocabulary, as it drafts) scored by the target, and the GKD mix; one common evaluation set
$sd distill-data $DATA --out dd-greedy
$sd distill-data $DATA --out dd-onpolicy --policy draft --draft $D $limit
$sd distill-data $DATA --out dd-mixed --policy mixed --mix-fraction 0.5 --draft $D $limit
$sd distill-data --target $T --prompts sharegpt --split heldout --limit 100 --max-new-tokens 128 --temperature 0 \
    --batch-size 32 --dtype bfloat16 --out dd-eval

# (b) fine-tuning: same drafter, same budget; p from the stored top-32 in every run
FT="--drafter $D --target $T --use-stored-topk --steps $STEPS --batch-size 16 --lr 5e-4 --warmup-steps 30 --bf16 \
    --target-dtype bfloat16 --checkpoint-every 100 --eval-every $((STEPS / 6)) --eval-prompts 4 \
    --eval-max-new-tokens 64 --export-dtype bfloat16 --freeze-embeddings --share-embeddings --draft-vocab 8192 \
    --log-every 20 --no-progress --draft-vocab-from $D"
finetune() {  # out, then flags; resumes from a checkpoint, skips a finished run
  local out=$1; shift
  [ -f "$out/model/config.json" ] && return 0
  local resume=""; [ -f "$out/checkpoint.pt" ] && resume=--resume
  $sd finetune $FT --out "$out" $resume "$@"
}
for data in greedy onpolicy mixed; do
  for loss in fkl tvd tvdpp; do
    finetune ft-$data-$loss --data dd-$data --loss $loss
  done
done
finetune ft-greedy-fkl-regen --data dd-greedy --loss fkl --regenerate-every 100 --regenerate-prompts 256 \
    --regenerate-temperature 1.0

models=$D
for out in ft-*/; do models="$models,${out%/}/model"; done

# (c1) held-out TVD and forward KL, every drafter on the same responses (the target's, held-out prompts)
$py "$here/heldout_tvd.py" --target $T --data dd-eval --drafters "$models" --out heldout_tvd.jsonl

# (c2) τ of the model alone at γ 3 and 5, greedy and temperature 1 (bf16, 128 new tokens)
methods="ar"
for m in ${models//,/ }; do methods="$methods,draft:$m;$ALONE"; done
for temp in 0 1; do
  $sd bench --out bench-op-specbench-t$temp --target $T --methods "$methods" --questions "$Q" --per-category 3 \
      --max-new-tokens 128 --dtype bfloat16 --temperature $temp --sweep num_draft_tokens=3,5
  $sd bench --out bench-op-sharegpt-t$temp --target $T --methods "$methods" --questions sharegpt-heldout \
      --per-category 18 --max-new-tokens 128 --dtype bfloat16 --temperature $temp --sweep num_draft_tokens=3,5
done

# (c3) τ (greedy, each run's own held-out prompts) against training tokens
for out in ft-*/; do echo "== ${out%/}"; cat "$out/eval_log.csv"; done
