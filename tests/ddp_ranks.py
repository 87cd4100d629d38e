"""Child of tests/test_ddp.py (and of scripts/gpu_check.py's multi-GPU check), started by torchrun:
every rank trains each run of argv[2] (one per line: a label, a config name and its overrides) and
fingerprints the WHOLE trained module (`trainer.model`: DINO's teacher and centre too, not only
what DDP wraps) after set-up, after the first invocation (stopped by trainer.stop_after, if the
overrides set it), after the resumed set-up and at the end. Rank 0 writes {label: {phase:
[fingerprints of rank 0, rank 1, ...]}, buffer_broadcasts: DDP's buffer syncs in training} to argv[1]
(a fingerprint: tensor name -> sha1 of its bytes, so "equal" means bitwise).

The runs share one process group (see tests/ddp_collectives.py: re-creating it hangs)."""
from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import sys
from pathlib import Path
from unittest import mock

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parents[1]


def fingerprint(module: torch.nn.Module) -> dict[str, str]:
    """Every parameter and buffer (persistent or not) -> sha1 of its bytes."""
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return {name: hashlib.sha1(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for name, t in named}


def main(out: str, runs: str):
    faulthandler.dump_traceback_later(float(os.environ.get("DUMP_AFTER", "250")), exit=True)
    torch.set_num_threads(1)
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from train import dist
    from train import check_engine_config, get_trainer

    results = {}
    with mock.patch.object(dist, "cleanup", lambda: None):  # the group stays for the next run
        for line in runs.splitlines():
            label, entry, *overrides = line.split()
            with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
                cfg = compose(entry, overrides=overrides)
            with open_dict(cfg):
                cfg.run_dir = f"{out}.{label}"
            if entry == "segmentation":
                from eval.segmentation import prepare
                cfg = prepare(cfg)
            Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)  # train.run's part
            cls = get_trainer(cfg.trainer.name)
            check_engine_config(cls, cfg)
            phases = {}

            def record(phase, trainer):
                phases[phase] = dist.all_gather_object(fingerprint(trainer.model))

            trainer = cls(cfg).setup()
            record("set-up", trainer)
            with mock.patch.object(DDP, "_sync_buffers", autospec=True, side_effect=DDP._sync_buffers) as syncs:
                trainer.fit()
                if cfg.trainer.stop_after and trainer.step < trainer.total_steps:
                    record("stopped", trainer)
                    trainer = cls(cfg).setup()  # a new invocation: resumes from the checkpoint
                    record("resumed", trainer)
                    trainer.fit()
            record("end", trainer)
            results[label] = {"phases": phases, "buffer_broadcasts": syncs.call_count}
    if int(os.environ.get("RANK", 0)) == 0:
        Path(out).write_text(json.dumps(results))
    dist.cleanup()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
