"""The shared engine: exact resume, atomic checkpoints, the one-line errors, load_model."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from laplace.zoo import model_label

import laplace
from laplace.checkpoint import CheckpointError, load_checkpoint, load_model, save_checkpoint
from laplace.errors import ConfigError
from train.logger import git_commit, read_metrics
from conftest import ROOT, TINY_VIT
from train import run


def _train_losses(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir) if r.get("split") == "train"]


def test_resume_equals_uninterrupted(make_cfg, tmp_path):
    """N steps straight == N/2 steps, stop, same command again for the other N/2: same losses.

    Exercises every source of randomness a resume must restore: data order part-way through
    an epoch, per-sample augmentation (3-Augment), drop-path, and gradient accumulation."""
    common = [*TINY_VIT, "model=vitt_1L", "model.drop_path_rate=0.1", "data.augment=three_augment",
              "trainer.max_steps=6", "trainer.micro_batch_size=16", "trainer.eval_every=100",
              "trainer.ckpt_every=100"]
    run(make_cfg(*common, run_dir=tmp_path / "straight"))
    run(make_cfg(*common, "trainer.stop_after=3", run_dir=tmp_path / "resumed"))
    assert load_checkpoint(tmp_path / "resumed/ckpt/last.pt")["loop"]["step"] == 3
    run(make_cfg(*common, run_dir=tmp_path / "resumed"))

    straight, resumed = _train_losses(tmp_path / "straight"), _train_losses(tmp_path / "resumed")
    assert [s for s, _ in straight] == [1, 2, 3, 4, 5, 6]
    assert resumed == straight  # exact on CPU, not approximately
    a = load_checkpoint(tmp_path / "straight/ckpt/last.pt")["model"]
    b = load_checkpoint(tmp_path / "resumed/ckpt/last.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


# The fields a record times (the window's clock counts this process's seconds): all others of a
# resumed run's records equal the uninterrupted run's.
TIMED = ("step_ms", "img_per_s", "tok_per_s", "mfu")
DEFAULT_LOG = [o for o in TINY_VIT if not o.startswith("trainer.log_every=")]  # the default cadence


def untimed(run_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMED} for r in read_metrics(run_dir)]


def test_stops_between_log_steps_leave_the_records_of_an_uninterrupted_run(make_cfg, tmp_path):
    """With the default trainer.log_every (10), stops at steps 13 and 22 (trainer.stop_after) and
    the resumes log steps 10, 20 and 25 as an uninterrupted run does: the partial window (11-13)
    travels in the checkpoint, where it used to be lost (step 20 then averaged 14-20 only)."""
    assert make_cfg().trainer.log_every == 10
    common = [*DEFAULT_LOG, "model=vitt_1L", "model.depth=1", "trainer.max_steps=25", "trainer.eval_every=10",
              "trainer.ckpt_every=100"]
    run(make_cfg(*common, run_dir=tmp_path / "straight"))
    for stop in (13, 9, None):
        run(make_cfg(*common, *([f"trainer.stop_after={stop}"] if stop else []), run_dir=tmp_path / "resumed"))
        if stop == 13:
            assert load_checkpoint(tmp_path / "resumed/ckpt/last.pt")["loop"]["log_window"][0]["steps"] == 3
    straight, resumed = untimed(tmp_path / "straight"), untimed(tmp_path / "resumed")
    assert [(r["step"], r["split"]) for r in straight] == [(s, split) for s in (10, 20, 25) for split in ("train", "val")]
    # each resume is one record, its step and the commit that went on from it; nothing else differs
    resumes = [r for r in resumed if r["split"] == "resume"]
    assert [r["step"] for r in resumes] == [13, 22] and all(r["commit"] == git_commit() for r in resumes)
    assert [r for r in resumed if r["split"] != "resume"] == straight  # the losses exactly, and every untimed field
    results = [json.loads((tmp_path / d / "results.json").read_text()) for d in ("straight", "resumed")]
    assert results[0]["resumes"] == [] and results[1]["resumes"] == [{"step": s, "commit": git_commit()} for s in (13, 22)]
    assert results[0]["commit"] == results[1]["commit"] == git_commit()  # the code that started it (None outside git)


def test_the_log_window_restores_each_ranks_sum_and_averages_on_another_world_size():
    """Each rank continues its own loss sum; on another number of ranks each takes the saved sums'
    mean (the logged mean over ranks stays the run's); a checkpoint without a window starts empty."""
    from train.logger import LogWindow

    cpu = torch.device("cpu")
    saved = []
    for losses in ([1.5, 2.5], [3.0, 9.0]):  # two ranks, two steps each
        w = LogWindow(cpu)
        for v in losses:
            w.add(torch.tensor(v), 64)
        saved.append(w.state_dict())
    w = LogWindow(cpu)
    w.load_state_dict(saved, rank=1, world_size=2)
    assert (float(w.loss), w.steps, w.units) == (12.0, 2, 128) and w.seconds() >= saved[1]["seconds"]
    w.load_state_dict(saved, rank=0, world_size=1)
    assert (float(w.loss), w.steps) == (8.0, 2)  # (4 + 12) / 2
    w.load_state_dict(None, rank=0, world_size=1)
    assert (float(w.loss), w.steps, w.units) == (0.0, 0, 0)


@pytest.mark.cuda  # a checkpoint written on the device loads anywhere
def test_checkpoint_contents_and_load_model(make_cfg, tmp_path):
    cfg = make_cfg(*TINY_VIT, "model=vitt_2L", "trainer.max_steps=2")
    run(cfg)
    ckpt = load_checkpoint(tmp_path / "run/ckpt/last.pt")
    assert ckpt["loop"]["step"] == 2 and ckpt["optimizer"] is not None
    assert model_label(ckpt["config"]["model"]) == "vitt_d2_w48_2L" and ckpt["config"]["model"]["name"] == "vitt"
    assert ckpt["config"]["model"]["num_classes"] == 10  # interpolations resolved
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in ckpt["model"])
    assert (tmp_path / "run/config.yaml").exists() and (tmp_path / "run/results.json").exists()

    model = load_model(tmp_path / "run/ckpt/last.pt")
    assert not model.training and model.num_laplacian_heads == [2, 2]
    x = torch.randn(3, 3, 32, 32)
    ref = load_model(tmp_path / "run/ckpt/last.pt", fused_attn=False)
    torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-5)


