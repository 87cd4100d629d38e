#!/usr/bin/env bash
# sbatch with the site settings of slurm/config.sh (#SBATCH lines cannot read variables). Same
# order as sbatch itself; prints the job id.
#   bash slurm/submit.sh [SBATCH FLAGS] SCRIPT [SCRIPT ARGUMENTS]
#   bash slurm/submit.sh train.sbatch experiment=deit3_cifar100 model=vitb_12L
#   bash slurm/submit.sh --nodes=4 --time=12:00:00 train.sbatch experiment=deit3_in1k model=vitb_12L
#   bash slurm/submit.sh analysis.sbatch checkpoint=runs/.../ckpt/last.pt
#   bash slurm/submit.sh run.sbatch python -m <module> [overrides]      # any command, one task per GPU
# SCRIPT: a file in slurm/ or a path. SBATCH FLAGS come as --name=value (or -Nvalue) and win over
# config.sh, which wins over the script's #SBATCH lines. A script line `#LAPLACE max-gpus-per-node=1`
# caps config.sh's GPUs (and tasks) per node for that script. Jobs run in the repository
# (--chdir) and log to <LAPLACE_RUNS>/slurm/<job name>-<job id>.out.
# LAPLACE_DRY_RUN=1: print the sbatch command (stderr) and a made-up id instead of submitting.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/slurm/config.sh"

flags=()
while [ $# -gt 0 ] && [[ $1 == -* ]]; do flags+=("$1"); shift; done
[ $# -gt 0 ] || { echo "usage: bash slurm/submit.sh [SBATCH FLAGS] SCRIPT [ARGS...]" >&2; exit 2; }
script=$1; shift
[ -f "$script" ] || [ ! -f "$ROOT/slurm/$script" ] || script=$ROOT/slurm/$script
if [ ! -f "$script" ]; then
  echo "submit.sh: no sbatch script '$script' here or in slurm/ (give sbatch flags as --name=value)" >&2; exit 2
fi

gpus=$LAPLACE_GPUS_PER_NODE tasks=$LAPLACE_TASKS_PER_NODE
cap=$(sed -n 's/^#LAPLACE max-gpus-per-node=\([0-9]*\).*/\1/p' "$script")
if [ -n "$cap" ] && [ "$gpus" -gt "$cap" ]; then gpus=$cap tasks=$(( cap > 0 ? cap : 1 )); fi
[ "$gpus" = 0 ] || gpus=${LAPLACE_GPU_TYPE:+$LAPLACE_GPU_TYPE:}$gpus

runs=$LAPLACE_RUNS; [[ $runs == /* ]] || runs=$ROOT/$runs
site=(--chdir="$ROOT" --output="$runs/slurm/%x-%j.out" --gpus-per-node="$gpus" --ntasks-per-node="$tasks"
      --cpus-per-task="$LAPLACE_CPUS_PER_TASK" --time="$LAPLACE_TIME"
      ${LAPLACE_ACCOUNT:+--account="$LAPLACE_ACCOUNT"} ${LAPLACE_PARTITION:+--partition="$LAPLACE_PARTITION"})
read -r -a extra <<< "$LAPLACE_SBATCH_EXTRA"
cmd=(sbatch --parsable "${site[@]}" "${extra[@]}" "${flags[@]}" "$script" "$@")
if [ "${LAPLACE_DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${cmd[@]}" >&2; echo >&2
  echo "dry$$"
else
  if ! command -v sbatch > /dev/null; then  # not bash's "sbatch: command not found" (status 127)
    echo "submit.sh: Slurm's sbatch is not on the PATH: submit from the cluster's login node (or load its" \
      "Slurm module); LAPLACE_DRY_RUN=1 prints the sbatch command instead" >&2; exit 1
  fi
  mkdir -p "$runs/slurm"  # sbatch does not create the log's folder: the log would be lost
  "${cmd[@]}" | cut -d';' -f1  # --parsable: "id" or "id;cluster"
fi
