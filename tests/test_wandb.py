"""What a Slurm user reads: progress lines off a terminal, one line per evaluation, and W&B
(offline, no network): the mode's precedence, group and tags, evaluation results in the training
run's W&B run, and a resumed run that sends no step twice. The offline runs are read back from
their .wandb files (wandb 0.31 writes no wandb-summary.json offline)."""
from __future__ import annotations

import io
import json
import shutil
import struct
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from conftest import CONFIGS, TINY_VIT
from train import run
from train.logger import format_metrics, progress_bar, read_metrics, wandb_mode

wandb = pytest.importorskip("wandb")


def wandb_records(path: Path) -> list:
    """The protobuf records of a .wandb file: a 7-byte header, then LevelDB-log blocks of 32 KiB
    whose chunks (crc32 4, length 2, type 1: full / first / middle / last) carry `Record`s."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, out, buf = path.read_bytes(), 7, [], b""
    assert data[:4] == b":W&B", f"{path} is not a .wandb file"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and n == 0:
            break
        buf, pos = buf + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def _finished(folder: Path, timeout: float = 30.0) -> list:
    """The records of an offline run folder once its exit record is there (wandb's service may
    still be writing the file when `finish` has returned)."""
    deadline = time.monotonic() + timeout
    while True:
        files = list(folder.glob("run-*.wandb"))
        records = wandb_records(files[0]) if files else []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def offline_runs(run_dir: Path) -> list[dict]:
    """Each offline folder under <run_dir>/wandb, oldest first: id, group, tags, config keys,
    history steps (with their keys) and summary updates."""
    runs = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        info = {"folder": folder.name, "steps": [], "history": [], "summary": {}, "config": set()}
        for rec in _finished(folder):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                info.update(id=rec.run.run_id, group=rec.run.run_group, tags=list(rec.run.tags))
                info["config"] |= {i.key for i in rec.run.config.update}
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                info["steps"].append(rec.history.step.num)
                info["history"].append(items)
            elif kind == "summary":
                info["summary"].update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                        for i in rec.summary.update})
        runs.append(info)
    return runs


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """W&B offline, silent, its settings and cache under tmp_path."""
    for k, v in {"WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path / "wandb_dir"),
                 "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"), "WANDB_CONFIG_DIR": str(tmp_path / "wandb_cfg"),
                 "WANDB_DATA_DIR": str(tmp_path / "wandb_data")}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return monkeypatch


def test_progress_off_a_terminal_is_plain_lines(monkeypatch):
    err = io.StringIO()  # no isatty(): a Slurm log file
    monkeypatch.setattr(sys, "stderr", err)
    bar = progress_bar(5, interval=0, desc="features", unit="batch")
    for _ in range(5):
        bar.update(1)
    bar.close()
    lines = err.getvalue().splitlines()
    assert "\r" not in err.getvalue() and len(lines) >= 2, err.getvalue()
    assert all(ln.startswith("[laplace] features: ") for ln in lines) and "5/5 (100%)" in lines[-1]
    assert progress_bar(5, False, interval=0).disable  # another rank or progress=false: nothing
    err.truncate(0)
    err.seek(0)
    bar = progress_bar(20, interval=0.3, desc="paced")
    for _ in range(20):  # 1 s of updates: a line every 0.3 s, not one per update
        time.sleep(0.05)
        bar.update(1)
    bar.close()
    lines = err.getvalue().splitlines()
    assert 3 <= len(lines) <= 8 and len(set(lines)) == len(lines) and "20/20" in lines[-1], lines
    assert format_metrics(4, {"top1": 0.5, "n": 3}) == "[laplace] step 4: top1=0.5000, n=3"


def test_a_run_with_the_bar_prints_progress_lines_and_every_evaluation(make_cfg, tmp_path, capsys):
    cfg = make_cfg(*TINY_VIT, "model=vitt_0L", "model.depth=1", "trainer.max_steps=4", "trainer.eval_every=2",
                   "trainer.progress=true", "logger.progress_interval=0")
    run(cfg)
    out, err = capsys.readouterr()
    evals = [ln for ln in out.splitlines() if ln.startswith("[laplace] step ")]
    assert [ln.split(":")[0] for ln in evals] == ["[laplace] step 2", "[laplace] step 4"], out
    assert "val_acc1=" in evals[0]
    bars = [ln for ln in err.splitlines() if ln.startswith("[laplace] train: ")]
    assert bars and "\r" not in err and "4/4 (100%)" in bars[-1], err
    log = (tmp_path / "run" / "train.log").read_text()  # the run's own log holds both too
    assert evals[-1] in log and bars[-1] in log


def test_wandb_mode_config_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    mode, source = wandb_mode("offline")
    assert mode == "offline" and "WANDB_MODE=online in the environment is ignored" in source
    assert wandb_mode(None) == ("online", "WANDB_MODE (logger.wandb.mode is null)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_mode(None)[0] == "offline" and wandb_mode("disabled")[0] == "disabled"
    monkeypatch.delenv("WANDB_MODE")
    assert wandb_mode(None)[0] == "online"
    from laplace.errors import ConfigError
    from laplace.schema import check_config
    from train.config import TrainConfig

    with pytest.raises(ConfigError, match=r"^logger.wandb.mode=onlin: give online, offline or disabled \(or null: "
                                          r"WANDB_MODE decides\)$"):
        check_config({"logger": {"wandb": {"mode": "onlin"}}}, TrainConfig)


def _train(make_cfg, run_dir, *extra):
    return run(make_cfg(*TINY_VIT, "model=vitt_0L", "model.depth=1", "model.num_laplacian_heads=1",
                        "logger=wandb", "trainer.eval_every=2", *extra, run_dir=run_dir))


def test_wandb_group_tags_mode_and_eval_and_analysis_results_in_the_training_run(make_cfg, tmp_path, offline, capsys):
    offline.setenv("WANDB_MODE", "online")  # logger.wandb.mode=offline wins: no network is tried
    run_dir = tmp_path / "runs" / "deit3" / "toy_sweep" / "vitt_0L_s3"
    _train(make_cfg, run_dir, "trainer.max_steps=2", "seed=3")
    err = capsys.readouterr().err
    assert "[laplace] wandb mode offline (from logger.wandb.mode; WANDB_MODE=online in the environment " \
           "is ignored)" in err
    record = json.loads((run_dir / "wandb.json").read_text())
    assert record["mode"] == "offline" and record["group"] == "toy_sweep"
    (train_run,) = offline_runs(run_dir)
    assert train_run["id"] == record["id"] and train_run["group"] == "toy_sweep"
    assert train_run["tags"] == ["k=1", "toy_sweep", "seed=3", "vitt_d1_w48_1L"]  # the label follows the node (k = 1)
    assert train_run["steps"] == [1, 2] and "val_acc1" in train_run["history"][-1]

    # `python -m eval.knn` on the run's checkpoint: its numbers reach the same W&B run id.
    from eval.knn import evaluate_knn

    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        kcfg = compose("knn", overrides=[f"checkpoint={run_dir / 'ckpt/last.pt'}", "device=cpu", "num_workers=0",
                                         "ks=[5]", "k=5"])
    rec = evaluate_knn(kcfg)
    out = capsys.readouterr()
    assert f"logged to W&B run {record['id']}" in out.out
    assert "[laplace] cls features, digits train: " in out.err  # extraction progress (not a terminal)
    first, evaluation = offline_runs(run_dir)
    assert first["folder"] == train_run["folder"] and evaluation["id"] == record["id"]
    assert evaluation["group"] == "toy_sweep" and evaluation["steps"] == []  # summary only, no step
    assert evaluation["summary"]["knn/top1"] == pytest.approx(rec["knn"]["top1"])
    assert evaluation["summary"]["knn/per_k/5/top5"] == pytest.approx(rec["knn"]["per_k"]["5"]["top5"])

    # `python -m eval.linear` and `python -m analysis` on it: their numbers too, same id.
    from analysis.__main__ import headline, run as analyse
    from eval.linear import evaluate_linear

    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        lcfg = compose("linear", overrides=[f"checkpoint={run_dir / 'ckpt/last.pt'}", "device=cpu", "num_workers=0",
                                            "epochs=2", "lr_grid=[0.1]", "n_last_blocks=1"])
    lin = evaluate_linear(lcfg)
    assert offline_runs(run_dir)[-1]["summary"]["linear/top1"] == pytest.approx(lin["linear"]["top1"])

    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        acfg = compose("analysis", overrides=[f"checkpoint={run_dir / 'ckpt/last.pt'}", "device=cpu",
                                              "metrics=[anova,spectral]", "max_tokens=2000", "figures=false",
                                              "progress=false"])
    (res,) = analyse(acfg)
    *_, analysed = offline_runs(run_dir)
    assert analysed["id"] == record["id"] and len(offline_runs(run_dir)) == 4
    assert analysed["summary"]["analysis/within_seq_share"] == pytest.approx(headline(res)["within_seq_share"])


def test_a_resumed_run_sends_no_step_twice(make_cfg, tmp_path, offline):
    run_dir = tmp_path / "runs" / "deit3" / "toy" / "vitt_0L_s0"
    common = ("trainer.max_steps=6", "trainer.ckpt_every=2", "trainer.keep_every=2")
    _train(make_cfg, run_dir, *common, "trainer.stop_after=3")
    # A kill after step 3 was logged but before it was saved: the newest checkpoint is step 2's.
    shutil.copy(run_dir / "ckpt/step_2.pt", run_dir / "ckpt/last.pt")
    _train(make_cfg, run_dir, *common)
    first, resumed = offline_runs(run_dir)
    assert first["id"] == resumed["id"]
    assert first["steps"] == [1, 2, 3]
    assert resumed["steps"] == [4, 5, 6]  # step 3 again would be below W&B's last step
    steps = first["steps"] + resumed["steps"]
    assert steps == sorted(set(steps))
    assert [r["step"] for r in read_metrics(run_dir) if r["split"] == "train"] == [1, 2, 3, 4, 5, 6]


def test_at_the_default_log_cadence_a_resume_sends_no_step_twice(make_cfg, tmp_path, offline):
    """trainer.log_every=10 (the default): a stop at step 23, then a resume from step 10's checkpoint
    (a kill after step 20 was logged): W&B gets 10, 20, then 25 only; metrics.jsonl reads 10, 20, 25."""
    run_dir = tmp_path / "runs" / "deit3" / "toy" / "vitt_0L_s0"
    common = [o for o in TINY_VIT if not o.startswith("trainer.log_every=")]
    common += ["model=vitt_0L", "model.depth=1", "logger=wandb", "trainer.max_steps=25", "trainer.eval_every=100",
               "trainer.ckpt_every=10", "trainer.keep_every=10"]
    run(make_cfg(*common, "trainer.stop_after=23", run_dir=run_dir))
    shutil.copy(run_dir / "ckpt/step_10.pt", run_dir / "ckpt/last.pt")
    run(make_cfg(*common, run_dir=run_dir))
    first, resumed = offline_runs(run_dir)
    assert first["id"] == resumed["id"] and first["steps"] == [10, 20] and resumed["steps"] == [25]
    assert [r["step"] for r in read_metrics(run_dir) if r["split"] == "train"] == [10, 20, 25]


def test_a_fresh_start_after_an_attempt_without_checkpoint_gets_its_own_records(make_cfg, tmp_path, offline, capsys):
    """An attempt that died before its first checkpoint (here: its ckpt/ removed) left metrics.jsonl
    and wandb.json: the next run sets both aside (*.1.old) and logs to a W&B run of its own, so that
    neither file nor W&B history holds a step twice."""
    run_dir = tmp_path / "runs" / "deit3" / "toy" / "vitt_0L_s0"
    _train(make_cfg, run_dir, "trainer.max_steps=2")
    dead = json.loads((run_dir / "wandb.json").read_text())
    shutil.rmtree(run_dir / "ckpt")
    _train(make_cfg, run_dir, "trainer.max_steps=2")
    assert "set aside as *.1.old" in capsys.readouterr().out
    assert json.loads((run_dir / "wandb.json.1.old").read_text()) == dead
    assert (run_dir / "metrics.jsonl.1.old").read_text().count('"split": "train"') == 2
    assert [(r["step"], r["split"]) for r in read_metrics(run_dir)] == [(1, "train"), (2, "train"), (2, "val")]
    new = json.loads((run_dir / "wandb.json").read_text())["id"]
    assert new == f"{dead['id']}-1"
    first, second = offline_runs(run_dir)
    assert (first["id"], second["id"]) == (dead["id"], new) and first["steps"] == second["steps"] == [1, 2]


def test_lm_results_reach_the_gpt_runs_wandb_run(make_cfg, tmp_path, offline, pydoc_shards):
    """`python -m eval.lm` on a GPT run that used W&B: lm/<task>/<metric> in that run's summary."""
    pytest.importorskip("lm_eval")
    offline.setenv("HF_DATASETS_OFFLINE", "1")
    offline.setenv("HF_HUB_OFFLINE", "1")
    from eval.lm import evaluate_lm

    run_dir = tmp_path / "runs" / "gpt" / "gpt_tiny" / "gpt_d2_1L_s0"
    run(make_cfg("experiment=gpt_tiny", "model=gpt_d2_1L", f"data.root={pydoc_shards}", "data.vocab_size=512",
                 "data.seq_len=64", "trainer.global_batch_size=4", "trainer.max_steps=2", "trainer.num_workers=0",
                 "trainer.progress=false", "trainer.sample_prompts=[]", "logger=wandb", run_dir=run_dir))
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("lm_eval", overrides=[f"checkpoint={run_dir / 'ckpt/last.pt'}", "tasks=[laplace_pydoc]",
                                            "bootstrap_iters=0", "device=cpu", "limit=4"])
    [saved] = evaluate_lm(cfg)
    train_run, evaluation = offline_runs(run_dir)
    assert train_run["tags"] == ["k=1", "gpt_tiny", "seed=0", "gpt_d2_1L"] and evaluation["id"] == train_run["id"]
    assert evaluation["summary"]["lm/laplace_pydoc_mc/acc"] == pytest.approx(saved["laplace_pydoc_mc/acc"])


def test_the_wandb_config_resolves_from_the_command_line():
    """`python train.py logger=wandb --cfg job --resolve` prints the node: its ${run_group:...}
    resolver is registered before Hydra resolves."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "train.py", "logger=wandb", "model=vitt_1L", "--cfg", "job", "--resolve"],
                          cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "- k=1" in proc.stdout and "- vitt_1L" in proc.stdout