def test_construction_reads_the_config_and_setup_builds_in_a_visible_order(make_cfg, tmp_path):
    """Constructing a trainer builds nothing; setup() builds data, model, optimizers, then the
    wrappers (train.run calls it before writing config.yaml, then fit())."""
    from train.deit3 import DeiT3Trainer

    calls = []

    class Recording(DeiT3Trainer):
        def build_data(self):
            calls.append("data")
            return super().build_data()

        def build_model(self):
            calls.append("model")
            return super().build_model()

        def configure_optimizers(self):
            calls.append("optimizers")
            return super().configure_optimizers()

        def _wrap(self, model):
            calls.append("wrap")
            return super()._wrap(model)

    (tmp_path / "run").mkdir()
    t = Recording(make_cfg(*TINY_VIT, "model=vitt_1L", "model.depth=1", "trainer.max_steps=1"))
    assert calls == [] and not hasattr(t, "model") and t.micro_bs == 32
    assert t.setup() is t
    assert calls == ["data", "model", "optimizers", "wrap"]


def test_a_mandatory_init_from_left_unset_is_one_line(make_cfg):
    with pytest.raises(ConfigError, match="fine-tunes a pre-trained model: set trainer.init_from=PATH"):
        run(make_cfg(*TINY_VIT, "model=vitt_1L", "trainer.init_from=???"))


def test_foreign_and_corrupt_checkpoints_are_refused(tmp_path):
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, foreign)
    with pytest.raises(CheckpointError, match="not a laplace checkpoint"):
        load_checkpoint(foreign)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x00not a checkpoint" * 10)
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        load_checkpoint(garbage)
    good = save_checkpoint(tmp_path / "good.pt", model=torch.nn.Linear(4, 4), config={"model": {}})
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(truncated)
    assert "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing.pt")


def _mapped(path) -> list[str]:
    """This process's memory mappings of `path` (Linux's /proc/self/maps), '(deleted)' once replaced."""
    return [ln for ln in open("/proc/self/maps") if str(path) in ln]


