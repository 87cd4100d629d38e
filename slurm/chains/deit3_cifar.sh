#!/usr/bin/env bash
# DeiT-III's CIFAR rows as a dependent chain (slurm/chain.sh): training from scratch at 32 px ->
# python -m analysis of its checkpoint.
#   bash slurm/chains/deit3_cifar.sh MODEL cifar100|cifar10 [SBATCH FLAGS] [HYDRA OVERRIDES]
#   bash slurm/chains/deit3_cifar.sh vitb_12L cifar100 --gpus-per-node=4 seed=2
set -euo pipefail
usage="usage: bash slurm/chains/deit3_cifar.sh MODEL cifar100|cifar10 [SBATCH FLAGS] [HYDRA OVERRIDES]"
MODEL=${1:?$usage} DATA=${2:?$usage}
shift 2
flags=()  # sbatch flags: the training stages' (the analysis keeps its one GPU)
while [ $# -gt 0 ] && [[ $1 == -* ]]; do flags+=("$1"); shift; done
exec bash "$(dirname "$0")/../chain.sh" \
  :: "${flags[@]}" train.sbatch "experiment=deit3_$DATA" "model=$MODEL" "$@" \
  :: analysis.sbatch 'checkpoint={1}/ckpt/last.pt'
