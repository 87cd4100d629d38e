"""Device and distributed set-up shared by every trainer.

Works under torchrun (RANK / WORLD_SIZE / LOCAL_RANK), under SLURM's srun (SLURM_PROCID /
SLURM_STEP_NUM_TASKS / SLURM_LOCALID, with MASTER_ADDR from the first node of the allocation)
and as a plain single process. gloo on CPU, nccl on CUDA. A plain `python train.py` in the
batch script of a multi-task job (SLURM_NTASKS > 1, but no srun step) runs as one process.
A collective that fails because a rank is gone (killed, out of memory, its node down) becomes one
line naming that rank (`lost_peer`), found by a roll call through the rendezvous store.
"""
import contextlib
import functools
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from laplace.errors import ConfigError, UserError, causes


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def env_ranks() -> tuple[int, int, int]:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    # srun exports SLURM_STEP_NUM_TASKS to the tasks of a step only. The batch script (or salloc shell) of a
    # multi-task job also has SLURM_NTASKS > 1 and SLURM_PROCID=0 but is one process: a group there never fills.
    world = int(os.environ.get("SLURM_STEP_NUM_TASKS", 1))
    if world > 1:  # srun
        rank = int(os.environ["SLURM_PROCID"])
        if "MASTER_ADDR" not in os.environ:
            nodes = subprocess.check_output(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]])
            os.environ["MASTER_ADDR"] = nodes.decode().split()[0]
        # A port derived from the job id, so two jobs sharing a node do not collide.
        os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ.get("SLURM_JOB_ID", 0)) % 20000))
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
        return rank, world, int(os.environ.get("SLURM_LOCALID", 0))
    if int(os.environ.get("SLURM_NTASKS", 1)) > 1:
        print(f"laplace: SLURM_NTASKS={os.environ['SLURM_NTASKS']} but not inside an srun step: running as one "
              "process; launch with `srun python ...` to use every task", file=sys.stderr)
    return 0, 1, 0