def test_resume_maps_the_checkpoint_and_the_next_save_leaves_the_mapping_valid(make_cfg, tmp_path):
    """Every rank reads its resume checkpoint memory-mapped (the ranks of a node share its pages,
    read from disk once) rather than each reading the whole file; the next save renames a new
    last.pt over it (atomic_write), so what was mapped stays the old file's bytes."""
    from train.resume import find_checkpoint

    run(make_cfg(*TINY_VIT, "model=vitt_1L", "trainer.max_steps=1", run_dir=tmp_path / "r"))
    path, ckpt = find_checkpoint(tmp_path / "r/ckpt", True)
    assert _mapped(path.resolve()), "the checkpoint was read into memory, not mapped"
    before = {k: v.clone() for k, v in ckpt["model"].items()}
    model = torch.nn.Linear(2, 2)
    save_checkpoint(path, model=model, config=ckpt["config"], loop=ckpt["loop"])
    assert all(torch.equal(ckpt["model"][k], v) for k, v in before.items())
    assert all(ln.rstrip().endswith("(deleted)") for ln in _mapped(path.resolve()))
    assert set(load_checkpoint(path)["model"]) == {"weight", "bias"}


def test_a_checkpoint_in_torchs_legacy_format_still_resumes(tmp_path):
    """A file torch < 1.6 wrote (no zip archive) cannot be mapped: it is read instead."""
    from laplace.checkpoint import FORMAT, VERSION

    path = tmp_path / "last.pt"
    torch.save({"format": FORMAT, "version": VERSION, "model": {"w": torch.ones(2)}, "config": {}}, path,
               _use_new_zipfile_serialization=False)
    assert torch.equal(load_checkpoint(path, mmap=True)["model"]["w"], torch.ones(2))


def test_the_rng_restore_takes_this_devices_state_whatever_the_saved_device_count(make_cfg, tmp_path):
    """A rank keeps its own CUDA device's generator state: a run saved where 8 GPUs were visible
    to each rank (torchrun) resumes where each sees one (Slurm's --gpus-per-task), and back."""
    from unittest import mock

    from fakedevice import fake_cuda
    from train.resume import rng_state, set_rng_state

    with fake_cuda(), mock.patch("torch.cuda.is_initialized", lambda: True):
        torch.cuda.set_rng_state(torch.Generator().manual_seed(5).get_state())
        saved = rng_state()
        assert torch.equal(saved["cuda"], torch.Generator().manual_seed(5).get_state())
        with pytest.raises(IndexError):  # the stand-in has one device, as a one-GPU task
            torch.cuda.set_rng_state(saved["cuda"], 1)
        older = dict(saved, cuda=[torch.Generator().manual_seed(i).get_state() for i in range(8)])
        set_rng_state(older)  # a checkpoint of laplace before: every visible device's state
        assert torch.equal(torch.cuda.get_rng_state(), torch.Generator().manual_seed(0).get_state())
        set_rng_state(saved)
        assert torch.equal(torch.cuda.get_rng_state(), saved["cuda"])


