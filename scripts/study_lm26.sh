#!/usr/bin/env bash
# The decisive LM experiment (docs/study_lm26.md, issue 55): its four steps as declared, in one command
# that may be re-run after any stop (finished runs are only re-evaluated, stopped ones resume).
#   bash scripts/study_lm26.sh               # CPU: two runs at a time, one thread each (~16 thread-hours)
#   JOBS=8 bash scripts/study_lm26.sh        # one GPU: eight runs share it
# Environment: JOBS (runs at a time), RUNS= (the runs' root, default runs), DOCS= (the report's folder,
# default docs/study_lm26), STEPS=N (a smoke test of the pipeline, with RUNS and DOCS elsewhere: every
# run N steps of 8 sequences, 4 evaluations of 16,384 tokens; its numbers are not the study's).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${VIRTUAL_ENV:-}" ] || source scripts/env.sh  # an active environment is used as it is
JOBS=${JOBS:-2}
export LAPLACE_RUNS=${RUNS:-runs} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
docs=${DOCS:-docs/study_lm26}
data=${LAPLACE_DATA:-data}/stdlib_bpe1k
# the smoke-test overrides, with a leading blank when set: xargs -L joins a line that ends in a blank
# to the next, so no line may end in one
extra=${STEPS:+ trainer.max_steps=$STEPS trainer.eval_every=$((STEPS / 4)) trainer.ckpt_every=$STEPS trainer.keep_every=$STEPS trainer.global_batch_size=8 data.val_tokens=16384}
mkdir -p "$LAPLACE_RUNS/logs"

train() {  # one run per line of overrides on stdin, JOBS at a time; a failed run stops the script when
  # the stage's other runs end (xargs exits 123, set -e)
  xargs -P "$JOBS" -L 1 sh -c 'echo "\$ python train.py -m $*"; exec python train.py -m "$@"' train \
    >> "$LAPLACE_RUNS/logs/study_lm26.log" 2>&1
}

# 0. the data (once): our BPE of Python's standard library at vocabulary 1,024
[ -f "$data/meta.json" ] || python prepare.py source=stdlib vocab_size=1024 "out=$data" progress=false

# 1. the 12 pilots: each arm at the learning-rate factors 0.5, 1, 2 on seeds 100 and 101
for m in gpt26_d4_0L gpt26_d4_2L; do for f in 0.5 1 2; do for s in 100 101; do
  echo "experiment=study_lm26_pilot model=$m optim.lr_factor=$f seed=$s$extra"
done; done; done | train

# 2. each arm's factor: the lowest mean over the two pilot seeds of the mean val bpb over the last
# four evaluations (steps 1,300-1,600); the middle factor (1) when within 0.002 bpb of that lowest
read -r f0 f2 < <(python - "$LAPLACE_RUNS/gpt/study_lm26_pilot" <<'PY'
import json, sys
from pathlib import Path
import pandas as pd
from omegaconf import OmegaConf
rows = []
for d in sorted(Path(sys.argv[1]).glob("*/results.json")):
    c = OmegaConf.load(d.with_name("config.yaml"))
    # by step: a re-evaluated finished run repeats its last step's value
    val = {r["step"]: r["val_bpb"] for r in map(json.loads, d.with_name("metrics.jsonl").open()) if r.get("split") == "val"}
    rows.append(dict(k=c.model.num_laplacian_heads, factor=float(c.optim.lr_factor), seed=c.seed,
                     endpoint=sum(val[s] for s in sorted(val)[-4:]) / 4))
keys = [(r["k"], r["factor"], r["seed"]) for r in rows]
declared = {(k, f, s) for k in (0, 2) for f in (0.5, 1.0, 2.0) for s in (100, 101)}
if len(set(keys)) < len(keys) or not set(keys) <= declared:  # a run beside them would enter the means
    sys.exit(f"{sys.argv[1]}: holds finished runs other than the 12 declared pilots once each "
             f"{sorted(set(keys) - declared) or 'twice'}: move the others out")
if len(keys) < 12:
    sys.exit(f"{sys.argv[1]}: {len(keys)} of the 12 pilots finished; re-run this script to finish them")
t = pd.DataFrame(rows).pivot_table(index=["k", "factor"], columns="seed", values="endpoint")
t["mean"] = t.mean(axis=1)
print(t.to_string(float_format="%.4f"), file=sys.stderr)
best = [t.loc[k, "mean"].idxmin() if t.loc[(k, 1.0), "mean"] - t.loc[k, "mean"].min() > 0.002 else 1.0
        for k in (0, 2)]
print(*(f"{f:g}" for f in best))
PY
)
[ -n "${f2:-}" ] || exit 1  # the pilots are unfinished (said above)
echo "learning-rate factors: k=0 x$f0, k=2 x$f2" | tee -a "$LAPLACE_RUNS/logs/study_lm26.log"

# 3. the 8 paired seeds, seed by seed (a stop leaves whole pairs), each arm at its factor
for s in 0 1 2 3 4 5 6 7; do
  echo "experiment=study_lm26 model=gpt26_d4_0L optim.lr_factor=$f0 seed=$s$extra"
  echo "experiment=study_lm26 model=gpt26_d4_2L optim.lr_factor=$f2 seed=$s$extra"
done | train

# 4. the geometry of every kept checkpoint, then the report
python -m analysis "checkpoint='$LAPLACE_RUNS/gpt/study_lm26/*/ckpt/step_*.pt'" max_tokens=131072 layers=all \
  figures=false progress=false skip_done=true
python -m analysis.report "runs='$LAPLACE_RUNS/gpt/study_lm26'" plan=study_lm26 "out='$docs'"
