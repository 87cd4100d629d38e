"""`python -m analysis.curves` on tiny trained runs: a panel per metric and a line per k in the
figure, the mean and band over seeds on known logged values, globs, and one-line errors."""
from __future__ import annotations

import json
import math
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scipy import stats
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from analysis.curves import band_of, run
from conftest import CONFIGS, ROOT, TINY_VIT
from train import run as train_run
from train.logger import MetricsLogger


def _train(model: str, seed: int, tmp) -> str:
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("config", overrides=[f"model={model}", *TINY_VIT, "trainer.max_steps=4", "trainer.eval_every=2",
                                           f"seed={seed}", f"paths.runs_dir={tmp / 'runs'}"])
    with open_dict(cfg):
        cfg.run_dir = str(tmp / "digits" / f"{model}_s{seed}")
    train_run(cfg)
    return cfg.run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three 4-step tiny ViTs: k=0 (seed 0) and k=1 (seeds 0, 1), evaluated at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("curves")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures run before conftest's per-test thread setting
    try:
        dirs = [_train(m, s, tmp) for m, s in (("vitt_0L", 0), ("vitt_1L", 0), ("vitt_1L", 1))]
    finally:
        torch.set_num_threads(threads)
    return tmp / "digits", dirs


def _curves(*overrides):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return run(compose("curves", overrides=list(overrides)))


def _logged(run_dir, key):
    lines = [json.loads(ln) for ln in open(f"{run_dir}/metrics.jsonl")]
    return {r["step"]: r[key] for r in lines if key in r}


def test_a_panel_per_metric_a_line_per_k(runs, tmp_path):
    root, dirs = runs
    got = _curves(f"runs={root}", f"out={tmp_path / 'fig'}")
    assert [p.name for p in got["paths"]] == ["fig.png", "fig.pdf", "fig.json"]
    assert all(p.stat().st_size > 1000 for p in got["paths"][:2])
    # the default metrics: the train loss, then what deit3 evaluates
    assert [ax.get_title() for ax in got["axes"]] == ["loss", "val_loss", "val_acc1", "val_acc5"]
    for ax in got["axes"]:
        assert [ln.get_label() for ln in ax.get_lines()] == ["k=0 (1 seed)", "k=1 (2 seeds)"]
        assert len(ax.collections) == 2  # a band per line
    # the k=1 line is the mean of its two seeds' logged values at every step
    k1 = got["axes"][0].get_lines()[1]
    s0, s1 = _logged(dirs[1], "loss"), _logged(dirs[2], "loss")
    assert list(k1.get_xdata()) == [1, 2, 3, 4]
    assert list(k1.get_ydata()) == pytest.approx([(s0[s] + s1[s]) / 2 for s in (1, 2, 3, 4)])
    val = got["data"]["val_acc1"]["k=1 (2 seeds)"]
    a, b = _logged(dirs[1], "val_acc1"), _logged(dirs[2], "val_acc1")
    assert val["x"] == [2, 4] and val["n"] == [2, 2]
    sd = [statistics.stdev([a[s], b[s]]) for s in (2, 4)]
    assert val["hi"] == pytest.approx([(a[s] + b[s]) / 2 + d for s, d in zip((2, 4), sd)])
    saved = json.loads(got["paths"][2].read_text())
    assert saved["band"] == "sd" and saved["metrics"]["val_acc1"]["k=1 (2 seeds)"]["mean"] == pytest.approx(val["mean"])


def test_mean_and_band_on_known_values(runs, tmp_path):
    """Two seeds whose metrics.jsonl (written by the trainers' logger) hold known losses."""
    _, dirs = runs
    known = {0: [3.0, 2.0, 1.0], 1: [5.0, 2.0, 2.0]}
    for seed, losses in known.items():
        d = tmp_path / "runs" / f"vitt_1L_s{seed}"
        d.mkdir(parents=True)
        shutil.copy(f"{dirs[1]}/config.yaml", d / "config.yaml")  # the run's k and recipe
        log = MetricsLogger(d)
        for step, v in enumerate(losses, 1):
            log.log(step, {"loss": v, "lr": 0.1}, split="train")
        log.log(3, {"val_acc1": 50.0 + seed}, split="val", epoch=0)
    t1 = stats.t.ppf(0.975, 1)  # the 95% t interval of a mean of two seeds: +-12.7 se
    for band, lo, hi in [("sd", [4 - math.sqrt(2), 2, 1.5 - math.sqrt(0.5)], [4 + math.sqrt(2), 2, 1.5 + math.sqrt(0.5)]),
                         ("minmax", [3, 2, 1], [5, 2, 2]), ("ci", [4 - t1, 2, 1.5 - t1 / 2], [4 + t1, 2, 1.5 + t1 / 2])]:
        got = _curves(f"runs={tmp_path / 'runs'}", f"out={tmp_path / band}", f"band={band}", "metrics=[loss,val_acc1]")
        line = got["data"]["loss"]["k=1 (2 seeds)"]
        assert line["x"] == [1, 2, 3] and line["mean"] == pytest.approx([4, 2, 1.5])
        assert line["lo"] == pytest.approx(lo) and line["hi"] == pytest.approx(hi), band
        assert line["values"] == [[3, 5], [2, 2], [1, 2]]
        assert got["data"]["val_acc1"]["k=1 (2 seeds)"]["mean"] == [50.5]
    assert band_of([7.0], "sd") == (7.0, 7.0, 7.0)  # one seed: no band


