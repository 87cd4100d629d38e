"""One Hydra entry decorator (train.cli.hydra_entry) for every command line: configs/ found in
one place (also after a non-editable install, where no configs/ sits beside the code), model
nodes registered, a `???` left unset or any bad input as one `error:` line."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

ENTRIES = {"train.py": "config", "eval/knn.py": "knn", "eval/linear.py": "linear", "eval/segmentation.py":
           "segmentation", "eval/lm.py": "lm_eval", "eval/generate.py": "generate", "eval/core.py": "core",
           "analysis/__main__.py": "analysis", "analysis/tables.py": "tables", "analysis/figures.py": "figures",
           "analysis/curves.py": "curves", "prepare.py": "prepare"}


def _run(args, cwd, **env):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_every_entry_point_uses_the_one_decorator():
    for path, name in ENTRIES.items():
        assert f'hydra_entry("{name}")' in (ROOT / path).read_text(), path
    for path in sorted(ROOT.glob("*.py")) + sorted(p for d in ("laplace", "train", "eval", "analysis")
                                                   for p in (ROOT / d).rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel == "train/cli.py":
            continue
        assert "hydra.main(" not in path.read_text(), f"{rel}: use train.cli.hydra_entry"
    for path in ENTRIES:  # configs/ by a path of their own (read a config file: train.cli.config_dir)
        assert not re.search(r"""["']configs["']""", (ROOT / path).read_text()), path


def test_a_missing_mandatory_value_is_one_line():
    p = _run(["-m", "eval.knn"], ROOT, PYTHONPATH=str(ROOT))
    assert p.returncode == 1 and p.stderr.strip().splitlines() == [
        "error: checkpoint is required: add checkpoint=<value> to the command"], p.stderr[-2000:]


def test_configs_found_without_a_checkout_beside_the_code(tmp_path):
    """The packages copied alone, away from any checkout (the folders on PYTHONPATH): run from
    elsewhere, one line says where configs/ was looked for; LAPLACE_CONFIG_DIR or a checkout as
    the working directory supply it. Hydra still names the job after the entry module."""
    site = tmp_path / "site"
    for pkg in ("laplace", "eval", "train", "analysis"):
        shutil.copytree(ROOT / pkg, site / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    args = ["-m", "eval.knn", f"checkpoint={tmp_path / 'none.pt'}"]
    lost = _run(args, elsewhere, PYTHONPATH=str(site))
    err = lost.stderr.strip().splitlines()
    assert lost.returncode == 1 and len(err) == 1 and err[0].startswith("error: no knn.yaml in "), lost.stderr[-2000:]
    assert "LAPLACE_CONFIG_DIR=<checkout>/configs" in err[0]
    for cwd, env in ((elsewhere, {"LAPLACE_CONFIG_DIR": str(ROOT / "configs")}), (ROOT, {})):
        found = _run(args, cwd, PYTHONPATH=str(site), **env)
        assert found.returncode == 1 and found.stderr.strip().splitlines() == [
            f"error: checkpoint={tmp_path / 'none.pt'}: no such file or folder; pass a laplace checkpoint (runs/.../"
            f"ckpt/last.pt), a run or export folder, or to eval.knn / eval.linear a timm state dict with model=<zoo name>"]
    job = _run(["-m", "eval.knn", "--cfg", "hydra"], elsewhere, PYTHONPATH=str(site),
               LAPLACE_CONFIG_DIR=str(ROOT / "configs"))
    assert job.returncode == 0 and re.search(r"^\s+name: knn$", job.stdout, re.M), job.stdout[-2000:] + job.stderr


def test_any_zoo_name_composes_from_the_zoo_config_source(tmp_path):
    """model=<any zoo name> composes (hydra_plugins/laplace_zoo.py): here a depth no list holds; an
    unknown name is the zoo's one-line error, not Hydra's list of options."""
    p = _run(["train.py", "model=gpt_d37_1L", "--cfg", "job", "--package", "model"], ROOT, PYTHONPATH=str(ROOT))
    assert p.returncode == 0 and "name: gpt" in p.stdout and "depth: 37" in p.stdout, p.stderr[-2000:]
    assert "num_laplacian_heads: 1" in p.stdout
    helped = _run(["train.py", "--help"], ROOT, PYTHONPATH=str(ROOT))  # the names' forms, not ~80 names
    assert "model: gpt_d{depth}_{k}L, vitb_{0..12}L, vitl_{0..16}L, vits_{0..6}L, vitt_{0..3}L" in helped.stdout
    bad = _run(["train.py", "model=vitb_13L"], ROOT, PYTHONPATH=str(ROOT))
    assert bad.returncode == 1 and bad.stderr.strip().splitlines()[0] == (
        "error: model 'vitb_13L' asks for 13 Laplacian heads but has only 12 heads per layer; use k in 0..12")


def test_help_opens_with_the_entry_and_an_example():
    """`--help` opened with Hydra's generic "X is powered by Hydra." and no example (issue 53)."""
    import yaml

    for path, name in {**ENTRIES, "analysis/report.py": "report"}.items():
        header = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())["hydra"]["help"]["header"]
        command = "python " + (path if path.count("/") == 0 else "-m " + path[:-3].replace("/", ".")
                               .removesuffix(".__main__"))
        lines = header.splitlines()
        assert lines[0].startswith(f"{command}: ") and lines[1].startswith(f"  {command} "), (name, header)
    r = _run(["-m", "analysis.curves", "--help"], ROOT)
    assert r.returncode == 0 and r.stdout.startswith("python -m analysis.curves: learning curves") and \
        "powered by Hydra" not in r.stdout and "\n  python -m analysis.curves runs=" in r.stdout
