"""One of each (issue 21): one atomic writer (checkpoints, the feature cache and metrics.jsonl's
resume rewrite go through laplace.io), one write_json, one config flattener, one reader of a
run's logged split."""
from __future__ import annotations

import json
import os
import stat

import torch

from laplace.checkpoint import load_checkpoint, save_checkpoint
from train.config import flatten
from laplace.io import write_json
from train.logger import MetricsLogger, logged


def _fsynced_kinds(monkeypatch) -> list[str]:
    kinds, real = [], os.fsync

    def spy(fd):
        kinds.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return kinds


def test_checkpoint_save_fsyncs_the_file_and_then_its_folder(tmp_path, monkeypatch):
    """The checkpoint writer is laplace.io's: the rename is made durable by a folder fsync
    (the old copy in checkpoint.py fsynced the file only)."""
    kinds = _fsynced_kinds(monkeypatch)
    path = save_checkpoint(tmp_path / "ckpt" / "last.pt", model=torch.nn.Linear(2, 2),
                           config={"model": {"name": "x"}}, loop={"step": 7})
    assert kinds == ["file", "dir"]
    assert load_checkpoint(path)["loop"]["step"] == 7
    assert os.listdir(path.parent) == ["last.pt"]


def test_metrics_resume_rewrite_is_atomic(tmp_path, monkeypatch):
    """On resume metrics.jsonl is cut back to the checkpoint's step through the atomic writer."""
    log = MetricsLogger(tmp_path)
    for step in (1, 2, 3):
        log.log(step, {"loss": float(step)}, split="train")
    log.log(2, {"val_acc1": 50.0}, split="val")
    kinds = _fsynced_kinds(monkeypatch)
    MetricsLogger(tmp_path, resume_step=2)
    assert kinds == ["file", "dir"]
    assert [r["step"] for r in logged(tmp_path, "train")] == [1, 2]
    assert logged(tmp_path, "val") == [{"step": 2, "split": "val", "val_acc1": 50.0}]
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]
    assert logged(tmp_path / "never_logged", "train") == []


def test_write_json_is_strict_json(tmp_path):
    """One write_json(path, obj): NaN / inf become null (analysis.json and results.json alike),
    tuples lists, other leaves str."""
    def refuse(name):
        raise ValueError(f"non-strict JSON constant {name}")

    path = write_json(tmp_path / "r.json", {"loss": float("nan"), "x": [1.0, float("inf")], "t": (1, 2),
                                            "p": tmp_path})
    assert json.loads(path.read_text(), parse_constant=refuse) == {"loss": None, "x": [1.0, None], "t": [1, 2],
                                                                   "p": str(tmp_path)}
    assert path.read_text().startswith('{\n  "loss"')  # indent=2 by default
    assert write_json(tmp_path / "s.json", [1], indent=1).read_text() == "[\n 1\n]\n"


def test_flatten_dots_keys_and_makes_lists_tuples():
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": None, "f": {}}) == {"a.b": 1, "a.c.d": (1, 2), "e": None}
