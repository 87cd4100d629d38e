#!/usr/bin/env bash
# Every run of the paper with its estimated H200-hours, and any subset of them submitted through
# slurm/sweep.sh and slurm/chains/{gpt_d20,dino}.sh (scripts/paper_runs.py: the list, the cost
# rules and the measured rates they assume).
#   bash slurm/paper.sh                                        # one row per sweep and stage, totals
#   bash slurm/paper.sh --runs                                 # every run
#   bash slurm/paper.sh --only sweep=dino,k=0,k=5 --submit     # the sbatch lines of a subset (dry run)
#   bash slurm/paper.sh --only sweep=deit3_vitb,k=6 --submit --no-dry-run   # submitted
#   bash slurm/paper.sh --only sweep=gpt_d20 --submit --allow-code-execution -- data.root=/data/fineweb_edu
# After --: Hydra overrides for every selected run (costed with them too).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/slurm/config.sh"
# The venv of the jobs (slurm/config.sh), unless one is active already.
if [ -z "${VIRTUAL_ENV:-}" ]; then
  venv=$LAPLACE_VENV; [[ $venv == /* ]] || venv=$ROOT/$venv
  # shellcheck disable=SC1091
  source "$venv/bin/activate"
fi
exec python "$ROOT/scripts/paper_runs.py" "$@"
