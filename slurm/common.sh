# shellcheck shell=bash
# Sourced by slurm/*.sbatch inside the job, from the repository (sbatch runs a spooled copy of the
# script in the submit folder or --chdir, so $0 says nothing about where the repository is):
# the site settings (config.sh), the environment, and run_or_requeue (requeue.sh).
if [ ! -f slurm/config.sh ] || [ ! -f train.py ]; then
  echo "run sbatch from the laplace repository, or pass --chdir=<repository> (slurm/submit.sh does)" >&2; exit 1
fi
source slurm/config.sh
# shellcheck disable=SC1091
source "$LAPLACE_VENV/bin/activate"
source slurm/requeue.sh
export OMP_NUM_THREADS=1  # one task per GPU; data-loader workers bring their own parallelism
