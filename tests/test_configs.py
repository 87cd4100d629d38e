"""The config tree's own rules (issue 21): the trainer group holds trainers only, and a mandatory
value (`???`) reaches the composed config and, left unset, stops the run in one line naming it."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from conftest import ROOT
from train.config import check_required
from laplace.errors import ConfigError
from train import TRAINERS
from train.recipe import CONFIGS, compose_config, experiments

# The experiments that start from pre-trained weights the command line must name.
FINETUNE = {"deit3_cifar100_ft", "deit3_cifar10_ft", "deit3_in1k_ft224", "gpt_d20_mid", "gpt_d20_sft", "gpt_tiny_sft"}


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONFIGS / "trainer").glob("*.yaml")))
def test_every_option_of_the_trainer_group_is_a_trainer(option):
    """configs/trainer/engine.yaml was "not a trainer" yet `trainer=engine` composed."""
    cfg = compose_config([f"trainer={option}"], "segmentation" if option == "seg_linear" else "config")
    assert cfg.trainer.get("name") in TRAINERS, f"configs/trainer/{option}.yaml names no registered trainer"


def test_every_mandatory_value_written_in_a_config_reaches_the_composition():
    """Merging `???` onto a default keeps the default (omegaconf#462): `init_from: ???` in an
    experiment file silently meant null. A `???` must sit where nothing merges over it."""
    written = {}
    for path in sorted((CONFIGS / "experiment").glob("*.yaml")):
        written[path.stem] = re.findall(r"^\s*(\w+): \?\?\?", path.read_text(), re.M)
    for experiment in experiments():
        cfg = compose_config([f"experiment={experiment}"])
        missing = OmegaConf.missing_keys(cfg)
        for key in written[experiment]:
            assert any(m.endswith(f".{key}") or m == key for m in missing), \
                f"experiment={experiment}: {key}: ??? is merged away by a default"
        assert ("trainer.init_from" in missing) == (experiment in FINETUNE), experiment


def test_every_experiments_default_model_is_a_listed_zoo_name():
    """`python train.py experiment=gpt_tiny` without `model=` could not find model/gpt_d4_0L: the
    command line registered only the listed zoo names. Now the zoo's config source
    (hydra_plugins/laplace_zoo.py) serves any name the zoo parses, gpt26_d{depth}_{k}L included."""
    from laplace.zoo import model_defaults

    for path in sorted((CONFIGS / "experiment").glob("*.yaml")):
        for name in re.findall(r"override /model: (\S+)", path.read_text()):
            model_defaults(name)  # UnknownModelError names the experiment's model otherwise


def test_check_required_names_the_first_missing_key_without_resolving():
    cfg = OmegaConf.create({"trainer": {"epochs": "${data.nowhere}", "init_from": "???"},
                            "data": {"splits": ["a", "???"]}})
    with pytest.raises(ConfigError, match=r"^trainer.init_from is required: this experiment fine-tunes .* "
                                          r"set trainer.init_from=PATH"):
        check_required(cfg)  # the broken interpolation is not resolved
    cfg.trainer.init_from = "x.pt"
    with pytest.raises(ConfigError, match=r"^data.splits\[1\] is required: add data.splits\[1\]=<value> to the"):
        check_required(cfg)
    cfg.data.splits[1] = "b"
    check_required(cfg)


@pytest.mark.parametrize("experiment", ["deit3_cifar10_ft", "gpt_d20_sft"])
def test_cli_without_a_mandatory_value_is_one_line_before_anything_runs(experiment, tmp_path):
    """Before: the run built its data first (no CIFAR here: a dataset error; with data, the
    string "required" read as a path or a MissingMandatoryValue traceback)."""
    proc = subprocess.run([sys.executable, "train.py", f"experiment={experiment}", "trainer.device=cpu",
                           f"run_dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: trainer.init_from is required: this experiment fine-tunes a pre-trained "
        "model: set trainer.init_from=PATH (a laplace checkpoint or a timm/DeiT-III state dict)"], proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # refused before the run directory is made


def test_one_name_per_trainer_across_config_file_and_module():
    """`trainer=deit3` was trained by train/supervised.py's SupervisedTrainer: three names for one
    concept. A trainer of the loop is configs/trainer/<name>.yaml, train/<name>.py and a class
    named after it (seg_linear: SegLinearTrainer); one registered elsewhere at least has its config."""
    for name, target in TRAINERS.items():
        module, cls = target.split(":")
        assert (CONFIGS / "trainer" / f"{name}.yaml").is_file(), name
        if module.startswith("train."):
            assert module == f"train.{name}", f"trainer={name} lives in {module}"
            assert cls.lower() == name.replace("_", "") + "trainer", f"trainer={name} is the class {cls}"
