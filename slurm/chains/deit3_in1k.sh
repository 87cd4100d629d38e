#!/usr/bin/env bash
# DeiT-III's ImageNet-1k row as one dependent chain (slurm/chain.sh): 800 epochs at 192 px ->
# 20 epochs at 224 px from its last.pt -> python -m analysis of the final checkpoint.
#   bash slurm/chains/deit3_in1k.sh MODEL [SBATCH FLAGS] [HYDRA OVERRIDES for both training stages]
#   bash slurm/chains/deit3_in1k.sh vitb_12L
#   bash slurm/chains/deit3_in1k.sh vitb_0L --nodes=4 seed=1
# Folders: <LAPLACE_RUNS>/chains/deit3_in1k_<MODEL>[_<overrides>]/{1_deit3_in1k,2_deit3_in1k_ft224}.
set -euo pipefail
MODEL=${1:?usage: bash slurm/chains/deit3_in1k.sh MODEL [SBATCH FLAGS] [HYDRA OVERRIDES]}
shift
flags=()  # sbatch flags: the training stages' (the analysis keeps its one GPU)
while [ $# -gt 0 ] && [[ $1 == -* ]]; do flags+=("$1"); shift; done
exec bash "$(dirname "$0")/../chain.sh" \
  :: "${flags[@]}" train.sbatch experiment=deit3_in1k "model=$MODEL" "$@" \
  :: "${flags[@]}" train.sbatch experiment=deit3_in1k_ft224 "model=$MODEL" 'trainer.init_from={1}/ckpt/last.pt' "$@" \
  :: analysis.sbatch 'checkpoint={2}/ckpt/last.pt'
