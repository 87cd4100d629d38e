#!/usr/bin/env bash
# The paper's self-supervised row as one dependent chain (slurm/chain.sh): DINO pre-training ->
# k-NN and the linear probe of its teacher backbone (side by side, each after the pre-training) ->
# ADE20K linear segmentation with the backbone frozen (after both probes) -> python -m analysis.
#   bash slurm/chains/dino.sh MODEL [SBATCH FLAGS] [OVERRIDES]
#   bash slurm/chains/dino.sh vits_5L data.root=/data/imagenet seg.data.root=/data/ade
#   bash slurm/chains/dino.sh vits_0L --nodes=2 seed=1 data.root=/data/imagenet seg.data.root=/data/ade
# OVERRIDES go to the pre-training (experiment= too: dino_in1k unless given); data.root= also
# reaches both probes, as data=imagenet data.root=... (the DINO recipes train on ImageNet or on the
# built-in digits, the probes' default). knn.X=, linear.X=, probes.X= (both), seg.X= and
# analysis.X= go to that stage only, as X=. The probes run on one GPU, the segmentation on one
# node (its 40k iterations at batch 16 accumulate on fewer GPUs), the analysis on one GPU.
# Results: <stage 1>/eval/{knn_<data>,linear_<data>,seg_<data>_l<layers>}/results.json (where
# python -m analysis.tables finds them) and <stage 1>/ckpt/last_analysis/.
set -euo pipefail
usage="usage: bash slurm/chains/dino.sh MODEL [SBATCH FLAGS] [OVERRIDES]"
MODEL=${1:?$usage}
shift
flags=() pre=() knn=() linear=() seg=() analysis=() experiment=experiment=dino_in1k
for a in "$@"; do
  case $a in
    -*) flags+=("$a") ;;                 # sbatch flags: the pre-training's
    experiment=*) experiment=$a ;;
    data.root=*) pre+=("$a"); knn+=(data=imagenet "$a"); linear+=(data=imagenet "$a") ;;
    knn.*) knn+=("${a#knn.}") ;;
    linear.*) linear+=("${a#linear.}") ;;
    probes.*) knn+=("${a#probes.}"); linear+=("${a#probes.}") ;;
    seg.*) seg+=("${a#seg.}") ;;
    analysis.*) analysis+=("${a#analysis.}") ;;
    *) pre+=("$a") ;;
  esac
done
source "$(dirname "$0")/../config.sh"
one=(--nodes=1 --ntasks-per-node=1)  # one task; one GPU of the site's type where jobs have GPUs
[ "$LAPLACE_GPUS_PER_NODE" = 0 ] || one+=(--gpus-per-node="${LAPLACE_GPU_TYPE:+$LAPLACE_GPU_TYPE:}1")
exec bash "$(dirname "$0")/../chain.sh" \
  :: "${flags[@]}" train.sbatch "$experiment" "model=$MODEL" "${pre[@]}" \
  :: --after=1 --job-name=knn "${one[@]}" run.sbatch python -m eval.knn 'checkpoint={1}/ckpt/last.pt' "${knn[@]}" \
  :: --after=1 --job-name=linear "${one[@]}" run.sbatch python -m eval.linear 'checkpoint={1}/ckpt/last.pt' "${linear[@]}" \
  :: --after=2,3 --job-name=seg --nodes=1 run.sbatch python -m eval.segmentation 'checkpoint={1}/ckpt/last.pt' "${seg[@]}" \
  :: analysis.sbatch 'checkpoint={1}/ckpt/last.pt' "${analysis[@]}"