def test_save_killed_half_way_keeps_previous_last(tmp_path):
    """SIGKILL a process in the middle of writing last.pt: the previous one still loads."""
    path = tmp_path / "last.pt"
    save_checkpoint(path, model=torch.nn.Linear(8, 8), config={"model": {}}, loop={"step": 1})
    child = textwrap.dedent(f"""
        import os, signal, torch
        from laplace import checkpoint
        real_save = torch.save
        def dying_save(obj, f):
            real_save(obj, f)          # the full payload reaches the temp file ...
            f.flush(); f.truncate(f.tell() // 2)
            os.kill(os.getpid(), signal.SIGKILL)   # ... and the process dies before the rename
        torch.save = dying_save
        checkpoint.save_checkpoint({str(path)!r}, model=torch.nn.Linear(8, 8), config={{"model": {{}}}},
                                   loop={{"step": 2}})
    """)
    proc = subprocess.run([sys.executable, "-c", child], cwd=ROOT, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert load_checkpoint(path)["loop"]["step"] == 1
    leftovers = [p for p in os.listdir(tmp_path) if p != "last.pt"]
    assert leftovers and all(p.startswith(".last.pt.") and p.endswith(".tmp") for p in leftovers)  # only the dead temp
    save_checkpoint(path, model=torch.nn.Linear(8, 8), config={"model": {}}, loop={"step": 3})
    assert os.listdir(tmp_path) == ["last.pt"]  # the next save removed the dead writer's temp file


def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "train.py", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("args,expect", [
    (["model=vitb_13L"], "13 Laplacian heads but has only 12 heads"),
    (["model=gpt_d20_11L"], "has only 10 heads"),
    (["model=resnet50"], "vitb_{0..12}L"),
    (["data=cifar10", "data.root=/nonexistent/cifar"], "/nonexistent/cifar"),
])
def test_cli_bad_input_is_one_line(args, expect, tmp_path):
    proc = _cli(*args, f"paths.runs_dir={tmp_path}", "trainer.num_workers=0")
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()
    assert err and err[-1].startswith("error: ") and expect in err[-1], proc.stderr[-2000:]


def test_cli_trains_and_resumes_same_run_dir(tmp_path):
    args = ["model=vitt_0L", *TINY_VIT, "trainer.max_steps=2", f"paths.runs_dir={tmp_path}"]
    first = _cli(*args)
    assert first.returncode == 0, first.stderr[-2000:]
    run_dir = tmp_path / "deit3/digits"
    (name,) = os.listdir(run_dir)  # named from the overrides, no timestamp
    assert name.startswith("vitt_0L_s0_") and "trainer.max_steps-2" in name
    again = _cli(*args, "trainer.num_workers=1")  # workers do not change the run's identity
    assert again.returncode == 0 and "resumed at step 2" in again.stdout
    assert os.listdir(run_dir) == [name]


def test_cli_multirun_sweeps_laplacian_heads(tmp_path):
    """`python train.py -m model=a,b`: one run directory (and results.json) per swept model."""
    proc = _cli("-m", "model=vitt_0L,vitt_3L", "model.depth=1", "model.embed_dim=48", "trainer.max_steps=1",
                "trainer.global_batch_size=16", "trainer.num_workers=0", "trainer.progress=false",
                f"paths.runs_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = sorted((tmp_path / "deit3/digits").glob("*/results.json"))
    assert [p.parent.name.split("_s0")[0] for p in results] == ["vitt_0L", "vitt_3L"]
    assert [json.loads(p.read_text())["num_laplacian_heads"] for p in results] == [0, 3]


# ---------------------------------------------------------------- resume: what it refuses and recovers


def test_resume_refuses_a_checkpoint_of_another_configuration(make_cfg, tmp_path):
    base = [*TINY_VIT, "model.depth=1", "trainer.max_steps=2"]
    run(make_cfg(*base, "model=vitt_0L", "trainer.stop_after=1"))
    # Laplacian heads add no parameters: only the config tells vitt_0L from vitt_3L.
    with pytest.raises(CheckpointError) as e:
        run(make_cfg(*base, "model=vitt_3L"))
    msg = str(e.value)
    assert "belongs to another configuration" in msg and "model.num_laplacian_heads: 0 -> 3" in msg
    assert "model.num_laplacian_heads: 0 -> 3" in msg and "trainer.resume=force" in msg and "\n" not in msg
    # Execution settings (workers, cadences, micro batch) are not part of the recipe.
    run(make_cfg(*base, "model=vitt_0L", "trainer.num_workers=1", "trainer.eval_every=7", "trainer.stop_after=1"))
    with pytest.raises(CheckpointError, match="does not fit model vitt_d2_w48_0L"):  # forced, but other shapes
        run(make_cfg(*base, "model=vitt_0L", "model.depth=2", "trainer.resume=force"))
    run(make_cfg(*base, "model=vitt_3L", "trainer.resume=force"))  # the user said so
    assert load_checkpoint(tmp_path / "run/ckpt/last.pt")["loop"]["step"] == 2


def test_resume_falls_back_to_the_newest_good_step_checkpoint(make_cfg, tmp_path, capsys):
    common = [*TINY_VIT, "model=vitt_0L", "model.depth=1", "trainer.max_steps=6", "trainer.eval_every=100",
              "trainer.ckpt_every=2", "trainer.keep_every=2"]
    run(make_cfg(*common, run_dir=tmp_path / "straight"))
    run(make_cfg(*common, "trainer.stop_after=4", run_dir=tmp_path / "r"))
    last = tmp_path / "r/ckpt/last.pt"
    last.write_bytes(last.read_bytes()[:1000])  # a torn last.pt (disk full, a kill during copy)
    (tmp_path / "r/ckpt/step_4.pt").write_bytes(b"garbage")
    with open(tmp_path / "r/metrics.jsonl", "a") as f:
        f.write('{"step": 5, "split": "tra')  # a kill in the middle of a log line
    run(make_cfg(*common, run_dir=tmp_path / "r"))
    err = capsys.readouterr().err
    assert "cannot resume from it" in err and "resumed from" in err and "step_2.pt" in err
    assert _train_losses(tmp_path / "r") == _train_losses(tmp_path / "straight")


def test_no_readable_checkpoint_is_one_line(make_cfg, tmp_path):
    cfg = make_cfg(*TINY_VIT, "model=vitt_0L", "model.depth=1", "trainer.max_steps=1")
    (tmp_path / "run/ckpt").mkdir(parents=True)
    (tmp_path / "run/ckpt/last.pt").write_bytes(b"\x00" * 100)
    with pytest.raises(CheckpointError, match=r"no readable checkpoint in .*run/ckpt \(last.pt\); move them away"):
        run(cfg)


def test_a_damaged_metrics_line_names_the_file(tmp_path):
    from laplace.errors import UserError
    from train.logger import read_metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(UserError, match=r"metrics.jsonl:2 is not a JSON line"):
        read_metrics(tmp_path)


def test_run_dir_names_stay_short_stable_and_distinct(make_cfg):
    from train import MAX_NAME, run_dir_from_overrides

    cfg = make_cfg("model=vitb_12L")
    many = [f"trainer.init_from=/very/long/path/{'x' * 200}/ckpt/last.pt", "optim.lr=1e-4", "seed=3"]
    a = run_dir_from_overrides(cfg, many)
    b = run_dir_from_overrides(cfg, many[:1] + ["optim.lr=2e-4"])
    name = os.path.basename(a)
    assert len(name) <= MAX_NAME and name.startswith("vitb_12L_s0_") and a == run_dir_from_overrides(cfg, many)
    assert a != b
    assert os.path.basename(run_dir_from_overrides(cfg, ["optim.lr=1e-4"])) == "vitb_12L_s0_optim.lr-1e-4"


def test_the_label_follows_the_model_node_not_the_name(make_cfg):
    """k has one source, the model node: `model=vitb_12L model.num_laplacian_heads=3` is the model
    `model=vitb_3L` builds, so it gets its label (run folder, results, W&B tag), not "12L"."""
    from train.rundir import results_header
    from omegaconf import OmegaConf
    from train import run_dir_from_overrides

    over = ["model=vitb_12L", "model.num_laplacian_heads=3"]
    cfg = make_cfg(*over)
    assert laplace.model_label(cfg.model) == "vitb_3L"
    same = make_cfg("model=vitb_3L")
    assert run_dir_from_overrides(cfg, over) == run_dir_from_overrides(same, ["model=vitb_3L"])
    assert results_header(OmegaConf.to_container(cfg.model), "digits", "x")["model"] == "vitb_3L"
    per_layer = make_cfg("model=gpt_d2_0L", "model.num_laplacian_heads=[0,1]")
    assert laplace.model_label(per_layer.model) == "gpt_d2_0-1L"
    assert laplace.model_label(make_cfg("model=gpt_d2_0L", "model.num_laplacian_heads=[1,1]").model) == "gpt_d2_1L"
    assert laplace.model_label({"name": "my_net"}) == "my_net"  # outside the zoo: the name itself
    wb = make_cfg(*over, "logger=wandb").logger.wandb
    assert "vitb_3L" in list(wb.tags) and "k=3" in list(wb.tags)


def test_wandb_ids_differ_between_stages_of_one_experiment(tmp_path):
    from train.logger import wandb_run_id

    stage1 = tmp_path / "deit3/deit3_in1k/vitb_12L_s0"
    stage2 = tmp_path / "deit3/deit3_in1k_ft224/vitb_12L_s0"
    assert wandb_run_id(stage1) != wandb_run_id(stage2)
    assert wandb_run_id(stage1) == wandb_run_id(str(stage1)) and wandb_run_id(stage1).startswith("vitb_12L_s0-")


def test_run_dir_keeps_a_log_with_tracebacks(make_cfg, tmp_path):
    """train.log in the run directory: rank 0's output, appended by every invocation, with the
    full traceback of a failure even when the terminal shows one line."""
    run(make_cfg(*TINY_VIT, "model=vitt_0L", "model.depth=1", "trainer.max_steps=2"))
    log = (tmp_path / "run/train.log").read_text()
    assert "[laplace] run_dir=" in log and "step 2: val_loss=" in log
    with pytest.raises(CheckpointError):
        run(make_cfg(*TINY_VIT, "model=vitt_3L", "model.depth=1", "trainer.max_steps=4"))
    log = (tmp_path / "run/train.log").read_text()
    assert log.count("[laplace] run_dir=") == 1 and "Traceback" in log and "belongs to another configuration" in log
