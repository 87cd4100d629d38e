# shellcheck shell=bash
# Sourced by the sbatch scripts (slurm/common.sh) and by the job script of the Hydra launcher
# (configs/hydra/launcher/cluster.yaml wraps srun in it). `run_or_requeue CMD...` runs CMD (an
# srun line). A run stopped by the scheduler's warning signal (#SBATCH --signal=USR1@120, which
# reaches the srun tasks) or by a SIGTERM that reaches the tasks finishes its step, writes last.pt
# and exits with 75 (train/signals.py EXIT_REQUEUE): then this job is requeued and ends; the
# requeued job runs the same command and resumes. A signal that lands before Python has installed
# its handlers (while it imports) kills the tasks with 128 + signal (138 USR1, 143 TERM): requeued
# too, the new job resumes from whatever last.pt exists. Seen on Slurm 22.05: srun returns the
# tasks' highest status, and --kill-on-bad-exit=1 terminates the step as soon as one task ends
# non-zero, 75 included (SIGTERM to the others, SIGKILL KillWait seconds later, which would read
# 137): the ranks therefore leave together after a last barrier, keep their stop handler until
# they exit, and their data workers ignore the signal. A whole-job cancel (scancel --full, or the time limit itself) SIGKILLs
# the tasks after KillWait: no checkpoint, no requeue; hence the warning signal well before it.
EXIT_REQUEUE=75

run_or_requeue() {
  local rc=0
  "$@" || rc=$?
  if [ "$rc" -eq "$EXIT_REQUEUE" ] || [ "$rc" -eq 138 ] || [ "$rc" -eq 143 ]; then
    echo "[laplace] stopped on a signal with last.pt written: requeueing job ${SLURM_JOB_ID:-?}"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
  fi
  return "$rc"
}
