#!/usr/bin/env bash
# The miniature reproduction: DeiT-III, GPT and DINO at CPU size, then the analyses and the report.
#   bash scripts/miniature.sh short    # DeiT-III + GPT, 0 / middle / all heads + learned, 3 seeds, ~25 min on 2 cores
#   bash scripts/miniature.sh long     # + DINO, trained until flat, 5 seeds, ~2.5 h (two runs at a time)
#   bash scripts/miniature.sh study    # the paper's arms, 64-token QK-norm ViTs, 4 seeds, ~1.5 h
# Environment: SEEDS=0,1 (the seeds), JOBS=1|2 (runs at a time, one thread each), RUNS= (the runs'
# root, default runs/miniature_<profile>), DOCS= (the report's folder, default docs/miniature/<profile>),
# STEPS=2 (every run 2 steps: a smoke test).
# Three stages, each a plain command printed before it runs:
#   1. train: Hydra multiruns of the profile's recipes (configs/experiment/{mini,study}_*.yaml);
#      a finished run only re-evaluates its last checkpoint, an interrupted one resumes;
#   2. measure: DINO's 20-NN and linear probe (and the 20-NN of every kept checkpoint: DINO's
#      learning curve), then `python -m analysis` of every last.pt not analysed yet;
#   3. report: `python -m analysis.report` by the profile's declared plan (configs/plan/<profile>.yaml).
set -euo pipefail
[ "${1:-}" != --profile ] || shift  # the earlier spelling: bash scripts/miniature.sh --profile long
profile=${1:-short}
case $profile in  # the sweeps: an experiment, its models, and the learned arm apart
  short) seeds=0,1,2 jobs=1
    sweeps=("experiment=mini_vit model=vitt_0L,vitt_1L,vitt_3L"
            "experiment=mini_vit model=vitt_1L model.laplacian_mode=learned"
            "experiment=mini_gpt model=gpt_d4_0L,gpt_d4_1L,gpt_d4_2L"
            "experiment=mini_gpt model=gpt_d4_1L model.laplacian_mode=learned") ;;
  long) seeds=0,1,2,3,4 jobs=2
    sweeps=("experiment=mini_vit_long model=vitt_0L,vitt_1L,vitt_3L"
            "experiment=mini_vit_long model=vitt_1L model.laplacian_mode=learned"
            "experiment=mini_gpt_long model=gpt_d3_0L,gpt_d3_1L,gpt_d3_2L"
            "experiment=mini_gpt_long model=gpt_d3_1L model.laplacian_mode=learned"
            "experiment=mini_dino_long model=vits_0L,vits_3L,vits_6L"
            "experiment=mini_dino_long model=vits_3L model.laplacian_mode=learned") ;;
  study) seeds=0,1,2,3 jobs=2
    sweeps=("experiment=study_vit model=vitt_0L,vitt_1L,vitt_3L"
            "experiment=study_vit_avg model=vitt_0L,vitt_3L"
            "experiment=mini_gpt_long model=gpt_d3_0L,gpt_d3_1L"
            "experiment=mini_dino_long model=vits_0L,vits_5L") ;;
  *) echo "usage: bash scripts/miniature.sh [short|long|study]" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
[ -n "${VIRTUAL_ENV:-}" ] || source scripts/env.sh  # an active environment is used as it is
SEEDS=${SEEDS:-$seeds} JOBS=${JOBS:-$jobs}
export LAPLACE_RUNS=${RUNS:-runs/miniature_$profile}
docs=${DOCS:-docs/miniature/$profile}
extra=(${STEPS:+trainer.max_steps=$STEPS})
mkdir -p "$LAPLACE_RUNS/logs" "$docs"

run() { echo "\$ $*" | tee -a "$docs/commands.log"; "$@"; }

train() {  # every sweep over the seeds $1, the seeds outermost: a stopped profile leaves whole seeds
  for s in "${sweeps[@]}"; do
    # shellcheck disable=SC2086  # a sweep's overrides are words
    run python train.py -m "seed=$1" $s "${extra[@]}"
  done
}

# 1. train (the GPT's BPE shards first; prepare.py writes them once)
if [ "$profile" != short ]; then run python prepare.py source=stdlib vocab_size=4096 progress=false; fi
if [ "$JOBS" -gt 1 ]; then  # two chains of the seeds (odd / even places), one thread each, as two runs fit 2 cores
  export OMP_NUM_THREADS=1
  IFS=, read -ra all <<< "$SEEDS"
  pids=()
  for half in 0 1; do
    mine=$(for i in "${!all[@]}"; do [ $((i % 2)) = $half ] && echo "${all[$i]}"; done | paste -sd,)
    [ -n "$mine" ] && { train "$mine" > "$LAPLACE_RUNS/logs/chain_$half.log" 2>&1 & pids+=($!); }
  done
  for p in "${pids[@]}"; do wait "$p"; done  # set -e: a failed chain stops the profile here
else
  train "$SEEDS"
fi

# 2. measure. Values are quoted for Hydra: a learned run's folder name holds an "=".
for r in "$LAPLACE_RUNS"/dino/*/*/; do
  [ -f "$r/results.json" ] || continue
  [ -f "$r/eval/knn_digits/results.json" ] || run python -m eval.knn "checkpoint='$r/ckpt/last.pt'" num_workers=0
  [ -f "$r/eval/linear_digits/results.json" ] || run python -m eval.linear "checkpoint='$r/ckpt/last.pt'" num_workers=0
  for c in "$r"/ckpt/step_*.pt; do  # DINO has no validation loss: its learning curve is the 20-NN
    [ ! -e "$c" ] || [ -f "${c%.pt}_knn/results.json" ] ||
      run python -m eval.knn "checkpoint='$c'" "run_dir='${c%.pt}_knn'" num_workers=0 cache=false
  done
done
for exp in "$LAPLACE_RUNS"/*/*/; do  # one analysis per experiment (like with like), missing ones only
  ls "$exp"*/ckpt/last.pt > /dev/null 2>&1 || continue
  args=()
  [ "$(basename "$exp")" = mini_gpt_long ] && args=(max_tokens=131072)  # the first 131,072 validation tokens
  run python -m analysis "checkpoint='$exp*/ckpt/last.pt'" layers=all figures=false progress=false \
    skip_done=true "analysis_out='${exp}compare'" "${args[@]}"
done

# 3. report
run python -m analysis.report "runs='$LAPLACE_RUNS'" "plan=$profile" "out='$docs'"
