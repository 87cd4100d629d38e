"""Schedules as the configs state them: every node complete, so an experiment's node replaces
the node it overrides (issue 18: SFT kept pre-training's warm-down and momentum warm-up)."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import schedule_node
from laplace.errors import ConfigError
from train.optim import KEYS, Schedule, build_schedules

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
EXPERIMENTS = sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml"))


def _compose(name="config", overrides=()):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(name, overrides=list(overrides))


@pytest.mark.parametrize("experiment", ["gpt_d20_sft", "gpt_tiny_sft"])
def test_sft_schedules_are_the_files_not_pretrainings(experiment):
    """gpt_d20_sft.yaml: the rates at 2% of pre-training's, linearly to 0 over the whole run,
    no momentum warm-up (optim/muon.yaml has a 20% warm-down and 0.85 -> 0.95 over 300 steps)."""
    cfg = _compose(overrides=[f"experiment={experiment}"])
    nodes = OmegaConf.to_container(cfg.optim.schedules, resolve=True)
    assert nodes == {"lr": schedule_node(0.02, end=0.0, shape="linear"),
                     "momentum": schedule_node(0.95, shape="constant")}
    s = build_schedules(nodes, "optim.schedules", total_steps=1000, steps_per_epoch=1000)
    assert [s["lr"](t) for t in (0, 500, 799, 1000)] == pytest.approx([0.02, 0.01, 0.02 * 201 / 1000, 0.0])
    assert {s["momentum"](t) for t in (0, 1, 299, 999)} == {0.95}


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_its_schedules_build(experiment, capsys):
    cfg = _compose(overrides=[f"experiment={experiment}"])
    for prefix in ("optim.schedules", "trainer.schedules"):
        nodes = OmegaConf.select(cfg, prefix)
        nodes = OmegaConf.to_container(nodes, resolve=True) if nodes is not None else {}
        for name, node in nodes.items():
            assert list(node) == list(KEYS), f"{prefix}.{name}: write the six keys in order"
        for s in build_schedules(nodes, prefix, total_steps=2000, steps_per_epoch=20).values():
            assert isinstance(s(0), float) and isinstance(s(1999), float)
    assert "warning" not in capsys.readouterr().err  # no experiment's warm-up outlasts a 2,000-step run


@pytest.mark.parametrize("eval_node", ["seg_ade20k_linear", "seg_digits_linear"])
def test_evaluation_schedules_build(eval_node):
    cfg = _compose("segmentation", [f"eval={eval_node}"])
    nodes = OmegaConf.to_container(cfg.optim.schedules, resolve=True)
    assert build_schedules(nodes, "optim.schedules", 2000, 20)["lr"](2000) == 0.0


def test_an_incomplete_node_is_refused_in_one_line_and_one_key_overrides_still_work():
    with pytest.raises(ConfigError, match=r"^optim\.schedules\.weight_decay\.warmup is missing") as e:
        cfg = _compose(overrides=["experiment=gpt_tiny", "+optim.schedules.weight_decay={value: 0.1, end: 0.0}"])
        build_schedules(cfg.optim.schedules, "optim.schedules", 100, 10)
    assert "\n" not in str(e.value) and "null where unused" in str(e.value)
    cfg = _compose(overrides=["experiment=gpt_tiny", "optim.schedules.lr.warmdown=50%"])
    lr = build_schedules(cfg.optim.schedules, "optim.schedules", 100, 10)["lr"]
    assert [lr(t) for t in (49, 50, 75, 100)] == pytest.approx([1.0, 1.0, 0.5, 0.0])
    with pytest.raises(ConfigError, match=r"^m\.start is null but m\.warmup=10"):
        Schedule.from_config(schedule_node(1.0, warmup=10), "m", 100, 10)


def test_a_warmup_as_long_as_the_run_warns_in_one_plain_line(capsys):
    """DINO's cosine_scheduler asserts on it; here tiny test runs keep working, with a warning: one
    plain line on stderr, not Python's warning with the file and source line (issue 47)."""
    s = Schedule.from_config(schedule_node(1.0, warmup="10ep", start=0.0), "lr", 30, 10)
    assert capsys.readouterr().err == ("[laplace] warning: lr.warmup='10ep' is 100 steps, the run 30: it never "
                                       "leaves the warm-up (DINO refuses this)\n")
    assert s(29) == pytest.approx(0.29)
    Schedule.from_config(schedule_node(1.0, warmup=29, start=0.0), "lr", 30, 10)
    assert capsys.readouterr().err == ""


def test_the_warmup_reaches_value_at_step_warmup_as_timm_and_nanochats_momentum():
    """Step i of a w-step warm-up is start + (value - start) i / w: `value` at step w (timm's
    CosineLRScheduler, nanochat's Muon momentum min(it / 300, 1)). DINO's linspace reaches it
    at step w - 1: a deliberate difference of at most (value - start) / w (docs/configs.md)."""
    s = Schedule.from_config(schedule_node(0.95, warmup=300, start=0.85), "m", 1000, 10)
    for it in (0, 1, 150, 299, 300, 301):
        assert s(it) == pytest.approx(0.85 * (1 - min(it / 300, 1)) + 0.95 * min(it / 300, 1))
