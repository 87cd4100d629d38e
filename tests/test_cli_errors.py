"""One line where a traceback was: a full or read-only disk, engine settings no trainer can run,
a foreign trainer.name, the benchmark on a missing GPU, a checkpoint without its config, and
analysis / analysis.tables with nothing to read or nowhere to write (issue 19, item 8)."""
from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

from conftest import CONFIGS, ROOT, TINY_VIT
from laplace.errors import ConfigError, UserError, storage_error

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
NO_SPACE = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=120)


def test_a_full_disk_is_one_line_naming_the_file(tmp_path):
    """torch.save wraps the full disk in a RuntimeError; write_json says nothing of the path:
    both come out as `error: <file>: No space left on device; ...`."""
    for call in ("write_json(target, {'a': 1})",
                 "save_checkpoint(target, model=torch.nn.Linear(2, 2), config={'model': {'name': 'x'}})"):
        p = _python("import os, errno, torch\n"
                    "from laplace.errors import cli_errors\nfrom laplace.io import write_json\n"
                    "from laplace.checkpoint import save_checkpoint\n"
                    f"target = {str(tmp_path / 'out' / 'f.pt')!r}\n"
                    "def full(fd): raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
                    "os.fsync = full\n"
                    f"cli_errors(lambda: {call})()\n")
        assert p.returncode == 1
        assert p.stderr.strip().splitlines() == [
            f"error: {tmp_path / 'out' / 'f.pt'}: No space left on device; free space there, or write elsewhere "
            f"(run_dir= / out=)"], p.stderr[-2000:]
        assert list((tmp_path / "out").iterdir()) == []  # no temp file left behind
    try:
        try:
            raise NO_SPACE
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")  # torch's
    except RuntimeError as e:
        assert storage_error(e) is NO_SPACE
    assert storage_error(ValueError("x")) is None and storage_error(FileNotFoundError(2, "x")) is None


