"""Child of tests/test_device_placement.py, started by torchrun with 2 processes: each run given
(a label, a config name and its overrides per line of argv[2]) trains on the stand-in CUDA device
over a gloo group that plays NCCL, and every collective is recorded as (op, tensor device,
backend the group would have on a GPU node, run) into argv[1].rank<R>.json.

The runs share one process group: torch re-creating the default group after destroy_process_group
in the same processes hangs at random in its first collectives (a bare script of init_process_group,
new_group, destroy_process_group, init_process_group, all_reduce hung in 2 of 3 torchruns)."""
from __future__ import annotations

import faulthandler
import functools
import json
import os
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as tdist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fakedevice import fake_cuda  # noqa: E402

TENSOR_OPS = ("all_reduce", "all_gather", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
              "reduce", "gather", "scatter", "all_to_all_single")
OBJECT_OPS = ("all_gather_object", "broadcast_object_list", "gather_object", "barrier")
RECORDS: list[dict] = []
_INTENDED: dict = {}  # group -> the backend it would have on a GPU node


def _backend(group) -> str:
    g = group if group is not None else tdist.group.WORLD
    return _INTENDED.get(g, tdist.distributed_c10d.get_backend(g))


def _record(name, fn, tags):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        group = kwargs.get("group")
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if tensor is None and args and isinstance(args[0], list) and len(args) > 1 and isinstance(args[1], torch.Tensor):
            tensor = args[1]  # all_gather(out_list, tensor)
        where = "object" if tensor is None else ("cuda" if tags.has(tensor) else "cpu")
        RECORDS.append({"op": name, "device": where, "backend": _backend(group), "run": RUN[0]})
        return fn(*args, **kwargs)
    return wrapped


RUN = [""]


def main(out: str, runs: str):
    # A hang (a collective one rank never joins) prints every rank's stack and exits, before the
    # test's timeout kills torchrun without a word.
    faulthandler.dump_traceback_later(float(os.environ.get("DUMP_AFTER", "100")), exit=True)
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from train import dist
    from train import run

    real_init, real_new_group = tdist.init_process_group, tdist.new_group

    def init_process_group(backend=None, **kw):
        real_init("gloo", **kw)  # gloo carries the CPU data; NCCL is what a GPU node would use
        _INTENDED[tdist.group.WORLD] = backend

    def new_group(*a, backend=None, **kw):
        g = real_new_group(*a, backend="gloo", **kw)
        _INTENDED[g] = backend or _INTENDED.get(tdist.group.WORLD)
        return g

    with fake_cuda() as tags, mock.patch.object(tdist, "init_process_group", init_process_group), \
            mock.patch.object(tdist, "new_group", new_group), \
            mock.patch.object(tdist, "get_backend", lambda group=None: _backend(group)):
        for name in TENSOR_OPS + OBJECT_OPS:
            mock.patch.object(tdist, name, _record(name, getattr(tdist, name), tags)).start()
        # SyncBatchNorm's kernels are CUDA's: the conversion is recorded (it must happen on NCCL
        # groups only) and the plain batch norm kept.
        def convert(module, process_group=None):
            RECORDS.append({"op": "convert_sync_batchnorm", "device": "object", "backend": _backend(process_group),
                            "run": RUN[0]})
            return module

        mock.patch.object(torch.nn.SyncBatchNorm, "convert_sync_batchnorm", convert).start()
        real_cleanup = dist.cleanup
        mock.patch.object(dist, "cleanup", lambda: None).start()  # the group stays for the next run
        for line in runs.splitlines():
            RUN[0], entry, *overrides = line.split()  # label, config name (config | segmentation), overrides
            with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "configs"),
                                       version_base="1.3"):
                cfg = compose(entry, overrides=overrides)
            if entry == "segmentation":
                from eval.segmentation import prepare
                cfg = prepare(cfg)
            else:
                with open_dict(cfg):
                    cfg.run_dir = f"{out}.{RUN[0]}"
            run(cfg)
        real_cleanup()
        rank = int(os.environ["RANK"])
        Path(f"{out}.rank{rank}.json").write_text(json.dumps(RECORDS))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
