"""scripts/gpu_check.sh writes README's "What has run on a GPU" table itself (scripts/gpu_table.py);
its CPU dry run keeps working and never touches the README."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402
import gpu_table  # noqa: E402

DOC = f"""# Title

before the table | with a pipe

{gpu_table.BEGIN}
| Trainer / evaluation | Last GPU run | Date (UTC) | GPU | Commit | Command (checks) |
|---|---|---|---|---|---|
| `trainer=dino` | pass | 2026-11-30 10:00 | NVIDIA A100 | `abc1234` | `bash scripts/gpu_check.sh` (dino_digits) |
| `python -m analysis` | never |  |  |  |  |
{gpu_table.END}

after the table
"""


def _row(text: str, label: str) -> str:
    return next(ln for ln in text.splitlines() if ln.startswith(f"| {label} |"))


def test_rows_of_the_checks_that_ran_are_rewritten_the_others_kept():
    ran = {"deit3_in1k": True, "deit3_in1k_ft224 (init_from a CUDA run)": True, "deit3_cifar100": False,
           "analysis of CUDA checkpoints": True}
    new = gpu_table.update(DOC, ran, "2026-12-01 08:00", "NVIDIA H200", "1a2b3c4+dirty",
                           "bash scripts/gpu_check.sh --only deit3_in1k deit3_cifar100 analysis")
    cmd = "`bash scripts/gpu_check.sh --only deit3_in1k deit3_cifar100 analysis`"
    deit3 = "deit3_in1k, deit3_in1k_ft224 (init_from a CUDA run), deit3_cifar100"
    assert _row(new, "`trainer=deit3` training") == (
        f"| `trainer=deit3` training | FAIL: deit3_cifar100 | 2026-12-01 08:00 | NVIDIA H200 | `1a2b3c4+dirty` | "
        f"{cmd} ({deit3}) |")
    assert _row(new, "`trainer=deit3` evaluation") == _row(new, "`trainer=deit3` training").replace(
        "training", "evaluation")
    assert _row(new, "`python -m analysis`") == (
        f"| `python -m analysis` | pass | 2026-12-01 08:00 | NVIDIA H200 | `1a2b3c4+dirty` | {cmd} "
        "(analysis of CUDA checkpoints) |")
    assert _row(new, "`trainer=dino`") == _row(DOC, "`trainer=dino`")  # not run now: its last run stays
    assert _row(new, "`python -m eval.generate`") == "| `python -m eval.generate` | never |  |  |  |  |"
    table = new.split(gpu_table.BEGIN)[1].split(gpu_table.END)[0]
    labels = [ln.split(" | ")[0][2:] for ln in table.splitlines()[3:]]
    assert labels == list(gpu_table.ROWS)  # every row, in the table's order
    before, after = DOC.split(gpu_table.BEGIN)[0], DOC.split(gpu_table.END)[1]
    assert new.startswith(before) and new.endswith(gpu_table.END + after)
    assert gpu_table.update(new, {}, "x", "x", "x", "x") == new  # rows round-trip through their cells


def test_a_pipe_in_a_cell_is_escaped_and_read_back():
    new = gpu_table.update(DOC, {"seg_linear": True}, "d", "GPU | 2", "r", "bash scripts/gpu_check.sh --only seg_linear")
    assert "| GPU \\| 2 |" in _row(new, "`trainer=seg_linear` / `python -m eval.segmentation`")
    assert gpu_table.update(new, {}, "x", "x", "x", "x") == new


def test_the_readme_holds_the_table_as_the_script_writes_it():
    readme = (ROOT / "README.md").read_text()
    assert gpu_table.update(readme, {}, "x", "x", "x", "x") == readme


def test_missing_markers_are_one_clear_error():
    with pytest.raises(ValueError, match="gpu-table:begin"):
        gpu_table.update(DOC.replace(gpu_table.END, ""), {}, "d", "g", "r", "c")


def test_only_a_cuda_run_writes_the_readme(tmp_path):
    assert gpu_check.table_path(None, "cpu") is None
    assert gpu_check.table_path(None, "cuda") == ROOT / "README.md"
    assert gpu_check.table_path(None, "cuda:1") == ROOT / "README.md"
    assert gpu_check.table_path(str(tmp_path / "T.md"), "cpu") == tmp_path / "T.md"


def test_commit_is_short_and_says_dirty(tmp_path):
    git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True, timeout=30)  # noqa: E731
    git("init", "-q")
    (tmp_path / "f").write_text("1")
    git("add", "f")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    head = git("rev-parse", "--short", "HEAD").stdout.decode().strip()
    assert gpu_table.commit(tmp_path) == head
    (tmp_path / "untracked").write_text("run outputs do not count")
    assert gpu_table.commit(tmp_path) == head
    (tmp_path / "f").write_text("2")
    assert gpu_table.commit(tmp_path) == head + "+dirty"


@pytest.mark.slow  # ~40 s (~100 s on 2 busy cores): the script itself on CPU, two of its checks
def test_cpu_dry_run_writes_its_rows_to_the_given_file_not_the_readme(tmp_path):
    """deit3_cifar100 trains, stops and resumes; analysis fails (no deit3_in1k checkpoint in a
    fresh --out): both rows land in --table's file, FAIL included, and README.md stays as it was
    (without --table a CPU run writes no table at all: test_only_a_cuda_run_writes_the_readme)."""
    readme = (ROOT / "README.md").read_bytes()
    table = tmp_path / "TABLE.md"
    table.write_text(DOC)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cpu", "--no-compile", "--tiny",
                           "--out", str(tmp_path / "out"), "--only", "deit3_cifar100", "analysis",
                           "--table", str(table)], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS deit3_cifar100" in proc.stdout and "FAIL analysis of CUDA checkpoints" in proc.stdout, proc.stdout
    assert (ROOT / "README.md").read_bytes() == readme
    text = table.read_text()
    assert _row(text, "`trainer=deit3` training").startswith("| `trainer=deit3` training | pass | ")
    row = _row(text, "`python -m analysis`")
    assert row.startswith("| `python -m analysis` | FAIL: analysis of CUDA checkpoints | ")
    assert " | cpu (dry run) | " in row and "--only deit3_cifar100 analysis --table" in row
