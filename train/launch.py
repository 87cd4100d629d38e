"""Several processes of one command on this node, as torchrun starts them, but with the exit status
a requeue needs (one node; several nodes: slurm/train.sbatch, srun starts the ranks there).

    python -m train.launch --nproc_per_node=8 train.py experiment=deit3_in1k model=vitb_12L
    python -m train.launch --nproc_per_node=8 -m eval.knn checkpoint=...

Each rank gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT); what differs from torchrun is for preemption (train/signals.py): the process group,
the signals and the exit status, said where they are made.
"""
import argparse
import os
import signal
import subprocess
import sys
import time

from torch.distributed.elastic.utils.distributed import get_free_port  # torchrun's

from .signals import EXIT_REQUEUE

FORWARDED = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)  # sent to the launcher alone: passed on to the ranks
GRACE_S = 30.0  # after a rank failed, the others' time to end on their own (train.dist names the lost one)


def run_status(statuses: list[int]) -> int:
    """The launcher's exit status from the ranks' in the order they ended: the first failure's,
    else 75 if any rank stopped to be requeued, else 0."""
    # torchrun exits 1 whenever a rank exits non-zero, 75 included: a job around it would never be
    # requeued (slurm/requeue.sh requeues on 75).
    failed = [s for s in statuses if s not in (0, EXIT_REQUEUE)]
    return failed[0] if failed else (EXIT_REQUEUE if EXIT_REQUEUE in statuses else 0)


def launch(nproc: int, command: list[str], port: int | None = None) -> int:
    """Run `command` (python arguments: a script or -m module, then its own) as `nproc` ranks;
    returns the exit status (run_status)."""
    env = dict(os.environ, WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
               MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"), MASTER_PORT=str(port or get_free_port()))
    # The ranks stay in the launcher's process group, so a signal to the group (Slurm's, or
    # `kill -TERM -- -PGID`) reaches them and their data workers as under srun. torchrun starts each
    # rank in a session of its own: there SIGUSR1 reaches torchrun alone, kills it (it handles
    # SIGTERM / SIGINT / SIGHUP / SIGQUIT only) and leaves the ranks training as orphans.
    procs = [subprocess.Popen([sys.executable, *command], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(nproc)]

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for s in FORWARDED:
        signal.signal(s, forward)
    statuses, deadline = [], None
    while len(statuses) < nproc:
        for p in (p for p in procs if p.returncode is None and p.poll() is not None):
            statuses.append(128 - p.returncode if p.returncode < 0 else p.returncode)  # signal N: 128 + N, as shells
            if statuses[-1] not in (0, EXIT_REQUEUE) and deadline is None:  # the first failure
                deadline = time.monotonic() + GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            for r, p in enumerate(procs):
                if p.poll() is None:
                    print(f"[launch] rank {r} still running {GRACE_S:.0f} s after a rank failed: killed",
                          file=sys.stderr, flush=True)
                    p.kill()
            deadline = float("inf")  # killed once
        time.sleep(0.05)
    return run_status(statuses)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.launch", usage="%(prog)s --nproc_per_node=N "
                                 "[--master_port=P] (SCRIPT | -m MODULE | -c CODE) [ARGS...]",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc_per_node", "--nproc-per-node", type=int, required=True,
                    help="processes (ranks) to start, one per GPU")
    ap.add_argument("--master_port", "--master-port", type=int, default=None,
                    help="the rendezvous port on 127.0.0.1 (default: a free one)")
    argv = sys.argv[1:] if argv is None else argv
    # The launcher's options come first; the command (which may start with -m or -c) after them.
    head = 0
    while head < len(argv) and (argv[head].startswith("--") or argv[head] == "-h"):
        head += 1 if "=" in argv[head] or argv[head] in ("-h", "--help") else 2
    args, command = ap.parse_args(argv[:head]), argv[head:]
    if args.nproc_per_node < 1 or not command:
        ap.error("give --nproc_per_node=N (N >= 1) and a command: train.py ARGS or -m MODULE ARGS")
    return launch(args.nproc_per_node, command, args.master_port)


if __name__ == "__main__":
    sys.exit(main())
