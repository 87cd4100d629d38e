"""Runs as a cluster sees them, through `python train.py` in subprocesses: a signalled run
checkpoints, exits with the requeue status and resumes exactly (1 process with data workers,
and 2 gloo processes with only one of them signalled); a bug exits non-zero within seconds
with its traceback while data workers run; wrong combinations are one line."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, TINY_VIT
from laplace.checkpoint import load_checkpoint
from test_engine import DEFAULT_LOG, TIMED, untimed
from test_trainer_contract import STREAM, write_token_shards
from train.logger import read_metrics, read_records
from train.signals import EXIT_REQUEUE

ENV = dict(os.environ, PYTHONPATH=f"{ROOT / 'tests'}{os.pathsep}{ROOT}", OMP_NUM_THREADS="1")


def _train(run_dir, key="loss"):
    return [(r["step"], r[key]) for r in read_metrics(run_dir) if r.get("split") == "train"]


def _cmd(*args):
    return [sys.executable, str(ROOT / "train.py"), *args]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args, world=1, env=None, session=False):
    """`world` processes of train.py as srun / torchrun would start them; `session`: each in a
    process group of its own (with its data workers), to be signalled whole as Slurm does."""
    port = _free_port()
    procs = []
    for rank in range(world):
        e = dict(env or ENV)
        if world > 1:
            e.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(_cmd(*args), cwd=ROOT, env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=session))
    return procs


def _finish(procs, timeout=300):
    out = [p.communicate(timeout=timeout) for p in procs]
    return [p.returncode for p in procs], out


def _wait_for_step(run_dir: Path, step: int, procs, timeout=120):
    log, t0 = run_dir / "metrics.jsonl", time.time()
    while time.time() - t0 < timeout:
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a process ended before step {step}: {_finish(procs)}")
        if log.exists() and any(f'"step": {step},' in ln for ln in log.read_text().splitlines()):
            return
        time.sleep(0.01)
    raise AssertionError(f"no step {step} within {timeout} s")


def _signal_resume_and_compare(args, tmp_path, world, signalled_ranks):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    codes, out = _finish(_launch([*args, f"run_dir={straight}"], world))
    assert codes == [0] * world, out

    procs = _launch([*args, f"run_dir={resumed}"], world)
    _wait_for_step(resumed, 2, procs)
    for r in signalled_ranks:
        procs[r].send_signal(signal.SIGUSR1)
    codes, out = _finish(procs)
    assert codes == [EXIT_REQUEUE] * world, out
    stopped = load_checkpoint(resumed / "ckpt/last.pt")["loop"]["step"]
    total = len(_train(straight))
    assert 2 <= stopped < total, "the signal should land part-way"
    assert "stop requested" in out[0][0]

    codes, out = _finish(_launch([*args, f"run_dir={resumed}"], world))  # the requeued job
    assert codes == [0] * world, out
    assert f"resumed at step {stopped}" in out[0][0]
    assert _train(resumed) == _train(straight)  # the same losses, exactly
    return straight, resumed


@pytest.mark.slow
def test_signal_to_one_of_two_processes_stops_both_at_the_same_step(tmp_path):
    """2 gloo processes on streamed token shards; only rank 1 gets the signal (as when a
    scheduler's warning reaches the ranks at different times)."""
    root = write_token_shards(tmp_path / "shards", tokens=20000)
    args = [*STREAM, f"+data.root={root}", "trainer.max_steps=40", "trainer.device=cpu",
            f"paths.runs_dir={tmp_path / 'runs'}"]
    straight, resumed = _signal_resume_and_compare(args, tmp_path, world=2, signalled_ranks=[1])
    assert _train(resumed, "first_token") == _train(straight, "first_token")
    assert load_checkpoint(resumed / "ckpt/last.pt")["loop"]["world_size"] == 2


# trainer -> (signals, one per interruption; overrides). The GPT has no data workers; DINO's exact
# resume is tests/test_dino.py's (here: that its workers survive the signal and the resumed run ends).
# deit3 draws in the workers (3-Augment) and in the model (drop-path): its resume must be exact.
GROUP_RUNS = {
    "deit3": ((signal.SIGTERM, signal.SIGUSR1),
              [*TINY_VIT, "model=vitt_1L", "model.depth=1", "data.augment=three_augment", "model.drop_path_rate=0.1",
               "trainer.max_steps=30"]),
    "dino": ((signal.SIGTERM,),
             ["experiment=dino_digits", "model.depth=1", "model.embed_dim=48", "trainer.progress=false",
              "trainer.global_batch_size=8", "trainer.log_every=1", "trainer.head.out_dim=64",
              "trainer.head.hidden_dim=32", "trainer.head.bottleneck_dim=16", "trainer.multicrop.local_crops=2",
              "data.val_fraction=0.9", "trainer.max_steps=30"]),
}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("trainer", sorted(GROUP_RUNS))
def test_a_signal_to_the_process_group_with_workers_requeues_and_resumes(trainer, tmp_path):
    """SIGTERM (deit3: then, in the resumed run, SIGUSR1) to the whole process group, 2 data
    workers included, as Slurm signals a job step: each time exit 75 with a resumable last.pt (the
    workers used to die of SIGTERM and take the run down mid-checkpoint); the last run ends by
    itself (workers that merely ignore SIGTERM hang DataLoader's shutdown), deit3's with the
    losses of a straight run."""
    signals, overrides = GROUP_RUNS[trainer]
    args = [*overrides, "trainer.num_workers=2", "trainer.eval_every=1000", "trainer.ckpt_every=1000",
            "trainer.device=cpu", f"paths.runs_dir={tmp_path / 'runs'}"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    if trainer == "deit3":
        codes, out = _finish(_launch([*args, f"run_dir={straight}"]), timeout=240)
        assert codes == [0], out
    stopped = 0
    for sig in signals:
        procs = _launch([*args, f"run_dir={resumed}"], session=True)
        _wait_for_step(resumed, stopped + 3, procs)
        os.killpg(procs[0].pid, sig)
        codes, out = _finish(procs, timeout=120)
        assert codes == [EXIT_REQUEUE], (sig, out)
        step = load_checkpoint(resumed / "ckpt/last.pt")["loop"]["step"]
        assert stopped + 3 <= step < 30 and f"saved step {step}" in out[0][0], out
        stopped = step
    codes, out = _finish(_launch([*args, f"run_dir={resumed}"], session=True), timeout=120)
    assert codes == [0], out
    assert f"resumed at step {stopped}" in out[0][0]
    assert [s for s, _ in _train(resumed)] == list(range(1, 31))
    if trainer == "deit3":
        assert _train(resumed) == _train(straight)


# The default log cadence (10); data workers; a run whose first checkpoint is its last step's.
PAUSING = [*DEFAULT_LOG, "model=vitt_1L", "model.depth=1", "trainer.name=toy_trainers:PausesAt",
           "trainer.num_workers=2", "trainer.max_steps=25", "trainer.eval_every=10", "trainer.device=cpu"]


def _paused_at(step: int, run_dir: Path, args, timeout=180) -> subprocess.Popen:
    """train.py in a process group of its own, waiting inside step `step` (toy_trainers.PausesAt)."""
    (proc,) = _launch(args, env=dict(ENV, PAUSE_AT=str(step)), session=True)
    t0 = time.time()
    while not (run_dir / "paused").exists():
        assert proc.poll() is None and time.time() - t0 < timeout, _finish([proc])
        time.sleep(0.05)
    return proc


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_between_log_steps_keeps_the_uninterrupted_record(tmp_path):
    """SIGTERM to the process group (setsid; `kill -TERM -- -PGID`, data workers included) in step
    13, at the default log_every: exit 75, and the resumed run's records equal an uninterrupted run's
    (the steps 11-13 of the first record after the resume come from the checkpoint)."""
    args = [*PAUSING, f"paths.runs_dir={tmp_path / 'runs'}"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    codes, out = _finish(_launch([*args, f"run_dir={straight}"]))
    assert codes == [0], out
    proc = _paused_at(13, resumed, [*args, f"run_dir={resumed}"])
    os.killpg(proc.pid, signal.SIGTERM)
    (resumed / "go").touch()
    codes, out = _finish([proc], timeout=120)
    assert codes == [EXIT_REQUEUE] and "saved step 13" in out[0][0], out
    assert [r["step"] for r in read_metrics(resumed)] == [10, 10]  # nothing logged at the stop
    codes, out = _finish(_launch([*args, f"run_dir={resumed}"]))
    assert codes == [0] and "resumed at step 13" in out[0][0], out
    # the records equal, but for the resume's own: its step and commit
    assert [r for r in untimed(resumed) if r["split"] != "resume"] == untimed(straight)
    assert [r["step"] for r in untimed(resumed) if r["split"] == "resume"] == [13]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_killed_before_its_first_checkpoint_restarts_with_records_of_its_own(tmp_path):
    """kill -9 of the process group in step 23, before any checkpoint (records of steps 10 and 20
    logged): the next run starts anew, sets the dead attempt's metrics.jsonl aside as
    metrics.jsonl.1.old, and its records and results.json (DeiT-III's "best" reads the val records)
    equal an uninterrupted run's: no step twice."""
    args = [*PAUSING, f"paths.runs_dir={tmp_path / 'runs'}"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    codes, out = _finish(_launch([*args, f"run_dir={straight}"]))
    assert codes == [0], out
    proc = _paused_at(23, killed, [*args, f"run_dir={killed}"])
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert not (killed / "ckpt/last.pt").exists()
    dead = untimed(killed)
    assert [(r["step"], r["split"]) for r in dead] == [(10, "train"), (10, "val"), (20, "train"), (20, "val")]
    codes, out = _finish(_launch([*args, f"run_dir={killed}"]))
    assert codes == [0] and "new run" in out[0][0] and "set aside as *.1.old" in out[0][0], out
    assert untimed(killed) == untimed(straight)
    assert [{k: v for k, v in r.items() if k not in TIMED} for r in read_records(killed / "metrics.jsonl.1.old")] == dead
    results = [json.loads((d / "results.json").read_text()) for d in (straight, killed)]
    assert results[1]["best"] == results[0]["best"] and results[1]["final"] == results[0]["final"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_multi_gpu_launcher_exits_75_on_a_signal_and_resumes(tmp_path):
    """README's one-node multi-process command, 2 gloo ranks: SIGUSR1 to its process group, then
    SIGTERM to the launcher alone (passed on to the ranks), each time exit 75 with last.pt (torchrun:
    SIGUSR1 killed it, 138, leaving the ranks as orphans; SIGTERM gave 1, so no requeue); the
    requeued command finishes the run (that its losses are exact over 2 processes: the test above)."""
    root = write_token_shards(tmp_path / "shards", tokens=20000)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "train.launch", "--nproc_per_node=2", str(ROOT / "train.py"), *STREAM,
           f"+data.root={root}", "trainer.max_steps=60", "trainer.device=cpu", f"run_dir={run_dir}"]

    def launch():
        return [subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 start_new_session=True)]

    stopped = 0
    for deliver in (lambda p: os.killpg(p.pid, signal.SIGUSR1), lambda p: p.send_signal(signal.SIGTERM)):
        procs = launch()
        _wait_for_step(run_dir, stopped + 3, procs)
        deliver(procs[0])
        codes, out = _finish(procs)
        assert codes == [EXIT_REQUEUE], out
        step = load_checkpoint(run_dir / "ckpt/last.pt")["loop"]["step"]
        assert stopped + 3 <= step < 60 and "stop requested" in out[0][0], out  # agreed within 2 votes
        stopped = step
    codes, out = _finish(launch())
    assert codes == [0], out
    assert f"resumed at step {stopped}" in out[0][0]
    assert [s for s, _ in _train(run_dir)] == list(range(1, 61))


VOTE = """
import sys, time
from train import dist
dist.setup("cpu")
rank = dist.dist.get_rank()
vote, stop = dist.StopVote(every_s=0.2), None
for step in range(1, 200):
    time.sleep(0.03 if rank else 0.001)  # unequal steps: each rank proposes its own vote cadence
    if vote.poll(rank == 1 and step >= 7):  # only rank 1 got the signal, at step 7
        stop = step
        break
vote.close()
sys.stdout.write(f"stopped at {stop}\\n")  # one write: the ranks share the pipe
sys.stdout.flush()
"""


def test_the_stop_vote_agrees_on_one_step_without_waiting_every_step(tmp_path):
    """2 gloo ranks whose steps differ 30x in length, the signal on one: both stop at the same step,
    within two votes (a vote at least every STOP_VOTE_MAX_STEPS steps)."""
    from train.dist import STOP_VOTE_MAX_STEPS

    proc = subprocess.run([sys.executable, "-m", "train.launch", "--nproc_per_node=2", "-c", VOTE], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [int(s) for s in re.findall(r"stopped at (\d+)", proc.stdout)]
    assert len(steps) == 2 and steps[0] == steps[1], proc.stdout
    assert 7 <= steps[0] <= 7 + 2 * STOP_VOTE_MAX_STEPS + 1, steps


def test_the_launcher_status_is_the_ranks():
    from train.launch import run_status

    assert run_status([0, 0]) == 0 and run_status([75, 75]) == 75 and run_status([0, 75]) == 75
    assert run_status([75, 137, 1]) == 137  # the first failure (here a rank killed by SIGKILL)


def test_train_py_recommends_the_launcher_that_requeues():
    """issue 47: train.py's help shows `python -m train.launch` for several GPUs, not torchrun, which
    exits 1 when its ranks stop to be requeued (75), so a job around it would never be requeued."""
    doc = (ROOT / "train.py").read_text().split('"""')[1]
    commands = [ln.strip() for ln in doc.splitlines() if ln.startswith("    ")]
    assert "python -m train.launch --nproc_per_node=8 train.py experiment=deit3_in1k model=vitb_12L" in commands
    assert not any(c.startswith("torchrun") for c in commands), commands


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_a_lost_rank_is_one_line_naming_it(victim, tmp_path):
    """kill -9 of one of 2 gloo processes mid-run: the other exits 1 within seconds with one line
    naming the lost rank (rank 0 also hosts the rendezvous store), not gloo's traceback."""
    root = write_token_shards(tmp_path / "shards", tokens=20000)
    procs = _launch([*STREAM, f"+data.root={root}", "trainer.max_steps=3000", "trainer.device=cpu",
                     f"run_dir={tmp_path / 'run'}"], world=2)
    _wait_for_step(tmp_path / "run", 3, procs)
    procs[victim].kill()
    t0 = time.time()
    survivor = procs[1 - victim]
    _, err = survivor.communicate(timeout=60)
    assert survivor.returncode == 1 and time.time() - t0 < 10
    lost = f"lost rank {victim} (the rendezvous store" if victim == 0 else f"lost rank 1 ({socket.gethostname()}, pid"
    assert err.strip().splitlines() == [err.strip()] and err.startswith(f"error: rank {1 - victim} of 2: {lost}"), err
    procs[victim].wait(timeout=10)


@pytest.mark.slow
def test_a_bug_with_data_workers_running_exits_within_seconds(tmp_path):
    env = dict(ENV, CRASH_AT_STEP="2")
    run_dir = tmp_path / "crash"
    (proc,) = _launch([*TINY_VIT, "model=vitt_0L", "model.depth=1", "trainer.name=toy_trainers:Crashing",
                       "trainer.num_workers=2", "trainer.max_steps=50", f"run_dir={run_dir}",
                       f"paths.runs_dir={tmp_path / 'runs'}"], env=env)
    (code,), ((_, err),) = _finish([proc], timeout=120)
    ended = time.time()
    assert code == 1
    # A bug is not shortened: the traceback and the real exception type stay.
    assert "Traceback" in err and err.strip().splitlines()[-1] == "ValueError: injected bug inside train_step"
    assert ended - float((run_dir / "crash_time").read_text()) < 5.0


@pytest.mark.parametrize("args,expect", [
    (["data=pydoc_text"], "data=pydoc_text holds text data but trainer=deit3 trains on image; use trainer=gpt"),
    (["model=gpt_d2_0L"], "model=gpt_d2_0L is a GPT but trainer=deit3 trains ViTs; use trainer=gpt"),
    (["experiment=gpt_pydoc", "model=vitt_0L"], "model=vitt_0L is a ViT but trainer=gpt trains GPTs; use trainer=deit3"),
    (["trainer.name=mae"], "trainer.name='mae' is not a trainer"),
])
def test_wrong_combinations_are_one_line(args, expect, tmp_path):
    proc = subprocess.run(_cmd(*args, f"paths.runs_dir={tmp_path}"), cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expect in err[0], proc.stderr[-2000:]


@pytest.mark.timeout(120)
def test_training_set_smaller_than_a_batch_is_one_line(tmp_path):
    """96 images, batch 512 with repeated augmentation: an epoch holds no batch (this used to
    spin at 100% CPU forever)."""
    import fakedata

    fakedata.write_cifar(tmp_path / "cifar", "cifar100", n_train=96, n_test=10)
    proc = subprocess.run(_cmd("experiment=deit3_cifar100", f"data.root={tmp_path / 'cifar'}",
                               "trainer.num_workers=0", f"paths.runs_dir={tmp_path / 'runs'}"),
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: data=cifar100: an epoch gives each of the 1 process(es) fewer than one "
                           "micro batch of 512 (the training set has 96 samples)"), proc.stderr[-2000:]
    assert "trainer.global_batch_size=512" in last


def test_a_signal_during_set_up_stops_after_the_first_step(make_cfg, tmp_path):
    """The handlers are installed before the trainer is built: an early warning is kept (not a
    kill by the default SIGUSR1 action) and the run saves and exits after its first step."""
    from train import run

    cfg = make_cfg(*TINY_VIT, "model=vitt_0L", "model.depth=1", "trainer.name=toy_trainers:SignalledDuringSetup",
                   "trainer.max_steps=5", "trainer.eval_every=100")
    with pytest.raises(SystemExit) as e:
        run(cfg)
    assert e.value.code == EXIT_REQUEUE
    assert load_checkpoint(tmp_path / "run/ckpt/last.pt")["loop"]["step"] == 1
