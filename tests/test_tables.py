"""`python -m analysis.tables` and `python -m analysis.figures` on a real folder of tiny runs:
four 3-step ViTs (0 and 3 Laplacian heads x seeds 0, 1) and one GPT, each analysed, plus
results.json files in the trainers' exact format for the paper's ImageNet and CIFAR-100 rows.
Checks the records, the seed pooling against a hand computation, the written tables (paper
numbers, deltas, empty cells, recipe marks), the one-line error and the figures."""
from __future__ import annotations

import csv
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict
from scipy import stats as scipy_stats

from analysis import figures, runs as runs_mod, tables
from analysis.__main__ import analysis_dir
from analysis.geometry import analyze_checkpoint
from conftest import CONFIGS, ROOT, TINY_VIT
from laplace.errors import ConfigError
from laplace.io import write_json
from train import run as train_run

TINY_GPT = ["experiment=gpt_pydoc", "model=gpt_d2_1L", "data.seq_len=32", "trainer.global_batch_size=8",
            "trainer.num_workers=0", "trainer.progress=false", "trainer.max_steps=3"]
BENCH = [("arc_easy", "acc", 0.40), ("arc_challenge", "acc", 0.28), ("mmlu", "acc", 0.31), ("gsm8k", "acc", 0.05),
         ("humaneval", "pass@1", 0.08)]
VIT_FAMILY = "vitt_d2_w48"  # TINY_VIT overrides depth and width: its own family, never pooled with vitt


def _compose(*overrides, run_dir, config="config"):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose(config, overrides=list(overrides))
    with open_dict(cfg):
        cfg.run_dir = str(run_dir)
    return cfg


