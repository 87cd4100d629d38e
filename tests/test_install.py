"""What `pip install` gets: pyproject's ranges hold constraints.txt's exact set and this venv, only
`laplace` is a package of the wheel (the editable install puts the checkout on sys.path), and its one
console script, laplace-export, runs."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from conftest import ROOT

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
PINS = {canonicalize_name(name): Version(v) for name, v in
        (line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
         if line and not line.startswith("#"))}
REQS = [Requirement(r) for r in PROJECT["dependencies"] + PROJECT["optional-dependencies"]["test"]
        + PROJECT["optional-dependencies"]["lm"] + PROJECT["optional-dependencies"]["lora"]]


def test_every_dependency_is_a_range_that_holds_the_constraints():
    for req in REQS:
        ops = {s.operator for s in req.specifier}
        assert ">=" in ops and "<" in ops, f"{req}: a range, >= the lowest version run, < the next release line"
        name = canonicalize_name(req.name)
        assert name in PINS, f"{req.name} is not in constraints.txt: regenerate it (its header says how)"
        assert req.specifier.contains(PINS[name]), f"constraints.txt's {req.name}=={PINS[name]} is outside {req}"
    torch = next(r for r in REQS if r.name == "torch")
    assert str(torch.specifier) in ("<2.15,>=2.14", ">=2.14,<2.15")


def test_the_constraints_are_this_venv():
    """constraints.txt is the set the tests run on: in the venv scripts/env.sh builds, every package
    it pins is at its pinned version."""
    if os.path.realpath(sys.prefix) != os.path.realpath(ROOT / ".venv"):
        pytest.skip(f"this Python ({sys.prefix}) is not the venv scripts/env.sh builds ({ROOT / '.venv'})")
    # The first distribution of a name on sys.path, as metadata.version(name) reads it: an imported
    # setuptools appends its _vendor folder (older packaging, platformdirs, ...) to sys.path.
    installed = {}
    for d in metadata.distributions():
        installed.setdefault(canonicalize_name(d.metadata["Name"]), Version(d.version))
    differ = {n: (str(v), str(installed[n])) for n, v in PINS.items() if n in installed and installed[n] != v}
    assert not differ, f"installed versions differ from constraints.txt (pinned, installed): {differ}"


def test_the_install_scripts_use_the_constraints():
    env = (ROOT / "scripts/env.sh").read_text()
    assert '-c "$ROOT/constraints.txt"' in env and '"$ROOT/constraints.txt" | sha256sum' in env
    assert "-c constraints.txt" in (ROOT / ".ci/run").read_text()


def _run(args, cwd, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(not (ROOT / "laplace/export.py").exists(), reason="laplace/export.py is not in this checkout")
def test_laplace_export_runs(tmp_path):
    code = "import sys; sys.argv[0] = 'laplace-export'; from laplace.export import main; main()"
    p = _run([sys.executable, "-c", code, "--help"], tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]


@pytest.mark.timeout(200)
def test_the_wheel_holds_laplace_alone_and_the_editable_install_the_checkout(tmp_path):
    """setuptools builds both (no network: this venv's setuptools): the wheel's top-level package is
    `laplace` only, with its console script, the license and no configs; the editable wheel is a
    .pth naming the checkout, so train/, eval/, analysis/ and bench/ import from anywhere."""
    # The folder comes by the environment: setuptools reads sys.argv as setup.py's arguments.
    code = ("import os; from pathlib import Path; from setuptools import build_meta as b; out = os.environ['OUT']; "
            "Path(out, 'built').write_text(b.build_wheel(out) + ' ' + b.build_editable(out))")
    leftovers = [ROOT / "build", ROOT / "laplace.egg-info"]
    before = {d: d.exists() for d in leftovers}
    try:
        p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "OUT": str(tmp_path)},
                           capture_output=True, text=True, timeout=180)
    finally:  # setuptools builds in the project folder: leave the checkout as it was
        for d, existed in before.items():
            if not existed:
                shutil.rmtree(d, ignore_errors=True)
    assert p.returncode == 0, p.stderr[-3000:]
    wheel, editable = (tmp_path / name for name in (tmp_path / "built").read_text().split())
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        scripts = z.read(entry).decode()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"laplace"}
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    for name, target in PROJECT["scripts"].items():
        assert f"{name} = {target}" in scripts
    with zipfile.ZipFile(editable) as z:
        pth = [z.read(n).decode().strip() for n in z.namelist() if n.endswith(".pth")]
    assert pth == [str(ROOT)], pth
