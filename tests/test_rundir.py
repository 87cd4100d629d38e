"""train/rundir.py: one run per run directory (a second is refused, a killed one's lock is taken
over) and bounded folder names."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train.rundir import RunDirInUse, RunDirLock, short_name

ROOT = Path(__file__).resolve().parent.parent
HOLD = "import sys, time; from train.rundir import RunDirLock; RunDirLock(sys.argv[1]).acquire(); time.sleep(60)"


def hold(run_dir: Path) -> subprocess.Popen:
    """Another process that holds run_dir's lock, once it has written its pid into the lock file."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 60
    while not (run_dir / ".lock").exists() or not (run_dir / ".lock").read_text().startswith(f"{proc.pid} "):
        assert proc.poll() is None and time.monotonic() < deadline, "the holder did not take the lock"
        time.sleep(0.05)
    return proc


def test_a_second_run_is_refused_and_a_killed_runs_lock_taken_over(tmp_path, capsys):
    run_dir = tmp_path / "run"
    holder = hold(run_dir)
    try:
        # train.py on the held folder: one line naming the holder, nothing written in the folder.
        proc = subprocess.run([sys.executable, "train.py", "trainer.device=cpu", "model=vitt_0L", "trainer.max_steps=2",
                               "trainer.num_workers=0", "trainer.progress=false", f"run_dir={run_dir}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines() == [
            f"error: run_dir {run_dir} is in use by pid {holder.pid} on host {socket.gethostname()} "
            f"(since {proc.stderr.split('(since ')[1].split(')')[0]}): wait for that run to end (or stop it), "
            f"or give another run_dir="]
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]  # no train.log, config, metrics
        with pytest.raises(RunDirInUse, match=f"pid {holder.pid} "):
            RunDirLock(run_dir).acquire()
    finally:
        holder.kill()  # SIGKILL: no clean-up in the holder, the kernel drops its lock
        holder.wait(timeout=30)
    with RunDirLock(run_dir):
        assert f"took over the lock of pid {holder.pid} " in capsys.readouterr().out
        assert (run_dir / ".lock").read_text().startswith(f"{os.getpid()} ")
    assert (run_dir / ".lock").read_text() == ""  # released cleanly: the next run takes it silently
    with RunDirLock(run_dir):
        assert "took over" not in capsys.readouterr().out


def test_short_name_keeps_short_names_and_bounds_long_ones_uniquely():
    assert short_name("abc", 10) == "abc"
    a, b = short_name("x" * 300 + "a", 120), short_name("x" * 300 + "b", 120)
    assert len(a) == len(b) == 120 and a != b and a.startswith("x" * 109 + "~")
    assert short_name("x" * 300 + "a", 120) == a  # the same input names the same folder


def test_a_fresh_run_refused_before_it_starts_leaves_no_folder(make_cfg, tmp_path):
    """issue 47: a run refused in set-up (a bad value, a checkpoint that is not there) leaves no
    folder it created (no .lock, no train.log); an existing run's folder keeps its lock and log."""
    from laplace.checkpoint import CheckpointError
    from laplace.errors import ConfigError
    from conftest import TINY_VIT
    from train import run

    runs = tmp_path / "runs"
    runs.mkdir()  # the user's folder: kept, even when empty
    base = [*TINY_VIT, "model=vitt_0L", "model.depth=1", "trainer.max_steps=1"]
    for bad, error in (("optim.schedules.lr.shape=step", ConfigError), ("trainer.init_from=/no/last.pt", CheckpointError)):
        with pytest.raises(error):
            run(make_cfg(*base, bad, run_dir=runs / "deit3" / "digits" / "vitt_0L_s0"))
        assert list(runs.iterdir()) == [], bad
    (runs / "mine").mkdir()
    with pytest.raises(ConfigError):
        run(make_cfg(*base, "optim.schedules.lr.shape=step", run_dir=runs / "mine"))
    assert sorted(p.name for p in (runs / "mine").iterdir()) == [".lock", "train.log"]
    assert "shape='step'" in (runs / "mine" / "train.log").read_text()


def test_a_run_folder_is_a_path_every_command_line_takes_unquoted(make_cfg):
    """`checkpoint=<run>/ckpt/last.pt` after any overrides, a long name's hash too: no `=`, `,` or
    `~`, which Hydra's grammar refuses unquoted (analysis, eval.*: "mismatched input '='")."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from train import run_dir_from_overrides

    cfg = make_cfg("model=vitt_1L")
    parse = OverridesParser.create().parse_overrides
    for overrides in (["optim.lr=1e-4", "trainer.max_steps=10", "model.num_laplacian_heads=[0,1]"],
                      ["optim.lr=1e-4", f"trainer.init_from=/a/{'x' * 200}/last.pt"]):
        path = f"{run_dir_from_overrides(cfg, overrides)}/ckpt/last.pt"
        (override,) = parse([f"checkpoint={path}"])
        assert override.value() == path, path


def test_the_same_command_finds_a_run_named_by_the_old_rule(make_cfg, tmp_path):
    """Runs named before the rule above (`optim.lr=1e-4,trainer.max_steps=10`) resume by the same command."""
    from train import run_dir_from_overrides

    cfg = make_cfg("model=vitt_1L")
    over = ["trainer.max_steps=10", "optim.lr=1e-4"]
    old = tmp_path / "runs" / "deit3" / "digits" / "vitt_1L_s0_optim.lr=1e-4,trainer.max_steps=10"
    assert run_dir_from_overrides(cfg, over).endswith("vitt_1L_s0_optim.lr-1e-4_trainer.max_steps-10")
    (old / "ckpt").mkdir(parents=True)
    assert run_dir_from_overrides(cfg, over) == str(old)