def resolve_device(device: str = "auto", index: int = 0) -> torch.device:
    """"auto" -> CUDA when available, else CPU; asking for CUDA without one is a one-line error.
    Every entry point (training, evaluation, analysis, generation) resolves its device here.
    index is the local rank (see below)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not device.startswith("cuda"):
        return torch.device(device)
    if not torch.cuda.is_available():
        raise ConfigError(f"device={device} but no CUDA device is visible; use cpu or auto")
    # Modulo the visible GPUs: Slurm's --gpus-per-task / --gpu-bind give each task its own
    # CUDA_VISIBLE_DEVICES (one GPU, index 0), while --gpus=N or torchrun show every GPU of the
    # node to every process (index = local rank).
    dev = torch.device("cuda", index % torch.cuda.device_count()) if device == "cuda" else torch.device(device)
    # float32 matmuls in TF32 (10 mantissa bits, several times float32's rate; torch already runs
    # float32 convolutions so), as nanochat and timm's train.py set it: the matmuls bf16 autocast
    # does not take (trainer.amp=false, the analysis' float32 forwards, k-NN similarities). The
    # analysis accumulators are float64, which TF32 leaves alone.
    torch.set_float32_matmul_precision("high")
    return dev


def setup(device: str = "auto") -> DistInfo:
    """Initialise the process group when launched with several processes; pick the device.

    Args:
        device: "auto" (CUDA when available, else CPU), "cpu", or "cuda".
    """
    rank, world, local_rank = env_ranks()
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":  # before the process group: NCCL binds each rank to the current device
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=world)
        _store().set(f"laplace/where/{rank}", f"{socket.gethostname()}, pid {os.getpid()}")  # for lost_peer
    return DistInfo(rank, world, local_rank, dev)


def cleanup():
    # The CPU group goes with the default group: a later setup (tests, a second run in one
    # process) must make a new one.
    if dist.is_initialized():
        dist.destroy_process_group()
    _cpu_group.cache_clear()


def seed_everything(seed: int):
    """Seed python, numpy and torch (all devices). Call with seed + rank."""
    random.seed(seed)
    np.random.seed(seed % 2**32)  # NumPy's legacy seed takes 32 bits only
    torch.manual_seed(seed)


def barrier():
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """`t` reduced over ranks (a new tensor; `t` itself where there is one process)."""
    if dist.is_initialized():
        t = t.clone()
        dist.all_reduce(t, op=op)
    return t


def unsynced_running_stats(module: torch.nn.Module) -> list[torch.Tensor]:
    """Running means and variances of the plain batch norms in `module`: under DDP each rank
    updates them from its own batch (SyncBatchNorm, which all-reduces them, has CUDA kernels only)."""
    norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
             and not isinstance(m, torch.nn.SyncBatchNorm) and m.track_running_stats]
    return [t for m in norms for t in (m.running_mean, m.running_var)]


def average_(tensors: list[torch.Tensor]):
    """Each tensor replaced by its mean over ranks, in place (one all-reduce for all of them)."""
    if not tensors or not dist.is_initialized():
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])  # one collective instead of one per tensor
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for t, v in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(v.view_as(t))


all_reduce_min = functools.partial(all_reduce_sum, op=dist.ReduceOp.MIN)


def all_gather_object(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


@functools.cache
def _cpu_group():
    """A gloo group of every rank, created on first use (every rank reaches it at the same
    point): flags travel on the CPU, beside NCCL's or gloo's gradient traffic, never inside it."""
    return dist.new_group(backend="gloo")


# How often ranks vote on stopping: every step of a second or longer, else every this many seconds
# but at least every STOP_VOTE_MAX_STEPS steps. A stop is agreed at most two votes after the signal
# (~2 s, then the checkpoint is written), well inside the KillWait seconds (30 by default) between
# Slurm's SIGTERM and its SIGKILL; the vote's cost is then under c / (10 t) of a step of t seconds
# for a collective of c (tens of microseconds to a millisecond), however short the steps.
STOP_VOTE_EVERY_S = 1.0
STOP_VOTE_MAX_STEPS = 10


class StopVote:
    """Agree on a flag across ranks without waiting for each other: `poll(flag)`, called once per
    step, returns True on every rank at the same step once `flag` was true on any rank.

    A vote is an all-reduce (MAX) on the CPU gloo group, started without waiting (async); its
    result is read at the next vote, long after it arrived: no device sync, no rendezvous of the
    ranks' hosts (a blocking check would make every host wait for the slowest one and drain the
    run-ahead of its kernel queue). Votes come every STOP_VOTE_EVERY_S seconds or
    STOP_VOTE_MAX_STEPS steps, whichever is first: each carries this rank's proposal for the steps
    until the next one (from its step time), and the ranks take the smallest, so all of them know
    the step of the next vote. A signal is acted on within two votes. `close()` waits for the last
    vote, which every rank started."""

    def __init__(self, every_s: float = STOP_VOTE_EVERY_S):
        self.group = _cpu_group() if dist.is_initialized() else None
        self.every_s, self._pending = every_s, None  # (work, tensor) of the last vote
        self._wait, self._since, self._t = 1, 0, time.monotonic()  # steps between votes: 1 at first

    def poll(self, flag: bool) -> bool:
        if self.group is None:
            return bool(flag)
        self._since += 1
        if self._since < self._wait:
            return False
        stop, wait = self._collect()
        now = time.monotonic()
        step_s, self._since, self._t = (now - self._t) / self._since, 0, now
        propose = max(1, min(STOP_VOTE_MAX_STEPS, int(self.every_s / max(step_s, 1e-9))))
        t = torch.tensor([int(bool(flag)), -propose], dtype=torch.int64)  # MAX of -steps: the fewest
        self._pending = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True), t
        self._wait = wait or 1
        return stop

    def _collect(self) -> tuple[bool, int]:
        if self._pending is None:
            return False, 0
        (work, t), self._pending = self._pending, None
        work.wait()
        return bool(t[0]), -int(t[1])

    def close(self):
        self._collect()


class PeerLost(UserError):
    """A collective failed because another rank is gone: one line naming it."""


# What gloo and NCCL say when the other end of a collective has vanished.
_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
         "remote process exited", "remote worker")


def _store():
    return dist.distributed_c10d._get_default_store()  # the rendezvous store of the default group


@contextlib.contextmanager
def _no_stderr():
    """File descriptor 2 to /dev/null for a while (C++ code writes there, past sys.stderr)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def lost_peer(e: BaseException, wait_s: float = 3.0) -> PeerLost | None:
    """If `e` is a collective failing because a rank is gone, a PeerLost naming the ranks that do
    not answer a roll call in the rendezvous store within `wait_s` (every survivor fails within
    moments of the loss and calls in), else None: `e` is then an error of its own."""
    # gloo and NCCL raise RuntimeErrors (DistError among them); an OSError such as a closed
    # stdout's BrokenPipeError is this process's own
    gone = (isinstance(c, RuntimeError) and (isinstance(c, dist.DistError) or any(m in str(c) for m in _GONE))
            for c in causes(e))
    if not any(gone) or not dist.is_initialized():
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    keys = [f"laplace/alive/{r}" for r in range(world)]
    addr, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
    try:
        socket.create_connection((addr, int(port)), timeout=wait_s).close()  # a host that is down: fast
        with _no_stderr():  # the store's client prints a C++ stack trace when its server is gone
            store = _store()
            store.set_timeout(timedelta(seconds=wait_s))
            store.set(keys[rank], "1")
            deadline = time.monotonic() + wait_s
            while (missing := [r for r in range(world) if r != rank and not store.check([keys[r]])]) and \
                    time.monotonic() < deadline:
                time.sleep(0.1)
            where = {r: store.get(f"laplace/where/{r}").decode() for r in missing}
    except Exception:  # the store itself is gone: it lives with rank 0 (torchrun: with its agent)
        return PeerLost(f"rank {rank} of {world}: lost rank 0 (the rendezvous store at {addr}:{port} is gone "
                        f"too): see its log for why; run the same command again to resume from the last checkpoint")
    if not missing:
        return None
    lost = "; ".join(f"rank {r} ({where[r]})" for r in missing)
    return PeerLost(f"rank {rank} of {world}: lost {lost}: it stopped answering (killed, out of memory, or "
                    f"its node failed; see its log); run the same command again to resume from the last checkpoint")
