#!/usr/bin/env bash
# One job per (model, seed): a sweep over the number of Laplacian heads. Prints the job ids, one
# per line (stdout); what each one runs goes to stderr.
#   bash slurm/sweep.sh --models vitb_0L,vitb_6L,vitb_12L --seeds 0,1,2 -- experiment=deit3_cifar100
#   bash slurm/sweep.sh --heads 0,3,6,9,12 --arch vitb --seeds 0 --time=24:00:00 -- experiment=deit3_cifar100
#   bash slurm/sweep.sh --models gpt_d12_0L,gpt_d12_6L --script run.sbatch -- python train.py experiment=...
# --models A,B | --heads K,K [--arch vitb] (models <arch>_<K>L); --seeds (default 0); --script
# (default train.sbatch: any script that takes Hydra overrides; model=, seed= are appended to its
# arguments); other --name=value flags go to sbatch. After --: the script's arguments.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
usage="usage: bash slurm/sweep.sh --models A,B | --heads K,K [--arch vitb] [--seeds 0,1] [--script S] [SBATCH FLAGS] -- ARGS"
models='' heads='' arch=vitb seeds=0 script=train.sbatch flags=()
while [ $# -gt 0 ]; do
  case $1 in
    --models) models=$2; shift 2 ;;   --models=*) models=${1#*=}; shift ;;
    --heads) heads=$2; shift 2 ;;     --heads=*) heads=${1#*=}; shift ;;
    --arch) arch=$2; shift 2 ;;       --arch=*) arch=${1#*=}; shift ;;
    --seeds) seeds=$2; shift 2 ;;     --seeds=*) seeds=${1#*=}; shift ;;
    --script) script=$2; shift 2 ;;   --script=*) script=${1#*=}; shift ;;
    --) shift; break ;;
    -*) flags+=("$1"); shift ;;
    *) echo "sweep.sh: '$1' before --; $usage" >&2; exit 2 ;;
  esac
done
if [ -n "$heads" ]; then models=$(IFS=,; for k in $heads; do printf '%s,' "${arch}_${k}L"; done); models=${models%,}; fi
[ -n "$models" ] || { echo "$usage" >&2; exit 2; }

IFS=, read -r -a models <<< "$models"
IFS=, read -r -a seeds <<< "$seeds"
for model in "${models[@]}"; do
  for seed in "${seeds[@]}"; do
    id=$(bash "$ROOT/slurm/submit.sh" --job-name="${model}_s$seed" "${flags[@]}" "$script" "$@" "model=$model" "seed=$seed")
    echo "$id"
    echo "[sweep] job $id: $script $* model=$model seed=$seed" >&2
  done
done
