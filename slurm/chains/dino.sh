#!/usr/bin/env bash
# The paper's self-supervised row as one dependent chain (slurm/chain.sh): DINO pre-training ->
# k-NN and the linear probe of its teacher backbone (side by side, each after the pre-training) ->
# ADE20K linear segmentation with the backbone frozen (after both probes) -> python -m analysis.
#   bash slurm/chains/dino.sh MODEL [SBATCH FLAGS] [OVERRIDES]
#   bash slurm/chains/dino.sh vits_5L data.root=/data/imagenet seg.data.root=/data/ade
#   bash slurm/chains/dino.sh vits_0L --nodes=2 seed=1 data.root=/data/imagenet seg.data.root=/data/ade
# OVERRIDES go to the pre-training (experiment= too: dino_in1k unless given). After dino_in1k the
# probes run on ImageNet, data=imagenet with the pre-training's data.root= if one is given (else
# configs/data's <LAPLACE_DATA>/imagenet); after another experiment on their default, the built-in
# digits (probes.data=... for others). knn.X=, linear.X=, probes.X= (both), seg.X= and analysis.X=
# go to that stage only, as X=; the segmentation's ADE20K is seg.data.root= (else
# <LAPLACE_DATA>/ade). The probes run on one GPU, the segmentation on one node (its 40k iterations
# at batch 16 accumulate on fewer GPUs), the analysis on one GPU. Every stage requeues itself on
# the time-limit warning or preemption (slurm/requeue.sh): the pre-training and the segmentation
# (the training engine) resume from their last.pt, k-NN and the linear probe reuse cached features.
# Results: <stage 1>/eval/{knn_<data>,linear_<data>,seg_<data>_l<layers>}/results.json (where
# python -m analysis.tables finds them) and <stage 1>/ckpt/last_analysis/.
set -euo pipefail
usage="usage: bash slurm/chains/dino.sh MODEL [SBATCH FLAGS] [OVERRIDES]"
MODEL=${1:?$usage}
shift
flags=() pre=() root=() knn=() linear=() seg=() analysis=() experiment=experiment=dino_in1k
for a in "$@"; do
  case $a in
    -*) flags+=("$a") ;;                 # sbatch flags: the pre-training's
    experiment=*) experiment=$a ;;
    data.root=*) pre+=("$a"); root=("$a") ;;
    knn.*) knn+=("${a#knn.}") ;;
    linear.*) linear+=("${a#linear.}") ;;
    probes.*) knn+=("${a#probes.}"); linear+=("${a#probes.}") ;;
    seg.*) seg+=("${a#seg.}") ;;
    analysis.*) analysis+=("${a#analysis.}") ;;
    *) pre+=("$a") ;;
  esac
done
if [ "$experiment" = experiment=dino_in1k ]; then
  knn=(data=imagenet "${root[@]}" "${knn[@]}") linear=(data=imagenet "${root[@]}" "${linear[@]}")
fi
source "$(dirname "$0")/../config.sh"
one=(--nodes=1 --ntasks-per-node=1)  # one task; one GPU of the site's type where jobs have GPUs
[ "$LAPLACE_GPUS_PER_NODE" = 0 ] || one+=(--gpus-per-node="${LAPLACE_GPU_TYPE:+$LAPLACE_GPU_TYPE:}1")
exec bash "$(dirname "$0")/../chain.sh" \
  :: "${flags[@]}" train.sbatch "$experiment" "model=$MODEL" "${pre[@]}" \
  :: --after=1 --job-name=knn "${one[@]}" run.sbatch python -m eval.knn 'checkpoint={1}/ckpt/last.pt' "${knn[@]}" \
  :: --after=1 --job-name=linear "${one[@]}" run.sbatch python -m eval.linear 'checkpoint={1}/ckpt/last.pt' "${linear[@]}" \
  :: --after=2,3 --job-name=seg --nodes=1 run.sbatch python -m eval.segmentation 'checkpoint={1}/ckpt/last.pt' "${seg[@]}" \
  :: analysis.sbatch 'checkpoint={1}/ckpt/last.pt' "${analysis[@]}"
