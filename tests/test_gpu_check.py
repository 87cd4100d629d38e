"""scripts/gpu_check.sh writes README's "What has run on a GPU" table itself (scripts/gpu_table.py);
its CPU dry run keeps working and never touches the README; what its checks measure (the probe of
every command, the rank comparison, the loader alone) works on the CPU."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402
import gpu_cluster  # noqa: E402
import gpu_probe  # noqa: E402
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


GRAPH_BREAK_AND_RECOMPILE = """
import sys, torch
def f(x):
    y = x.sin()
    print("a graph break")
    return y.cos()
g = torch.compile(f, backend="eager")
g(torch.randn(4)); g(torch.randn(4, 2))  # another rank: a recompile
sys.exit(3)
"""


@pytest.mark.slow  # ~10 s: a Python that imports torch and compiles twice
def test_the_probe_records_graph_breaks_recompiles_and_memory_and_keeps_the_exit_status(tmp_path):
    env = dict(os.environ, GPU_PROBE_DIR=str(tmp_path / "probe"))
    proc = subprocess.run([sys.executable, "scripts/gpu_probe.py", "-c", GRAPH_BREAK_AND_RECOMPILE], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    [rec] = [json.loads(p.read_text()) for p in (tmp_path / "probe").glob("*.json")]
    assert rec["graph_breaks"] >= 1 and rec["recompiles"] >= 1 and rec["graphs"] >= 2, rec
    assert rec["peak_gib"] is None and rec["rss_gib"] > 0  # no CUDA here: the resident set instead
    assert "Recompiling function f" in proc.stderr  # the log says why
    (tmp_path / "probe" / "2.json").write_text(json.dumps(dict(rec, peak_gib=3.5, graph_breaks=0, recompiles=2)))
    line, tot = gpu_probe.summary(tmp_path / "probe")
    assert tot["processes"] == 2 and tot["peak_gib"] == 3.5 and tot["recompiles"] == rec["recompiles"] + 2
    assert line.startswith("peak 3.5 GiB;") and f"{tot['graph_breaks']} graph breaks" in line


def test_a_check_passes_skips_or_fails_with_what_its_commands_used(tmp_path, capsys):
    args = argparse.Namespace(out=str(tmp_path), device="cpu", compile=True)
    c = gpu_check.Check(args)
    (tmp_path / "probe" / "echo").mkdir(parents=True)  # as the probe leaves it (test above)
    (tmp_path / "probe" / "echo" / "1.json").write_text(json.dumps(
        {"peak_gib": 2.0, "reserved_gib": 2.5, "rss_gib": 1.0, "graph_breaks": 0, "break_reasons": [],
         "recompiles": 1, "graphs": 3}))
    assert c.run("echo", lambda: c.sh("echo", ["sh", "-c", "echo hi"]) and "said hi") is True
    assert c.run("skipped", lambda: "SKIP: one GPU") is None
    assert c.run("broken", lambda: c.sh("broken", ["sh", "-c", "exit 2"])) is False
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("PASS echo") and out[0].endswith("said hi [peak 2.0 GiB; 3 graphs, 0 graph breaks, "
                                                              "1 recompiles]"), out[0]
    assert out[1].startswith("SKIP skipped") and out[1].endswith("one GPU")
    assert out[2].startswith("FAIL broken") and "exit status 2, expected 0" in out[2]
    assert c.failed == ["broken"] and (tmp_path / "echo.log").read_text().splitlines()[-1] == "hi"


def test_rank_fingerprints_that_differ_are_named():
    same = {"w": "a", "b": "c"}
    result = {"dino": {"phases": {"set-up": [same, same], "end": [same, {"w": "a", "b": "x", "extra": "y"}]}}}
    assert gpu_cluster.rank_differences(result) == ["dino end: 2 tensors differ (b, extra)"]
    assert gpu_cluster.rank_differences({"gpt": {"phases": {"set-up": [same, dict(same)]}}}) == []


@pytest.mark.parametrize("experiment,device_augment", [("dino_in1k", None), ("dino_in1k", "trainer.multicrop.device_augment"),
                                                       ("deit3_in1k", "data.device_augment")])
def test_the_loader_alone_is_measured_on_the_configs_own_feed(tmp_path, capsys, experiment, device_augment):
    """As the GPU legs measure it, also with the crops left to the device (the workers' decode alone)."""
    import fakedata

    fakedata.write_imagenet_folder(tmp_path / "imagenet", n_classes=2, per_class=8, size=40)
    size = [o for o in gpu_cluster.paper_sizes(True)[experiment] if not o.startswith("model=")]
    gpu_cluster.print_loader_rate([f"experiment={experiment}", "model=vits_5L", *size,
                                   f"data.root={tmp_path / 'imagenet'}", "trainer.global_batch_size=4",
                                   *([f"{device_augment}=true"] if device_augment else []),
                                   "trainer.num_workers=0", "trainer.device=cpu", f"paths.runs_dir={tmp_path}",
                                   f"run_dir={tmp_path / 'loader'}"], batches=3)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("LOADER ") and float(line.split()[1]) > 0


@pytest.mark.slow  # ~40 s (~100 s on 2 busy cores): the script itself on CPU, two of its checks
def test_cpu_dry_run_writes_its_rows_to_the_given_file_not_the_readme(tmp_path):
    """deit3_cifar100 trains, stops and resumes; analysis fails (no deit3_in1k checkpoint in a
    fresh --out): both rows land in --table's file, FAIL included, and README.md stays as it was
    (without --table a CPU run writes no table at all: test_only_a_cuda_run_writes_the_readme)."""
    readme = (ROOT / "README.md").read_bytes()
    table = tmp_path / "TABLE.md"
    table.write_text(DOC)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cpu", "--no-compile", "--tiny",
                           "--out", str(tmp_path / "out"), "--only", "deit3_cifar100", "analysis", "compile",
                           "--table", str(table)], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS deit3_cifar100" in proc.stdout and "FAIL analysis of CUDA checkpoints" in proc.stdout, proc.stdout
    assert "SKIP compile: eager = compiled" in proc.stdout  # --no-compile: nothing to compare
    assert (ROOT / "README.md").read_bytes() == readme
    text = table.read_text()
    assert _row(text, "`trainer=deit3` training").startswith("| `trainer=deit3` training | pass | ")
    row = _row(text, "`python -m analysis`")
    assert row.startswith("| `python -m analysis` | FAIL: analysis of CUDA checkpoints | ")
    assert " | cpu (dry run) | " in row and "--only deit3_cifar100 analysis compile --table" in row
