"""Device and distributed set-up shared by every trainer.

Works under torchrun (RANK / WORLD_SIZE / LOCAL_RANK), under SLURM's srun (SLURM_PROCID /
SLURM_STEP_NUM_TASKS / SLURM_LOCALID, with MASTER_ADDR from the first node of the allocation)
and as a plain single process. gloo on CPU, nccl on CUDA. A plain `python train.py` in the
batch script of a multi-task job (SLURM_NTASKS > 1, but no srun step) runs as one process.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from laplace.errors import ConfigError


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


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under DDP and torch.compile wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def _env_ranks() -> tuple[int, int, int]:
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
    Every entry point (training, evaluation, analysis, generation) resolves its device here, so
    a CUDA device also turns TF32 on (`use_tf32`).

    index is the local rank; it is taken modulo the visible GPUs because Slurm's --gpus-per-task /
    --gpu-bind give each task its own CUDA_VISIBLE_DEVICES (one GPU, index 0), while --gpus=N or
    torchrun show every GPU of the node to every process (index = local rank).
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"device={device} but no CUDA device is visible; use cpu or auto")
        dev = torch.device("cuda", index % torch.cuda.device_count()) if device == "cuda" else torch.device(device)
        use_tf32(dev)
        return dev
    return torch.device(device)


def use_tf32(device: torch.device):
    """On CUDA, float32 matmuls in TF32 (10 mantissa bits, several times float32's rate; torch
    already runs float32 convolutions so), as nanochat and timm's train.py set it: the matmuls bf16
    autocast does not take (runs with trainer.amp=false, float32 forwards of the analysis, k-NN
    similarities). The analysis accumulators are float64, which TF32 leaves alone."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")


def setup(device: str = "auto") -> DistInfo:
    """Initialise the process group when launched with several processes; pick the device.

    Args:
        device: "auto" (CUDA when available, else CPU), "cpu", or "cuda".
    """
    rank, world, local_rank = _env_ranks()
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=world)
    return DistInfo(rank, world, local_rank, dev)


def cleanup():
    global _CPU_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _CPU_GROUP = None


def seed_everything(seed: int):
    """Seed python, numpy and torch (all devices). Call with seed + rank."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def barrier():
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        t = t.clone()
        dist.all_reduce(t)
    return t


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    return all_reduce_sum(t) / (dist.get_world_size() if dist.is_initialized() else 1)


def broadcast_module_(module: torch.nn.Module, src: int = 0):
    """Overwrite every parameter and buffer of `module` (non-persistent ones too) with rank
    `src`'s, in place: DDP does so for the module it wraps only."""
    if not dist.is_initialized():
        return
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.detach(), src)


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
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for t, v in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(v.view_as(t))


def all_gather_object(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


_CPU_GROUP = None


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is true on any (e.g. a stop signal one rank received).

    Goes through a gloo group on the CPU, created on the first call (every rank calls this at
    the same point of the loop), so asking every step costs no GPU synchronisation."""
    global _CPU_GROUP
    if not dist.is_initialized():
        return bool(flag)
    if _CPU_GROUP is None:
        _CPU_GROUP = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
    t = torch.tensor([int(bool(flag))], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_CPU_GROUP)
    return bool(t.item())
