#!/usr/bin/env bash
# The paper's language-model row as one dependent chain (slurm/chain.sh): pre-training on
# FineWeb-Edu token shards -> mid-training -> SFT, each from the previous stage's last.pt ->
# python -m analysis of the pre-trained model.
#   bash slurm/chains/gpt_d20.sh MODEL [SBATCH FLAGS] [HYDRA OVERRIDES for the training stages]
#   bash slurm/chains/gpt_d20.sh gpt_d20_5L data.root=/data/fineweb_edu
#   bash slurm/chains/gpt_d20.sh gpt_d20_0L --nodes=2 seed=1 data.root=/data/fineweb_edu
# The mid-training and SFT stages read their task folders / hub ids from configs/data/chat_*.yaml.
set -euo pipefail
MODEL=${1:?usage: bash slurm/chains/gpt_d20.sh MODEL [SBATCH FLAGS] [HYDRA OVERRIDES]}
shift
flags=() pre=() rest=()
while [ $# -gt 0 ] && [[ $1 == -* ]]; do flags+=("$1"); shift; done
# data.root belongs to pre-training (the chat stages have their own data nodes).
for a in "$@"; do if [[ $a == data.root=* ]]; then pre+=("$a"); else rest+=("$a"); fi; done
exec bash "$(dirname "$0")/../chain.sh" \
  :: "${flags[@]}" train.sbatch experiment=gpt_d20 "model=$MODEL" "${pre[@]}" "${rest[@]}" \
  :: "${flags[@]}" train.sbatch experiment=gpt_d20_mid "model=$MODEL" 'trainer.init_from={1}/ckpt/last.pt' "${rest[@]}" \
  :: "${flags[@]}" train.sbatch experiment=gpt_d20_sft "model=$MODEL" 'trainer.init_from={2}/ckpt/last.pt' "${rest[@]}" \
  :: analysis.sbatch 'checkpoint={1}/ckpt/last.pt'
