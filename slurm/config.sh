# shellcheck shell=bash
# Site settings of every laplace Slurm job: edit once per cluster. A variable already set in the
# environment wins over the value here (LAPLACE_PARTITION=debug bash slurm/submit.sh ...), and an
# sbatch flag given to submit.sh / sweep.sh / chain.sh wins over both (--time=2:00:00).
# Read by slurm/submit.sh, sweep.sh, chain.sh (sbatch flags), by the sbatch scripts in the job
# (venv, data and runs roots) and, once sourced in your shell, by the Hydra launcher:
#   source slurm/config.sh && python train.py -m hydra/launcher=cluster model=vitb_0L,vitb_12L seed=0,1,2

: "${LAPLACE_ACCOUNT:=}"           # --account; empty: your default account
: "${LAPLACE_PARTITION:=}"         # --partition; empty: the cluster's default partition
: "${LAPLACE_GPUS_PER_NODE:=8}"    # GPUs of a training job per node, one task each; 0: CPU-only jobs
: "${LAPLACE_GPU_TYPE:=}"          # e.g. h100 -> --gpus-per-node=h100:8; empty: any type
: "${LAPLACE_CPUS_PER_TASK:=10}"   # CPUs per task (= per GPU); also the data-loader workers of each task
: "${LAPLACE_TIME:=48:00:00}"      # time limit, [D-]HH:MM:SS; 2 min before it a run saves and requeues
: "${LAPLACE_VENV:=.venv}"         # the environment the jobs activate (relative to the repository or absolute)
: "${LAPLACE_DATA:=data}"          # datasets: <data>/imagenet, <data>/cifar (configs/paths, configs/data)
: "${LAPLACE_RUNS:=runs}"          # run directories; Slurm's logs go to <runs>/slurm/<job name>-<job id>.out
: "${LAPLACE_SBATCH_EXTRA:=}"      # any other sbatch flags, e.g. "--qos=high --constraint=a100 --mem=0"

# Derived, not for editing: one task per GPU (one for a CPU-only job; more: --ntasks-per-node=N),
# sbatch's GPU request, and the time limit in minutes for submitit (configs/hydra/launcher/cluster.yaml).
_laplace_minutes() {  # a Slurm time: [D-]HH[:MM[:SS]] or MM[:SS] -> minutes, rounded up
  local t=$1 d=0 a b c
  if [[ $t == *-* ]]; then
    d=${t%%-*}; IFS=: read -r a b c <<< "${t#*-}"
    echo $(( d * 1440 + 10#$a * 60 + 10#${b:-0} + (10#${c:-0} > 0) ))
  else
    IFS=: read -r a b c <<< "$t"
    if [ -n "$c" ]; then echo $(( 10#$a * 60 + 10#$b + (10#$c > 0) )); else echo $(( 10#$a + (10#${b:-0} > 0) )); fi
  fi
}
LAPLACE_TASKS_PER_NODE=$(( LAPLACE_GPUS_PER_NODE > 0 ? LAPLACE_GPUS_PER_NODE : 1 ))
LAPLACE_GPUS_SPEC=$LAPLACE_GPUS_PER_NODE
[ "$LAPLACE_GPUS_PER_NODE" = 0 ] || LAPLACE_GPUS_SPEC=${LAPLACE_GPU_TYPE:+$LAPLACE_GPU_TYPE:}$LAPLACE_GPUS_PER_NODE
LAPLACE_TIME_MIN=$(_laplace_minutes "$LAPLACE_TIME")
unset -f _laplace_minutes
export LAPLACE_ACCOUNT LAPLACE_PARTITION LAPLACE_GPUS_PER_NODE LAPLACE_GPU_TYPE LAPLACE_CPUS_PER_TASK \
  LAPLACE_TIME LAPLACE_VENV LAPLACE_DATA LAPLACE_RUNS LAPLACE_SBATCH_EXTRA LAPLACE_TASKS_PER_NODE \
  LAPLACE_GPUS_SPEC LAPLACE_TIME_MIN
# Empty means "not set": gone from the environment, so the Hydra launcher's ${oc.env:...,null} is null.
[ -n "$LAPLACE_ACCOUNT" ] || unset LAPLACE_ACCOUNT
[ -n "$LAPLACE_PARTITION" ] || unset LAPLACE_PARTITION