def test_runs_of_different_trainers_share_only_what_they_logged(runs, tmp_path):
    """A run of another trainer that never logged val_acc1 (a GPT: loss and val_bpb) beside the
    ViTs: each panel has the lines of the runs that logged its metric (issue 47: this crashed with
    `max() arg is an empty sequence`)."""
    import yaml

    root, dirs = runs
    folder = tmp_path / "mixed"
    shutil.copytree(root, folder / "deit3")
    cfg = yaml.safe_load(open(f"{dirs[0]}/config.yaml"))
    cfg["trainer"]["name"], cfg["data"]["name"] = "gpt", "pydoc_text"
    gpt = folder / "gpt" / "gpt_s0"
    gpt.mkdir(parents=True)
    (gpt / "config.yaml").write_text(yaml.safe_dump(cfg))
    log = MetricsLogger(gpt)
    for step in (1, 2):
        log.log(step, {"loss": 5.0 - step}, split="train")
    log.log(2, {"val_bpb": 2.5}, split="val", epoch=0)
    got = _curves(f"runs={folder}", f"out={tmp_path / 'mixed_fig'}")
    titles = [ax.get_title() for ax in got["axes"]]
    assert titles == ["loss", "val_loss", "val_acc1", "val_acc5", "val_bpb"]
    lines = {t: [ln.get_label() for ln in ax.get_lines()] for t, ax in zip(titles, got["axes"])}
    assert len(lines["loss"]) == 3 and len(lines["val_acc1"]) == 2 and len(lines["val_bpb"]) == 1
    assert lines["val_bpb"][0].endswith("k=0 (1 seed)") and not any("pydoc" in x for x in lines["val_acc1"])
    assert got["data"]["val_bpb"][lines["val_bpb"][0]]["mean"] == [2.5]
    # one model, one colour in every panel (the GPT line was C2 in loss's panel, C0 alone in val_bpb's)
    colours = {}
    for ax in got["axes"]:
        for ln in ax.get_lines():
            assert colours.setdefault(ln.get_label(), ln.get_color()) == ln.get_color(), ln.get_label()
    assert len(set(colours.values())) == 3
    # the y-axis says the unit and which way is better
    assert [ax.get_ylabel() for ax in got["axes"]][2:] == ["val_acc1 (%, higher is better)", "val_acc5 (%, higher "
                                                           "is better)", "val_bpb (bits per byte, lower is better)"]


def test_curves_go_to_reports_not_into_runs(runs, tmp_path, monkeypatch):
    """out= unset wrote <runs folder>/curves.*: a file among the runs; now reports/curves.* of the cwd."""
    root, _ = runs
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in root.iterdir())
    got = _curves(f"runs={root}", "metrics=[loss]")
    assert [str(p) for p in got["paths"]] == ["reports/curves.png", "reports/curves.pdf", "reports/curves.json"]
    assert (tmp_path / "reports" / "curves.png").is_file()
    assert sorted(p.name for p in root.iterdir()) == before


def test_glob_epoch_and_errors(runs, tmp_path):
    root, _ = runs
    got = _curves(f"runs={root}/vitt_1L_*", f"out={tmp_path / 'g'}", "metrics=[loss]", "x=epoch")
    assert [ln.get_label() for ln in got["axes"][0].get_lines()] == ["k=1 (2 seeds)"]
    assert got["axes"][0].get_xlabel() == "epoch" and got["data"]["loss"]["k=1 (2 seeds)"]["x"] == [0]
    for overrides, expect in [([f"runs={root}", "band=iqr"], "band=iqr: choose one of"),
                              ([f"runs={root}", "x=tokens"], "x=tokens: choose one of"),
                              ([f"runs={root}/nothing_*"], "matches no folder"),
                              ([f"runs={root}", "metrics=[nope]"], "no run logged any of them"),
                              ([f"runs={tmp_path / 'none'}"], "no such folder")]:
        with pytest.raises(ValueError, match=expect):
            _curves(*overrides, f"out={tmp_path / 'e'}")


def test_command_line(runs, tmp_path):
    root, _ = runs
    proc = subprocess.run([sys.executable, "-m", "analysis.curves", f"runs={root}", f"out={tmp_path / 'c'}",
                           "metrics=[loss]"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == f"[curves] wrote {tmp_path / 'c.json'}"
    bad = subprocess.run([sys.executable, "-m", "analysis.curves", f"runs={tmp_path / 'none'}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    err = bad.stderr.strip().splitlines()
    assert bad.returncode == 1 and len(err) == 1 and err[0].startswith(f"error: runs={tmp_path / 'none'}: no such folder")


def test_layer_panels_say_their_unit_or_direction(monkeypatch):
    """The per-layer figures' panels had no y label: which way NC1 or CDNV means collapse was unsaid."""
    import pandas as pd

    import analysis.figures as figures

    monkeypatch.setattr(figures, "save", lambda fig, stem: fig)  # the figure itself, not files
    stats = pd.DataFrame([{"line": "k=0", "metric": m, "layer": layer, "mean": 1.0, "sd": 0.1, "lo": 0.9,
                           "hi": 1.1, "n": 2} for m in ("nc1", "total_var") for layer in ("blocks.0", "norm")])
    fig = figures.layer_figure(stats, [("nc1", "NC1", True), ("total_var", "total variance", True)],
                               ["blocks.0", "norm"], "t", Path("unused"), ylabel=figures.YLABELS["collapse"])
    assert [ax.get_ylabel() for ax in fig.axes[:2]] == ["lower = more collapse", "variance (trace of the covariance)"]
    assert fig.axes[0].get_xlabel() == "block (norm = the final norm)"
