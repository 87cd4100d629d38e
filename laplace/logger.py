"""Run logging: `metrics.jsonl` always (one JSON object a line, as DINO/DeiT's log.txt), wandb
on rank 0 when `logger=wandb`."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional


class MetricsLogger:
    """Append metrics to <run_dir>/metrics.jsonl and optionally to wandb (rank 0 only).

    Args:
        run_dir: the run directory.
        enabled: False on ranks other than 0: every call is then a no-op.
        wandb_cfg: None, or the `logger` config with project / entity / mode / name.
        config: the resolved run config, sent to wandb.
        resume_step: on resume, lines logged after this step (written after the last
            checkpoint by the interrupted run) are dropped, so the file reads as one run.
    """

    def __init__(self, run_dir: str | os.PathLike, enabled: bool = True,
                 wandb_cfg: Optional[dict] = None, config: Optional[dict] = None,
                 resume_step: Optional[int] = None):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.wandb = None
        if not enabled:
            return
        if resume_step is not None and self.path.exists():
            kept = [ln for ln in self.path.read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("step", 0) <= resume_step]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        if wandb_cfg:
            import wandb  # only when asked: wandb's import is slow

            os.environ.setdefault("WANDB_MODE", wandb_cfg.get("mode") or "offline")
            self.wandb = wandb.init(project=wandb_cfg.get("project"), entity=wandb_cfg.get("entity"),
                                    name=wandb_cfg.get("name") or Path(run_dir).name,
                                    id=wandb_cfg.get("id") or Path(run_dir).name.replace("/", "_"),
                                    resume="allow", dir=str(run_dir), config=config)

    def log(self, step: int, metrics: dict, **tags):
        if not self.enabled:
            return
        rec = {"step": step, **tags, **{k: _plain(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in rec.items() if isinstance(v, (int, float))}, step=step)

    def finish(self):
        if self.wandb is not None:
            self.wandb.finish()


def _plain(v):
    if hasattr(v, "item"):
        return v.item()
    return v


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """All records of a run's metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
