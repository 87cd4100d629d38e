"""Preemption: SIGUSR1 / SIGTERM ask a run to stop at the end of its step and be requeued.

On a cluster the scheduler warns a job before its time limit or preemption (Slurm:
`#SBATCH --signal=USR1@120` for the warning, SIGTERM at the end, SIGKILL KillWait seconds later,
30 by default). The main process only records the request (`StopRequest`); the engine finishes
the step in flight, agrees with every rank on the step to stop at (train.dist.StopVote), writes
`last.pt`, shuts its workers down and exits with `EXIT_REQUEUE`, which slurm/*.sbatch and
train.launch turn into a requeue. The requeued job runs the same command and resumes exactly.
"""
import signal
import threading

# sysexits.h EX_TEMPFAIL: "a temporary failure; the user is invited to retry".
EXIT_REQUEUE = 75
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class Preempted(SystemExit):
    """Raised by the engine after the preemption checkpoint: the process exits with
    EXIT_REQUEUE (SystemExit passes through Hydra and our CLI wrapper untouched)."""

    def __init__(self, step: int, signum: int):
        super().__init__(EXIT_REQUEUE)
        self.step, self.signum = step, signum


class StopRequest:
    """A context manager that turns SIGUSR1 / SIGTERM into a flag (`signum`, None until one
    arrives) and restores the previous handlers on exit, except when leaving with `Preempted`:
    the process is about to exit 75, and a second signal meanwhile (srun terminating the step
    once its first task has ended) must not turn that status into 143. Outside the main thread
    (where Python cannot install handlers) it stays inert."""

    def __init__(self, signals=SIGNALS):
        self.signals, self.signum, self._previous = signals, None, {}

    def _handler(self, signum, frame):
        self.signum = signum

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, exc_type, exc, tb):
        if not isinstance(exc, Preempted):  # leaving with Preempted: the handlers stay (see above)
            for s, handler in self._previous.items():
                signal.signal(s, handler)
        self._previous = {}


def ignore_in_worker(worker_id: int):
    """worker_init_fn of the engine's data loaders: the stop signals are the main process's to act on."""
    # Slurm signals every process of the job step, and launchers the whole process group: the
    # data-loader workers get the signal too. torch's worker would die of SIGTERM and take the main
    # process down with "DataLoader worker is killed by signal" mid-checkpoint. Ignoring it, the
    # workers are stopped by the engine's own shutdown (train.feeds.MapFeed.close), since
    # DataLoader's falls back to SIGTERM.
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)