def test_a_read_only_run_dir_is_one_line(tmp_path):
    """A run_dir that cannot be made (here a path through a file; on a read-only mount EROFS):
    one line before any training; and the EROFS / EACCES kinds read as storage errors."""
    (tmp_path / "file").write_text("")
    p = subprocess.run([sys.executable, "train.py", "trainer.device=cpu", "model=vitt_0L", "trainer.max_steps=2",
                        f"run_dir={tmp_path / 'file' / 'run'}"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1 and p.stderr.strip().splitlines() == [
        f"error: run_dir: cannot write in {tmp_path / 'file' / 'run'} (Not a directory); free space or make it "
        f"writable, or give run_dir=<a writable folder>"], p.stderr[-2000:]
    for code in (errno.EROFS, errno.EACCES, errno.EDQUOT):
        assert storage_error(OSError(code, os.strerror(code), "/x")) is not None


@pytest.mark.parametrize("overrides,message", [
    (["trainer.log_every=0"], "trainer.log_every=0: give a whole number >= 1"),
    (["trainer.max_steps=-1"], r"trainer.max_steps=-1: give a whole number >= 1, or null for the default"),
    (["trainer.eval_every=-5"], "trainer.eval_every=-5"),
    (["optim=muon"], "optim=muon splits a GPT's parameters .* model=vitt_d2_w48_0L is a ViT: use optim=adamw"),
    (["experiment=deit3_cifar10", "data=digits", "optim=muon"], "use optim=adamw"),
    (["trainer.name=os:system"], "trainer.name='os:system' is builtin_function_or_method .* not a subclass of "
                                 "train.engine.Trainer"),
])
def test_engine_settings_no_trainer_can_run_are_refused(make_cfg, tmp_path, overrides, message):
    from train import run

    cfg = make_cfg("model=vitt_0L", *TINY_VIT, *overrides)
    with pytest.raises(ConfigError, match=message):
        run(cfg)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_muon_stays_the_gpt_trainers(make_cfg):
    from train import check_engine_config, get_trainer

    cfg = make_cfg("experiment=gpt_pydoc", "model=gpt_d2_0L", "optim=muon")
    assert check_engine_config(get_trainer("gpt"), cfg) is None  # Muon routes a GPT's parameters
    vit = make_cfg("model=vitt_0L", *TINY_VIT, "optim=muon")  # a ViT has no such routing
    with pytest.raises(ConfigError, match="optim=muon splits a GPT's parameters"):
        check_engine_config(get_trainer("deit3"), vit)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_bench_on_cuda_without_cuda_is_one_line():
    p = subprocess.run([sys.executable, "-m", "bench", "--device", "cuda"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "error: --device cuda: this machine has no CUDA device torch can use; run on a GPU machine or pass "
        "--device cpu"], p.stderr[-2000:]


def test_a_checkpoint_without_its_config_is_one_line(tmp_path):
    from laplace.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from laplace.pretrained import load_pretrained
    from laplace.zoo import create_model

    model = create_model("vitt_0L", depth=1, embed_dim=48)
    path = save_checkpoint(tmp_path / "a.pt", model=model, config={"model": {"name": "vitt_0L"}})
    ckpt = torch.load(path, weights_only=True)
    del ckpt["config"]
    torch.save(ckpt, tmp_path / "b.pt")
    with pytest.raises(CheckpointError, match=r"b.pt is a laplace checkpoint without its config, so its model "
                                              r"cannot be rebuilt; use the run's ckpt/last.pt"):
        load_checkpoint(tmp_path / "b.pt")
    cfg = type("M", (), {"num_laplacian_heads": 0, "laplacian_mode": "fixed", "name": "vitt_0L"})()
    with pytest.raises(CheckpointError, match="trainer.init_from: .*without its config"):
        load_pretrained(model, tmp_path / "b.pt", cfg)


def _tables(*overrides):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose("tables", overrides=list(overrides))


def test_tables_name_what_they_leave_out_and_refuse_an_empty_folder(tmp_path, capsys):
    from analysis.tables import run
    from laplace.io import write_json

    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=f"runs={tmp_path / 'empty'}: no run directories in it"):
        run(_tables(f"runs={tmp_path / 'empty'}"))
    good, bad = tmp_path / "runs/good", tmp_path / "runs/bad"
    for d in (good, bad):
        d.mkdir(parents=True)
        (d / "config.yaml").write_text("model: {name: vitt_0L, num_laplacian_heads: 0}\ntrainer: {name: deit3}\n"
                                       "data: {name: digits}\nseed: 0\n")
        write_json(d / "results.json", {"steps": 2, "final": {"val_acc1": 50.0}})
    (bad / "config.yaml").write_text("model: {name: [vitt_0L\n")  # torn
    (bad / "results.json").unlink()
    run(_tables(f"runs={tmp_path / 'runs'}", f"out={tmp_path / 'tables'}"))
    out = capsys.readouterr().out
    assert f"[tables] {bad.resolve()}: config.yaml not readable (" in out and "left out" in out
    assert "[tables] 1 runs under" in out


def test_analysis_checks_its_output_before_the_work_and_can_write_elsewhere(tmp_path, monkeypatch, capsys):
    """The checkpoint's folder cannot take last_analysis (a file is in the way, as a read-only folder
    would be): refused naming out= before any model is run; out=DIR writes there instead."""
    import analysis.__main__ as cli
    from laplace.checkpoint import save_checkpoint
    from laplace.zoo import create_model

    ckpt = save_checkpoint(tmp_path / "run/ckpt/last.pt", model=create_model("vitt_0L", depth=1, embed_dim=48),
                           config={"model": {"name": "vitt_0L", "depth": 1, "embed_dim": 48},
                                   "data": {"name": "digits"}})
    (tmp_path / "run/ckpt/last_analysis").write_text("in the way")

    def measured(*a, **kw):
        raise AssertionError("measured before checking where the results go")

    monkeypatch.setattr(cli, "analyze_checkpoint", measured)
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("analysis", overrides=[f"checkpoint={ckpt}", "device=cpu", "progress=false"])
    with pytest.raises(UserError, match=f"out: cannot write in {tmp_path / 'run/ckpt/last_analysis'} .*give out="):
        cli.run(cfg)
    assert cli.analysis_dir(ckpt, tmp_path / "elsewhere") == tmp_path / "elsewhere/run_last_analysis"


def test_knn_and_linear_check_where_results_go_before_the_features(tmp_path):
    """eval.knn / eval.linear: <run>/eval that cannot be written (a file in the way; read-only) is
    refused naming run_dir= before the backbone runs, not after all the features."""
    from omegaconf import OmegaConf

    from eval.features import run_and_clean_up

    ckpt = tmp_path / "run/ckpt/last.pt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"")
    (tmp_path / "run/eval").write_text("in the way")

    def evaluate(cfg):
        raise AssertionError("evaluated before checking where the results go")

    for cfg in ({"checkpoint": str(ckpt), "run_dir": None}, {"checkpoint": str(ckpt), "run_dir": str(ckpt)}):
        with pytest.raises(UserError, match="run_dir: cannot write in .* give run_dir="):
            run_and_clean_up(evaluate, OmegaConf.create(cfg))


# Issue 45's bad values (7 were tracebacks; optim.weight_decay=-1, trainer.amp=maybe, trainer.compile=sometimes
# and optim.grad_clip=-1 trained with rc 0), the one-line ones kept one line, and more: each refused in one line
# naming the key, the value and what is allowed (train/config.py), before anything is built.
BAD_VALUES = [
    (["optim.lr=-0.1"], "optim.lr=-0.1: give a number > 0"),
    (["trainer.global_batch_size=ten"], "trainer.global_batch_size=ten: give a whole number >= 1, or null for optim=muon26's rule"),
    (["model.depth=two"], "model.depth=two: give a whole number >= 1"),
    (["trainer.num_workers=-1"], "trainer.num_workers=-1: give a whole number >= 0"),
    (["data.img_size=30"], "data.img_size=30: give a multiple of patch_size=8"),
    (["model.drop_path_rate=1.5"], "model.drop_path_rate=1.5: give a number in [0, 1)"),
    (["trainer.device=tpu"], "trainer.device=tpu: give auto, cpu, cuda or cuda:<index>"),
    (["optim.weight_decay=-1"], "optim.weight_decay=-1: give a number >= 0"),
    (["trainer.log_every=0"], "trainer.log_every=0: give a whole number >= 1"),
    (["trainer.max_steps=-1"], "trainer.max_steps=-1: give a whole number >= 1, or null for the default"),
    (["trainer.eval_every=1.5"], "trainer.eval_every=1.5: give a whole number >= 1, or null for the default"),
    (["trainer.epochs=0"], "trainer.epochs=0: give a whole number >= 1, or null for the default"),
    (["trainer.micro_batch_size=0"], "trainer.micro_batch_size=0: give a whole number >= 1, or null for the whole "
                                     "share"),
    (["trainer.resume=maybe"], "trainer.resume=maybe: give auto (refuse another configuration's checkpoint) or force"),
    (["trainer.name=mae"], "trainer.name='mae' is not a trainer; choose one of: deit3, gpt, seg_linear, dino"),
    (["trainer.amp=maybe"], "trainer.amp=maybe: give auto, true or false"),
    (["trainer.compile=sometimes"], "trainer.compile=sometimes: give auto, true or false"),
    (["optim.grad_clip=-1"], "optim.grad_clip=-1: give a number > 0, or null for no clipping"),
    (["optim.grad_clip_mode=norm"], "optim.grad_clip_mode=norm: give 'global', 'group' or 'param'"),
    (["optim.lr=true"], "optim.lr=true: give a number > 0"),
    (["optim.eps=0"], "optim.eps=0: give a number > 0"),
    (["optim.betas=[0.9]"], "optim.betas=[0.9]: give two numbers in [0, 1), e.g. [0.9, 0.999]"),
    (["seed=abc"], "seed=abc: give a whole number >= 0"),
    (["trainer.global_batch_size=0"], "trainer.global_batch_size=0: give a whole number >= 1"),
    (["trainer.keep_every=0"], "trainer.keep_every=0: give a whole number >= 1, or null for the default"),
    (["trainer.device=cuda:x"], "trainer.device=cuda:x: give auto, cpu, cuda or cuda:<index>"),
    (["model.num_heads=0"], "model.num_heads=0: give a whole number >= 1, or null for the default"),
    (["model.embed_dim=50"], "model.embed_dim=50: give a multiple of num_heads=3"),
    (["+model.mlp_ratio=0"], "model.mlp_ratio=0: give a number > 0"),
    (["model.num_laplacian_heads=two"], "model.num_laplacian_heads=two: give a whole number >= 0, or one per layer "
                                        "([k1, k2, ...])"),
    (["model.num_laplacian_heads=[1,-1]"], "model.num_laplacian_heads=[1, -1]: give a whole number >= 0, or one per "
                                           "layer ([k1, k2, ...])"),
    (["data.patch_size=0"], "data.patch_size=0: give a whole number >= 1"),
    (["data.img_size=32", "data.patch_size=5"], "data.img_size=32: give a multiple of patch_size=5"),
    (["logger=wandb", "logger.wandb.mode=sometimes"], "logger.wandb.mode=sometimes: give online, offline or disabled "
                                                      "(or null: WANDB_MODE decides)"),
    (["experiment=gpt_tiny", "model=gpt_d2_1L", "optim.matrix_lr=0"], "optim.matrix_lr=0: give a number > 0"),
    (["experiment=gpt_tiny", "model=gpt_d2_1L", "optim.momentum=1.5"], "optim.momentum=1.5: give a number in [0, 1)"),
]


@pytest.mark.parametrize("overrides,message", BAD_VALUES, ids=[" ".join(o) for o, _ in BAD_VALUES])
def test_a_bad_value_is_one_line_before_anything_is_built(make_cfg, tmp_path, overrides, message):
    from laplace.errors import one_line
    from train import check_engine_config, get_trainer, run

    gpt = any(o.startswith("experiment=gpt") for o in overrides)  # TINY_VIT's model keys are a ViT's
    cfg = make_cfg(*overrides, "trainer.num_workers=0") if gpt else make_cfg("model=vitt_0L", *TINY_VIT, *overrides)
    # what train.py checks before it names the run folder (the label reads k), and the run itself
    for step in (lambda: check_engine_config(get_trainer(cfg.trainer.name), cfg), lambda: run(cfg, overrides)):
        with pytest.raises(UserError) as e:
            step()
        assert str(e.value) == one_line(e.value) == message or str(e.value).startswith(message), str(e.value)
        assert "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()  # refused before the run folder was made: nothing built or written


CLI_BAD_VALUES = [(o, m) for o, m in BAD_VALUES if o[0] in ("trainer.global_batch_size=ten", "optim.betas=[0.9]")]
CLI_BAD_VALUES += [(["model=vitb_13L"], "model 'vitb_13L' asks for 13 Laplacian heads but has only 12 heads per "
                                        "layer; use k in 0..12")]


@pytest.mark.parametrize("overrides,message", CLI_BAD_VALUES, ids=[" ".join(o) for o, _ in CLI_BAD_VALUES])
def test_a_bad_value_on_the_command_line_is_one_error_line(tmp_path, overrides, message):
    """The same through `python train.py` (Hydra types the override): exit 1, one line, no traceback."""
    p = subprocess.run([sys.executable, "train.py", *TINY_VIT, *overrides, f"paths.runs_dir={tmp_path}"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stderr.strip().splitlines() == [f"error: {message}"], p.stderr[-2000:]
    assert not tmp_path.joinpath("deit3").exists()


def test_every_experiment_passes_the_schema(make_cfg):
    """No false alarm: every experiment (and the default config) as composed is valid."""
    from laplace.schema import check_config
    from train.config import TrainConfig

    for exp in [None, *sorted(p.stem for p in (ROOT / "configs" / "experiment").glob("*.yaml"))]:
        extra = [f"experiment={exp}", "trainer.init_from=/x.pt"] if exp else []
        assert check_config(make_cfg(*extra), TrainConfig) is None, exp


def test_a_lock_that_is_a_folder_is_one_line(tmp_path):
    from train.rundir import RunDirLock

    (tmp_path / "run" / ".lock").mkdir(parents=True)
    with pytest.raises(UserError, match=rf"^run_dir: cannot take the lock file {tmp_path / 'run' / '.lock'} \(Is a "
                                        rf"directory\); remove it if no run is using {tmp_path / 'run'}, or give another "
                                        rf"run_dir=$"):
        RunDirLock(tmp_path / "run").acquire()


def test_an_export_with_a_bad_value_in_its_config_is_one_line(tmp_path):
    """A hand-edited config.json (depth: "one") used to be a bare TypeError from the model."""
    import json

    import laplace
    from laplace.export import export
    from laplace.zoo import create_model

    node = {"name": "vitt_1L", "depth": 1, "embed_dim": 48, "img_size": 32, "patch_size": 8, "num_classes": 10}
    from laplace.checkpoint import save_checkpoint

    out = export(save_checkpoint(tmp_path / "a.pt", model=create_model(**node), config={"model": node}),
                 tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    cfg["laplace"]["model"]["depth"] = "one"
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=rf"^{out / 'config.json'}: laplace.model.depth=one: give a whole number "
                                          rf">= 1$"):
        laplace.load_model(out)


def test_a_run_folder_given_as_a_model_says_which_file_and_exports_elsewhere(tmp_path):
    """checkpoint=<run folder> (analysis, eval.*): the line names the run's last.pt and an export into
    a folder of its own, never the run folder itself (which export refuses)."""
    import laplace
    from laplace.checkpoint import CheckpointError, read_export_config

    run = tmp_path / "runs" / "deit3" / "digits" / "vitt_1L_s0"
    (run / "ckpt").mkdir(parents=True)
    (run / "ckpt" / "last.pt").write_bytes(b"")
    with pytest.raises(CheckpointError) as e:  # the one loader reads a run folder's last.pt
        laplace.load_model(run)
    assert str(e.value).startswith(f"{run}/ckpt/last.pt is not a readable checkpoint")
    with pytest.raises(CheckpointError) as e:  # where an export folder is what is read
        read_export_config(run)
    assert str(e.value) == (f"{run} is a run folder, not an exported laplace model; pass checkpoint={run}/ckpt/last.pt "
                            f"or export it with `python -m laplace.export checkpoint={run}/ckpt/last.pt "
                            f"out=exports/vitt_1L_s0`")
