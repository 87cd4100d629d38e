# Sourced by the sbatch scripts. `run_or_requeue CMD...` runs CMD (an srun line). A run stopped
# by the scheduler's warning signal (#SBATCH --signal=USR1@120, which reaches the srun tasks) or
# by SIGTERM finishes its step, writes last.pt and exits with 75 (train/signals.py EXIT_REQUEUE):
# then this job is requeued and ends; the requeued job runs the same command and resumes.
EXIT_REQUEUE=75

run_or_requeue() {
  local rc=0
  "$@" || rc=$?
  if [ "$rc" -eq "$EXIT_REQUEUE" ]; then
    echo "[laplace] stopped on a signal with last.pt written: requeueing job ${SLURM_JOB_ID:-?}"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
  fi
  return "$rc"
}