def _fake_run(run_dir: Path, overrides: list[str], acc1: float, steps: int, epochs: int) -> None:
    """A finished supervised run as train.py leaves it, without training: the resolved
    config.yaml and a results.json in DeiT3Trainer.on_fit_end's format."""
    cfg = _compose(*overrides, run_dir=run_dir)
    run_dir.mkdir(parents=True)
    OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    m, d, t = cfg.model, cfg.data, cfg.trainer
    block = {"val_acc1": acc1, "val_acc5": acc1 + 10, "val_loss": 1.0}
    (run_dir / "results.json").write_text(json.dumps({
        "model": m.name, "num_laplacian_heads": m.num_laplacian_heads, "laplacian_mode": m.laplacian_mode,
        "dataset": d.name, "seed": cfg.seed, "steps": steps, "epochs": epochs,
        "checkpoint": str(run_dir / "ckpt" / "last.pt"), "img_size": d.img_size, "patch_size": d.patch_size,
        "global_batch_size": t.global_batch_size, "loss": t.loss, "init_from": t.init_from,
        "final": block, "best": {**block, "step": steps}}, indent=2))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs/real: 4 tiny ViTs + 1 GPT, trained and analysed; runs/paper: fake paper-recipe runs."""
    root = tmp_path_factory.mktemp("tables") / "runs"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures run before conftest's per-test thread setting
    try:
        for model in ("vitt_0L", "vitt_3L"):
            for seed in (0, 1):
                d = root / "real" / "deit3" / "digits" / f"{model}_s{seed}"
                train_run(_compose(f"model={model}", *TINY_VIT, "trainer.max_steps=3", f"seed={seed}",
                                   f"paths.runs_dir={root}", run_dir=d))
                res = analyze_checkpoint(d / "ckpt" / "last.pt", max_tokens=17 * 48, progress=False)
                write_json(analysis_dir(d / "ckpt" / "last.pt") / "analysis.json", res)
        d = root / "real" / "gpt" / "gpt_pydoc" / "gpt_d2_1L_s0"
        train_run(_compose(*TINY_GPT, f"paths.runs_dir={root}", run_dir=d))
        res = analyze_checkpoint(d / "ckpt" / "last.pt", max_tokens=2048, min_count=2, progress=False)
        write_json(analysis_dir(d / "ckpt" / "last.pt") / "analysis.json", res)
        # a later evaluation's results.json inside the run: task records, fractions as nanochat writes
        write_json(d / "eval" / "results.json",
                   {"model": "gpt_d2_1L", "records": [{"task": t, "metric": m, "value": v} for t, m, v in BENCH]})
    finally:
        torch.set_num_threads(threads)
    # The paper's ImageNet recipe, two stages per seed: 800 epochs at 192 px, then ft224 from it.
    imagenet = {}
    for seed, acc in ((0, 81.30), (1, 81.40)):
        stage1 = root / "paper" / "deit3" / "deit3_in1k" / f"vitb_0L_s{seed}"
        _fake_run(stage1, ["experiment=deit3_in1k", "model=vitb_0L", f"seed={seed}"], 80.0, 500_000, 800)
        _fake_run(root / "paper" / "deit3" / "deit3_in1k_ft224" / f"vitb_0L_s{seed}",
                  ["experiment=deit3_in1k_ft224", "model=vitb_0L", f"seed={seed}",
                   f"trainer.init_from={stage1 / 'ckpt' / 'last.pt'}"], acc, 50_000, 20)
        imagenet[seed] = acc
    _fake_run(root / "paper" / "deit3" / "deit3_cifar100" / "vitb_12L_s0",
              ["experiment=deit3_cifar100", "model=vitb_12L"], 77.50, 80_000, 800)
    out = root.parent / "tables_out"
    tables.run(_compose(f"runs={root}", f"out={out}", run_dir=".", config="tables"))
    return {"root": root, "out": out, "imagenet": imagenet}


def _results(run_dir) -> dict:
    return json.loads((Path(run_dir) / "results.json").read_text())


def _acc(runs, k) -> list[float]:
    """final top-1 of the tiny ViTs with k Laplacian heads, read straight from results.json."""
    return [_results(d)["final"]["val_acc1"] for d in sorted(runs["root"].glob(f"real/deit3/digits/vitt_{k}L_s*"))]


def _csv(runs, name) -> list[dict]:
    with open(runs["out"] / f"{name}.csv") as f:
        return list(csv.DictReader(f))


def _md_rows(runs, name) -> dict:
    """Markdown table rows as {(model without marks, k): [cells]} plus the header."""
    lines = (runs["out"] / f"{name}.md").read_text().splitlines()
    grid = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines if ln.startswith("|")]
    head = grid[0]
    mi = head.index("model")
    return {"head": head, **{(r[mi].split("†")[0], r[mi + 1]): r for r in grid[2:]}}


def test_analysis_of_one_layer_given_as_a_number(runs):
    """layers=N (python -m analysis layers=1): that block and the final norm, recorded as given."""
    ckpt = runs["root"] / "real" / "gpt" / "gpt_pydoc" / "gpt_d2_1L_s0" / "ckpt" / "last.pt"
    res = analyze_checkpoint(ckpt, metrics=["spectral"], layers=1, max_tokens=256, min_count=2, progress=False)
    assert res["settings"]["layers"] == 1 and len(res["layers"]) == 2 and res["layers"][-1] == "norm"


def test_collect_finds_the_runs(runs):
    recs = runs_mod.collect(runs["root"] / "real")
    assert len(recs) == 5 and all(r["finished"] for r in recs)
    vit = sorted((r["model"], r["k"], r["seed"], r["family"]) for r in recs if r["trainer"] == "deit3")
    assert vit == [("vitt_d2_w48_0L", 0, 0, VIT_FAMILY), ("vitt_d2_w48_0L", 0, 1, VIT_FAMILY),
                   ("vitt_d2_w48_3L", 3, 0, VIT_FAMILY), ("vitt_d2_w48_3L", 3, 1, VIT_FAMILY)]
    gpt = next(r for r in recs if r["trainer"] == "gpt")
    assert (gpt["family"], gpt["k"], gpt["arch"], gpt["dataset"]) == ("gpt_d2", 1, "gpt", "pydoc_text")
    assert gpt["metrics"]["final.val_bpb"] > 0 and gpt["geometry"]["lc_cdnv_mean"] > 0
    r = next(r for r in recs if r["model"] == "vitt_d2_w48_3L")
    assert r["metrics"]["final.val_acc1"] == _results(r["run_dir"])["final"]["val_acc1"]
    assert set(r["geometry"]) >= {"within_seq_share", "between_class_share", "nc1", "n_pcs_0.99"}
    assert len({r["recipe_id"] for r in recs if r["trainer"] == "deit3"}) == 1  # seeds and k pool


def test_aggregate_matches_hand_computation(runs):
    recs = runs_mod.collect(runs["root"] / "real")
    rows = runs_mod.aggregate(recs, "final.val_acc1").to_dict("records")
    assert [(g["family"], g["k"], g["n"]) for g in rows] == [(VIT_FAMILY, 0, 2), (VIT_FAMILY, 3, 2)]
    for g in rows:
        vals = _acc(runs, g["k"])
        assert g["mean"] == pytest.approx(statistics.fmean(vals), abs=1e-12)
        assert g["sd"] == pytest.approx(statistics.stdev(vals), abs=1e-12) and sorted(g["seeds"]) == [0, 1]
        half = scipy_stats.t.ppf(0.975, 1) * statistics.stdev(vals) / math.sqrt(2)  # the 95% t interval, 1 df
        assert (g["lo"], g["hi"]) == pytest.approx((g["mean"] - half, g["mean"] + half))
    one = runs_mod.aggregate([r for r in recs if r["seed"] == 0], "geometry.nc1")
    assert (one["n"] == 1).all() and one["sd"].isna().all()


def test_written_tables_and_csv_numbers(runs):
    names = ("supervised", "lm", "ssl", "geometry", "geometry_lm")
    for name in names:
        for ext in ("md", "tex", "csv"):
            assert (runs["out"] / f"{name}.{ext}").stat().st_size > 100, (name, ext)
    recs = runs_mod.collect(runs["root"])
    acc = {(g["family"], g["k"], g["dataset"]): g for g in runs_mod.aggregate(recs, "final.val_acc1").to_dict("records")}
    rows = {(r["model"], r["k"], r["column"]): r for r in _csv(runs, "supervised")}
    for k in (0, 3):
        row, g = rows[(VIT_FAMILY, str(k), "digits")], acc[(VIT_FAMILY, k, "digits")]
        assert (float(row["mean"]), float(row["std"]), int(row["n"])) == (g["mean"], g["sd"], g["n"])
        assert row["seeds"] == "0 1" and row["paper"] == ""
    nc1 = {g["k"]: g for g in runs_mod.aggregate(recs, "geometry.nc1").to_dict("records")}
    geo = {(r["model"], r["k"], r["column"]): r for r in _csv(runs, "geometry")}
    assert float(geo[(VIT_FAMILY, "3", "nc1")]["mean"]) == nc1[3]["mean"]
    assert "\\begin{tabular}" in (runs["out"] / "supervised.tex").read_text()
    assert _md_rows(runs, "supervised")["head"] == ["model", "k", "ImageNet-1k", "CIFAR-100", "CIFAR-10", "digits"]


def test_paper_numbers_and_deltas(runs):
    rows = {(r["model"], r["k"], r["column"]): r for r in _csv(runs, "supervised")}
    mean = statistics.fmean(runs["imagenet"].values())
    inet = rows[("vitb", "0", "imagenet")]
    assert float(inet["mean"]) == pytest.approx(mean) and float(inet["paper"]) == 81.45
    assert float(inet["delta"]) == pytest.approx(mean - 81.45)
    assert "recipe differs" not in inet["notes"]  # the paper's recipe: vitb, 800 epochs + ft224
    assert "not pooled" in inet["notes"]  # the 192 px stage-1 runs share the cell, footnoted apart
    cifar = rows[("vitb", "12", "cifar100")]
    assert (float(cifar["paper"]), int(cifar["n"]), cifar["std"]) == (77.04, 1, "")
    assert float(cifar["delta"]) == pytest.approx(77.50 - 77.04)
    md = _md_rows(runs, "supervised")
    col = md["head"].index("ImageNet-1k")
    cell = md[("vitb", "0")][col]
    assert cell.startswith("81.35 ± 0.07 (2)†") and cell.endswith(" · paper 81.45, Δ −0.10"), cell
    assert md[("vitb", "12")][md["head"].index("CIFAR-100")] == "77.50 (1) · paper 77.04, Δ +0.46"
    assert md[("vitb", "12")][col] == "paper 82.32"  # no run: the paper's number alone
    lm = (runs["out"] / "geometry_lm.md").read_text()
    assert "paper 547.7" in lm and "paper 430.4" in lm
    assert "paper 30.06" in (runs["out"] / "lm.md").read_text()


def test_missing_cells_are_empty(runs):
    rows = {(r["model"], r["k"], r["column"]): r for r in _csv(runs, "supervised")}
    for cell in (rows[(VIT_FAMILY, "0", "imagenet")], rows[("vitb", "0", "digits")], rows[("vitb", "0", "cifar10")]):
        assert cell["mean"] == cell["std"] == cell["n"] == cell["delta"] == ""
    md = _md_rows(runs, "supervised")
    assert md[(VIT_FAMILY, "0")][md["head"].index("ImageNet-1k")] == ""
    assert md[("vitb", "0")][md["head"].index("CIFAR-10")] == ""
    ssl = (runs["out"] / "ssl.md").read_text()
    assert "No runs found" in ssl and "paper 29.81" in ssl and "paper 32.27" in ssl


def test_recipe_mark_on_miniature_runs(runs):
    md = _md_rows(runs, "supervised")
    text = (runs["out"] / "supervised.md").read_text()
    digits = md[(VIT_FAMILY, "0")][md["head"].index("digits")]
    assert digits.startswith(f"{statistics.fmean(_acc(runs, 0)):.2f} ± ") and "†" in digits
    mark = digits.split("†")[1]
    note = next(ln for ln in text.splitlines() if ln.startswith(f"†{mark} "))
    assert "recipe differs" in note and "dataset digits" in note and "3 steps" in note and VIT_FAMILY in note
    rows = {(r["model"], r["k"], r["column"]): r for r in _csv(runs, "supervised")}
    assert "recipe differs" in rows[(VIT_FAMILY, "3", "digits")]["notes"]
    geo = _md_rows(runs, "geometry")  # every cell of the row has it: shown once, on the model
    assert "†" in geo[(VIT_FAMILY, "3")][geo["head"].index("model")]
    assert "†" not in geo[(VIT_FAMILY, "3")][geo["head"].index("NC1 (class token)")]


def test_benchmark_columns_plug_in(runs):
    md = _md_rows(runs, "lm")
    assert md["head"][3:] == ["val bpb", "ARC-E", "ARC-C", "MMLU", "GSM8K", "HumanEval", "average"]
    row = md[("gpt_d2", "1")]
    assert row[md["head"].index("ARC-E")].startswith("40.00 (1)")
    assert row[md["head"].index("average")].startswith(f"{100 * statistics.fmean(v for *_, v in BENCH):.2f} (1)")
    assert md[("gpt_d20", "5")][md["head"].index("average")] == "paper 30.06"
    assert md[("gpt_d20", "5")][md["head"].index("ARC-E")] == ""


def test_generic_results_fields():
    got = runs_mod.flat_metrics({"model": "x", "steps": 5, "final": {"val_bpb": 1.5}, "ok": True,
                               "results": {"arc_easy": {"acc,none": 0.4}},
                               "records": [{"task": "mmlu", "metric": "acc", "value": 0.31}, {"task": "gsm8k", "value": 0.05}]})
    assert got == {"steps": 5.0, "final.val_bpb": 1.5, "results.arc_easy.acc,none": 0.4, "mmlu/acc": 0.31, "gsm8k": 0.05}
    assert runs_mod.model_family("gpt_d12_6L", {"depth": 12}) == "gpt_d12"
    assert runs_mod.model_family("vitb_12L", {"depth": 12, "embed_dim": 768}) == "vitb"


def test_bad_runs_path_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "analysis.tables", f"runs={tmp_path / 'nope'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(err) == 1 and err[0].startswith("error: runs="), proc.stderr[-2000:]
    assert "no such folder" in err[0]


def test_figures(runs):
    out = runs["root"].parent / "figures_out"
    paths = figures.run(_compose(f"runs={runs['root']}", f"out={out}", "pca_maps=2", "device=cpu",
                                 run_dir=".", config="figures"))
    want = ["vs_k", f"anova_digits_{VIT_FAMILY}", f"spectrum_digits_{VIT_FAMILY}", f"collapse_digits_{VIT_FAMILY}",
            f"pca_maps_digits_{VIT_FAMILY}", "anova_pydoc_text_gpt_d2", "spectrum_pydoc_text_gpt_d2",
            "collapse_pydoc_text_gpt_d2", f"blocks_digits_{VIT_FAMILY}", "blocks_pydoc_text_gpt_d2"]
    for stem in want:
        for ext in ("png", "pdf"):
            assert (out / f"{stem}.{ext}").stat().st_size > 5000, f"{stem}.{ext}"
    assert len(paths) == 2 * len(want)  # the fake runs have no analysis / checkpoint: skipped, not drawn


# ----------------------------------------------------------------------------- geometry at every block

# Where each headline key of analysis.runs.BLOCK_METRICS sits in analysis.json: (kind, group, key).
_IN_JSON = {"vit": {"within_seq_share": ("patch", "anova", "within_seq_share"),
                    "between_class_share": ("patch", "anova", "between_class_share"),
                    "nc1": ("cls", "nc", "nc1"), "patch_nc1": ("patch", "nc", "nc1"),
                    "n_pcs_0.99": ("patch", "spectral", "n_pcs_0.99"),
                    "per_seq_n_pcs_0.99": ("patch", "spectral_per_seq", "n_pcs_0.99")},
            "gpt": {"within_seq_share": ("tokens", "anova", "within_seq_share"),
                    "lc_cdnv_mean": ("tokens", "lc", "lc_cdnv_mean"), "n_pcs_0.99": ("tokens", "spectral", "n_pcs_0.99"),
                    "per_seq_n_pcs_0.99": ("tokens", "spectral_per_seq", "n_pcs_0.99")}}


def _from_json(record: dict, layer: str, key: str) -> float:
    res = json.loads(Path(record["analysis"]).read_text())
    kind, group, name = _IN_JSON[record["arch"]][key]
    return res["results"][kind][layer][group][name]


def test_layer_geometry_holds_every_block(runs):
    recs = runs_mod.collect(runs["root"] / "real")
    assert len(recs) == 5
    for r in recs:  # depth 2 (TINY_VIT, gpt_d2), analysed with the default layers=all
        assert list(r["layer_geometry"]) == ["blocks.0", "blocks.1", "norm"]
        assert r["geometry"] == r["layer_geometry"]["norm"]
        for layer in r["layer_geometry"]:
            for key in _IN_JSON[r["arch"]]:
                want = _from_json(r, layer, key)
                assert r["layer_geometry"][layer][key] == want
                assert runs_mod.metric_value(r, f"geometry@{layer}.{key}") == want
    with pytest.raises(ConfigError, match="geometry@<layer>.<key>"):
        runs_mod.metric_value(recs[0], "geometry@block1.nc1")


def test_per_block_pools_seeds_at_every_layer(runs):
    recs = [r for r in runs_mod.collect(runs["root"] / "real") if r["arch"] == "vit"]
    rows = runs_mod.per_block(recs).to_dict("records")
    cells = {(g["k"], g["layer"], g["metric"]): g for g in rows}
    assert len(cells) == len(rows) == 2 * 3 * len(_IN_JSON["vit"])  # k x layers x metrics, nothing missing
    for (k, layer, key), g in cells.items():
        vals = [_from_json(r, layer, key) for r in sorted(recs, key=lambda r: r["seed"]) if r["k"] == k]
        assert g["values"] == vals and g["mean"] == statistics.fmean(vals) and g["n"] == 2
        assert g["se"] == pytest.approx(statistics.stdev(vals) / 2 ** 0.5, rel=1e-12)
        assert g["hi"] - g["mean"] == pytest.approx(scipy_stats.t.ppf(0.975, 1) * g["se"], rel=1e-9)


def test_per_block_table(runs):
    for ext in ("md", "tex", "csv"):
        assert (runs["out"] / f"per_block.{ext}").stat().st_size > 200, ext
    recs = runs_mod.collect(runs["root"] / "real")
    rows = _csv(runs, "per_block")
    vit = [r for r in rows if r["experiment"] == f"digits_{VIT_FAMILY}"]
    gpt = [r for r in rows if r["experiment"] == "pydoc_text_gpt_d2"]
    assert len(vit) == 2 * 3 * len(_IN_JSON["vit"]) and len(gpt) == 3 * len(_IN_JSON["gpt"])
    for row in vit + gpt:
        runs_k = [r for r in recs if r["k_label"] == row["k"] and r["arch"] == ("gpt" if row in gpt else "vit")]
        vals = [_from_json(r, row["layer"], row["metric"]) for r in runs_k]
        assert float(row["mean"]) == statistics.fmean(vals) and int(row["n"]) == len(vals), row
    md = (runs["out"] / "per_block.md").read_text()
    section = md.split(f"#### digits_{VIT_FAMILY}: NC1 (class token)")[1].split("####")[0]
    grid = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in section.splitlines() if ln.startswith("|")]
    assert grid[0] == ["layer", "k=0", "k=3"]
    nc1 = [_from_json(r, "blocks.0", "nc1") for r in recs if r["k"] == 0 and r["arch"] == "vit"]
    half = scipy_stats.t.ppf(0.975, 1) * statistics.stdev(nc1) / math.sqrt(2)  # the 95% t interval, 1 df
    m = statistics.fmean(nc1)
    assert grid[2][:2] == ["blocks.0", f"{m:.4g} [{m - half:.4g}, {m + half:.4g}] (2, df 1)"]
    assert "NC1 (class token)" not in md.split("pydoc_text_gpt_d2")[1]  # a GPT has no class token
    assert "\\begin{tabular}" in (runs["out"] / "per_block.tex").read_text()


def test_unknown_table_kind_is_refused():
    with pytest.raises(ConfigError, match=r"tables.x.kind=grid: unknown"):
        tables.load_specs(specs={"x": {"kind": "grid"}})
    with pytest.raises(ConfigError, match=r"tables.per_block.metrics: 'acc'"):
        tables.per_block_table("per_block", {"metrics": ["acc"]}, [])


def test_blocks_figure_with_missing_metrics(runs, tmp_path):
    recs = [r for r in runs_mod.collect(runs["root"] / "real") if r["arch"] == "vit"]
    other = [{**r, "layer_geometry": {n: {"cdnv_mean": 1.0} for n in r["layer_geometry"]}} for r in recs]
    assert figures.draw_blocks(other, tmp_path / "none", "x") == []  # no headline metric: no figure
    # the k = 0 arm analysed without NC: its line is absent from the NC1 panel, the rest drawn
    part = [{**r, "layer_geometry": {n: {k: v for k, v in g.items() if r["k"] or not k.endswith("nc1")}
                                     for n, g in r["layer_geometry"].items()}} for r in recs]
    paths = figures.draw_blocks(part, tmp_path / "part", "x")
    assert [p.name for p in paths] == ["part.png", "part.pdf"] and all(p.stat().st_size > 5000 for p in paths)


# ----------------------------------------------------------------------------- geometry on the paper's objects

# Each geometry column and the analysis.json value it reads: (kind, group, key).
_GEOMETRY_COLUMNS = {
    "geometry": [("within-sequence share", "within_seq_share", ("patch", "anova", "within_seq_share")),
                 ("between-class share", "between_class_share", ("patch", "anova", "between_class_share")),
                 ("within-sequence var", "within_seq_var", ("patch", "anova", "within_seq")),
                 ("between-class var", "between_class_var", ("patch", "anova", "between_class")),
                 ("NC1 (sequence means)", "patch_nc1", ("patch", "nc", "nc1")),
                 ("NC1 (class token)", "nc1", ("cls", "nc", "nc1")),
                 ("PCs 99% (global)", "n_pcs_0.99", ("patch", "spectral", "n_pcs_0.99")),
                 ("PCs 99% (pooled within-sequence)", "within_n_pcs_0.99", ("patch", "spectral_within", "n_pcs_0.99")),
                 ("PCs 99% (per sequence; mean)", "per_seq_n_pcs_0.99", ("patch", "spectral_per_seq", "n_pcs_0.99"))],
    "geometry_lm": [("PCs 99% (global)", "n_pcs_0.99", ("tokens", "spectral", "n_pcs_0.99")),
                    ("PCs 99% (pooled within-window)", "within_n_pcs_0.99", ("tokens", "spectral_within", "n_pcs_0.99")),
                    ("PCs 99% (per window; mean)", "per_seq_n_pcs_0.99", ("tokens", "spectral_per_seq", "n_pcs_0.99")),
                    ("CDNV (next token)", "lc_cdnv_mean", ("tokens", "lc", "lc_cdnv_mean")),
                    ("within-window share", "within_seq_share", ("tokens", "anova", "within_seq_share")),
                    ("within-window var", "within_seq_var", ("tokens", "anova", "within_seq"))]}


def test_geometry_tables_name_their_objects(runs):
    """The geometry tables' columns, each read from its own object of every run's analysis.json
    and pooled over seeds."""
    recs = [r for r in runs_mod.collect(runs["root"] / "real")]
    for name, cols in _GEOMETRY_COLUMNS.items():
        md = _md_rows(runs, name)
        assert md["head"][md["head"].index("k") + 1:] == [label for label, *_ in cols], name
        sheet = {(r["model"], r["k"], r["column"]): r for r in _csv(runs, name)}
        arch = "gpt" if name == "geometry_lm" else "vit"
        for label, key, (kind, group, field) in cols:
            for k in sorted({r["k"] for r in recs if r["arch"] == arch}):
                mine = [r for r in recs if r["arch"] == arch and r["k"] == k]
                vals = [json.loads(Path(r["analysis"]).read_text())["results"][kind]["norm"][group][field] for r in mine]
                assert [r["geometry"][key] for r in mine] == vals, (name, key)
                row = sheet[(mine[0]["family"], str(k), key)]
                assert float(row["mean"]) == pytest.approx(statistics.fmean(vals), rel=1e-12) and int(row["n"]) == len(vals)
    lm = _md_rows(runs, "geometry_lm")
    assert lm[("gpt_d20", "0")][lm["head"].index("PCs 99% (per window; mean)")] == "paper 547.7"
    assert lm[("gpt_d20", "0")][lm["head"].index("PCs 99% (global)")] == ""


def test_the_papers_number_sits_only_beside_the_papers_model():
    """A 2-layer GPT with k = 0 fills the geometry_lm row k = 0 of its own family: the paper's
    547.7 PCs (its depth-20 model) stays in the gpt_d20 row and no delta is printed between them
    (issue 47: "Δ -442.1" compared a toy with the paper's model)."""
    rec = {"run_dir": "/x/gpt_d2_0L_s0", "trainer": "gpt", "dataset": "pydoc_text", "family": "gpt_d2",
           "model": "gpt_d2_0L", "arch": "gpt", "k": 0, "k_label": "0", "mode": "fixed", "seed": 0,
           "recipe_id": "r", "recipe": "gpt, 3 steps", "finished": True, "steps": 3, "metrics": {},
           "geometry": {"per_seq_n_pcs_0.99": 105.6}, "layer_geometry": {"norm": {"per_seq_n_pcs_0.99": 105.6}}}
    spec = tables.load_specs(["geometry_lm"])["geometry_lm"]
    table = tables.build_table("geometry_lm", spec, [rec], tables.load_paper())
    c = table["cells"].set_index(["model", "k_label", "column"])
    toy, paper = c.loc[("gpt_d2", "0", "per_seq_n_pcs_0.99")], c.loc[("gpt_d20", "0", "per_seq_n_pcs_0.99")]
    assert toy["mean"] == 105.6 and toy["paper"] is None and toy["delta"] is None
    assert paper["paper"] == 547.7 and paper["n"] is None
    text = tables.grid(table).to_string()
    assert "Δ" not in text and "paper 547.7" in text


def test_rows_by_seed_gives_a_row_per_seed():
    """rows_by: [seed] (the gpt26_sweep table of the 2026 GPT's sweep) splits the seeds of one recipe
    into rows of their own instead of pooling them into a row named by the first seed."""
    recs = [{"run_dir": f"/x/gpt_d2_1L_s{s}", "experiment": "gpt26_sweep", "trainer": "gpt", "dataset": "d",
             "family": "gpt_d2", "model": "gpt_d2_1L", "arch": "gpt", "k": 1, "k_label": "1", "mode": "fixed",
             "seed": s, "recipe_id": "r", "recipe": "gpt, 3 steps", "finished": True, "steps": 3,
             "metrics": {"final.val_bpb": bpb, **({"core.core_metric": 0.12} if s == 0 else {})}}
            for s, bpb in ((0, 1.23), (1, 1.25))]
    spec = {"where": {"experiment": "gpt26_sweep"}, "rows_by": ["seed"], "fmt": ".0f",
            "columns": [{"name": "val_bpb", "metric": "final.val_bpb", "fmt": ".4f"},
                        {"name": "core", "metric": ["core/core_metric", "core.core_metric"], "optional": True}]}
    cells = tables.build_table("gpt26_sweep", spec, recs, {})["cells"].set_index(["seed", "column"])
    assert [(cells.loc[(s, "val_bpb"), "mean"], cells.loc[(s, "val_bpb"), "n"]) for s in (0, 1)] == [(1.23, 1), (1.25, 1)]
    assert cells.loc[(0, "core"), "mean"] == 0.12 and cells.loc[(1, "core"), "n"] is None
