"""Preemption: SIGUSR1 / SIGTERM ask a run to stop at the end of its step and be requeued.

On a cluster the scheduler warns a job before its time limit or preemption (Slurm:
`#SBATCH --signal=USR1@120` for the warning, SIGTERM at the end). The handler only records
the request; the engine finishes the optimizer step in flight, agrees with every rank on
stopping (one rank may get the signal first), writes `last.pt` and exits with
`EXIT_REQUEUE`, which slurm/*.sbatch turns into `scontrol requeue`. The requeued job runs
the same command and resumes exactly.
"""
from __future__ import annotations

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
    arrives) and restores the previous handlers on exit. Outside the main thread (where
    Python cannot install handlers) it stays inert."""

    def __init__(self, signals=SIGNALS):
        self.signals, self.signum, self._previous = signals, None, {}

    def _handler(self, signum, frame):
        self.signum = signum

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
        return False
