#!/usr/bin/env bash
# The paper's language-model row as one dependent chain (slurm/chain.sh): pre-training on
# FineWeb-Edu token shards -> mid-training -> SFT, each from the previous stage's last.pt ->
# the benchmarks of the SFT model (python -m eval.lm) and python -m analysis of the pre-trained one.
#   bash slurm/chains/gpt_d20.sh MODEL [--allow-code-execution] [SBATCH FLAGS] [HYDRA OVERRIDES for the training stages]
#   bash slurm/chains/gpt_d20.sh gpt_d20_5L --allow-code-execution data.root=/data/fineweb_edu
#   bash slurm/chains/gpt_d20.sh gpt_d20_0L --nodes=2 seed=1 data.root=/data/fineweb_edu
# The benchmarks are laplace_chat (the paper's five tasks and their average) with
# --allow-code-execution (HumanEval runs model-written code), else its four other tasks. The
# mid-training / SFT sources and the benchmark data: configs/data/chat_*.yaml, EVAL_DATA_ROOT
# (a folder of local copies, passed as data_root=) or a filled HF cache.
set -euo pipefail
MODEL=${1:?usage: bash slurm/chains/gpt_d20.sh MODEL [--allow-code-execution] [SBATCH FLAGS] [HYDRA OVERRIDES]}
shift
tasks='tasks=[laplace_chat_arc_easy,laplace_chat_arc_challenge,laplace_chat_mmlu,laplace_chat_gsm8k]' code=()
flags=() pre=() rest=()
# The opt-in may come anywhere: it is ours, never sbatch's or Hydra's. data.root belongs to
# pre-training (the chat stages have their own data nodes).
for a in "$@"; do
  case $a in
    --allow-code-execution) tasks='tasks=[laplace_chat]' code=(allow_code_execution=true) ;;
    -*) flags+=("$a") ;;
    data.root=*) pre+=("$a") ;;
    *) rest+=("$a") ;;
  esac
done
source "$(dirname "$0")/../config.sh"
one=(--nodes=1 --ntasks-per-node=1)  # one task; one GPU of the site's type where jobs have GPUs
[ "$LAPLACE_GPUS_PER_NODE" = 0 ] || one+=(--gpus-per-node="${LAPLACE_GPU_TYPE:+$LAPLACE_GPU_TYPE:}1")
exec bash "$(dirname "$0")/../chain.sh" \
  :: "${flags[@]}" train.sbatch experiment=gpt_d20 "model=$MODEL" "${pre[@]}" "${rest[@]}" \
  :: "${flags[@]}" train.sbatch experiment=gpt_d20_mid "model=$MODEL" 'trainer.init_from={1}/ckpt/last.pt' "${rest[@]}" \
  :: "${flags[@]}" train.sbatch experiment=gpt_d20_sft "model=$MODEL" 'trainer.init_from={2}/ckpt/last.pt' "${rest[@]}" \
  :: "${one[@]}" run.sbatch python -m eval.lm 'checkpoint={3}/ckpt/last.pt' "$tasks" "${code[@]}" \
     ${EVAL_DATA_ROOT:+"data_root=$EVAL_DATA_ROOT"} \
  :: analysis.sbatch 'checkpoint={1}/ckpt/last.pt'
