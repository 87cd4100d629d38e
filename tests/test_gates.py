"""Learned Laplacian gates (laplacian_mode=learned): they start where they can move, no
trainer's optimizer decays them, every trainer logs them per layer and head, and
analysis/gates.py reports where they went (start, trajectory, end; table, figure, summary)."""
from __future__ import annotations

import math
import statistics

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf
from scipy import stats as scipy_stats

from conftest import ROOT, TINY_VIT
from test_dino import TINY_DINO
from test_gpt_trainer import TINY_GPT
from analysis.figures import draw_figures
from analysis.gates import gate_groups, run_gates, summary
from analysis.runs import collect
from analysis.tables import render_tables
from laplace import create_model
from laplace.attention import GATE_START_LOGIT, gate_metrics, gate_start_logits, learned_gates
from laplace.checkpoint import load_checkpoint, load_model
from train import run
from train.dino import dino_param_groups
from train.logger import read_metrics
from train.optim import build_muon_adamw, build_optimizers



def _gate_ids(model):
    return {id(p) for n, p in model.named_parameters() if n.endswith("laplacian_gate")}


def _decay_of(optimizers, ids) -> set[float]:
    return {g["weight_decay"] for opt in optimizers for g in opt.param_groups
            for p in g["params"] if id(p) in ids}


@pytest.mark.parametrize("optim", ["adamw", "lamb"])
def test_deit3_optimizers_do_not_decay_gates(optim):
    """timm's factory (DeiT-III's AdamW / LAMB) keeps 1-D parameters out of weight decay."""
    model = create_model("vitt_1L", img_size=32, num_classes=10, laplacian_mode="learned")
    cfg = OmegaConf.load(ROOT / f"configs/optim/{optim}.yaml")
    opt = build_optimizers(model, cfg)[optim]
    ids = _gate_ids(model)
    assert len(ids) == 12 and _decay_of([opt], ids) == {0.0}
    assert cfg.weight_decay in {g["weight_decay"] for g in opt.param_groups}  # others do decay


def test_dino_param_groups_do_not_decay_gates():
    model = create_model("vitt_1L", img_size=32, num_classes=0, laplacian_mode="learned")
    opt = torch.optim.AdamW(dino_param_groups(model, 0.04))
    assert _decay_of([opt], _gate_ids(model)) == {0.0}


def test_muon_adamw_does_not_decay_gates_even_with_weight_decay():
    model = create_model("gpt_d2_1L", vocab_size=300, laplacian_mode="learned")
    cfg = OmegaConf.merge(OmegaConf.load(ROOT / "configs/optim/muon.yaml"), {"weight_decay": 0.1})
    opts = build_muon_adamw(model, cfg)
    assert _decay_of(opts.values(), _gate_ids(model)) == {0.0}
    assert _decay_of(opts.values(), {id(model.wte.weight)}) == {0.1}  # the embedding keeps it


def test_gates_start_with_a_slope_that_lets_them_move():
    model = create_model("gpt_d2_1L", vocab_size=300, laplacian_mode="learned")
    a = learned_gates(model)
    assert list(a) == ["blocks.0", "blocks.1"]
    start = 1 / (1 + math.exp(-GATE_START_LOGIT))
    assert a["blocks.0"] == pytest.approx([start])  # one head, the Laplacian one (k = 1)
    assert start * (1 - start) > 10 * (0.982 * 0.018)  # 11x the slope of the old start (+-4)


def test_engine_logs_gates_per_layer_and_head(make_cfg, tmp_path):
    cfg = make_cfg(*TINY_VIT, "model=vitt_1L", "model.laplacian_mode=learned", "trainer.max_steps=3",
                   "optim.lr=1e-2", run_dir=tmp_path / "r")
    run(cfg)
    train = [r for r in read_metrics(tmp_path / "r") if r.get("split") == "train"]
    assert len(train) == 3
    keys = {k for k in train[-1] if k.startswith("gate.")}
    assert keys == {f"gate.blocks.{i}.h{h}" for i in range(2) for h in range(3)}
    model = load_model(tmp_path / "r/ckpt/last.pt")
    assert {k: train[-1][k] for k in keys} == pytest.approx(gate_metrics(model), abs=1e-7)
    assert train[0]["gate.blocks.0.h2"] != train[-1]["gate.blocks.0.h2"]  # they moved


# One tiny learned-gate run per paradigm, logging every step (steps: their trainer.max_steps).
PARADIGMS = {
    "deit3": [*TINY_VIT, "model=vitt_1L", "optim.lr=1e-2"],
    "gpt": [a for a in TINY_GPT if not a.startswith("trainer.max_steps")],
    "dino": [*TINY_DINO, "model=vitt_1L", "trainer.head.use_bn=false"],
}


def _train(make_cfg, run_dir, paradigm: str, seed: int = 0, steps: int = 3):
    run(make_cfg(*PARADIGMS[paradigm], "model.laplacian_mode=learned", f"trainer.max_steps={steps}",
                 f"seed={seed}", run_dir=run_dir))


def _ckpt_gates(run_dir) -> list[list[float]]:
    """sigmoid(gate) per block and head, straight from the checkpoint's state dict."""
    sd = load_checkpoint(run_dir / "ckpt/last.pt")["model"]
    keys = sorted((k for k in sd if k.endswith("laplacian_gate")), key=lambda k: int(k.split(".")[1]))
    return [torch.sigmoid(sd[k].float()).tolist() for k in keys]


@pytest.mark.parametrize("paradigm", list(PARADIGMS))
def test_every_trainer_logs_gates_and_the_report_reads_them(paradigm, make_cfg, tmp_path):
    """deit3, gpt and dino log gate.blocks.<i>.h<h> every log step (dino: the exported teacher's
    gates, as its checkpoint holds them); run_gates reads start, trajectory and end exactly."""
    _train(make_cfg, tmp_path / "r", paradigm)
    [rec] = collect(tmp_path / "r")
    g, notes = run_gates(rec)

    def at(point):  # [step][block][head] of one point kind, steps in order
        part = g[g["point"] == point]
        return [[[a for a in part[(part["step"] == s) & (part["block"] == b)].sort_values("head")["a"]]
                 for b in sorted(set(part["block"]))] for s in sorted(set(part["step"]))]

    train = [r for r in read_metrics(tmp_path / "r") if r.get("split") == "train"]
    [start], trajectory, [end] = at("start"), at("logged"), at("end")
    depth, heads = len(end), len(end[0])
    logged = [[[r[f"gate.blocks.{i}.h{h}"] for h in range(heads)] for i in range(depth)] for r in train]
    steps = sorted(set(g.loc[g["point"] != "end", "step"]))
    assert steps == [0, 1, 2, 3] and trajectory == logged  # the same cadence in all three
    assert start == [torch.sigmoid(gate_start_logits(heads, 1)).tolist()] * depth  # vitt_1L / gpt_d2_1L: k = 1
    assert end == _ckpt_gates(tmp_path / "r") == trajectory[-1] and not notes
    assert set(g.loc[g["point"] == "end", "step"]) == {rec["steps"]}


def test_gates_pooled_over_seeds_into_a_table_and_a_figure(make_cfg, tmp_path):
    for seed in (0, 1):
        _train(make_cfg, tmp_path / f"runs/s{seed}", "deit3", seed=seed)
    records = collect(tmp_path / "runs")
    [g] = gate_groups(records)
    ends = [_ckpt_gates(tmp_path / f"runs/s{seed}") for seed in (0, 1)]
    gates = g["gates"].set_index(["block", "head"])
    assert g["n"] == 2 and g["seeds"] == [0, 1] and g["layers"] == ["blocks.0", "blocks.1"]
    assert len(gates) == 2 * 3 and sorted(set(g["gates"]["head"])) == [0, 1, 2]
    e = [ends[0][1][2], ends[1][1][2]]
    b1h2 = gates.loc[(1, 2)]
    assert b1h2["end"] == pytest.approx(statistics.fmean(e))
    half = scipy_stats.t.ppf(0.975, 1) * statistics.stdev(e) / math.sqrt(2)  # the 95% t interval, 1 df
    assert (b1h2["end_lo"], b1h2["end_hi"]) == pytest.approx((b1h2["end"] - half, b1h2["end"] + half))
    assert b1h2["move"] == pytest.approx(statistics.fmean(e) - b1h2["start"])
    assert b1h2["end_hi"] > b1h2["end_lo"]  # the seeds differ
    last = g["traj"][g["traj"]["step"] == g["traj"]["step"].max()].set_index(["block", "head"])
    assert list(last["mean"]) == list(gates["end"]) and sorted(set(g["traj"]["step"])) == [0, 1, 2, 3]

    paths = render_tables(records, tmp_path / "tables", echo=False)
    name = f"gates_{g['name']}"
    assert tmp_path / f"tables/{name}.md" in paths and tmp_path / f"tables/{name}.csv" in paths
    md = (tmp_path / f"tables/{name}.md").read_text()
    s, a = float(b1h2["start"]), float(b1h2["end"])
    grid = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in md.splitlines() if ln.startswith("|")]
    assert grid[0] == ["block", "h0", "h1", "h2"] and grid[3][0] == "1"
    assert grid[3][1].startswith(f"{gates.loc[(1, 0), 'start']:.3f} → ")
    assert grid[3][3] == f"{s:.3f} → {a:.3f} [{b1h2['end_lo']:.3f}, {b1h2['end_hi']:.3f}]"
    assert all(line in md for line in summary(g))
    rows = (tmp_path / f"tables/{name}.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * 3 and rows[-1].startswith(f"blocks.1,2,{s!r},{a!r},")
    figs = draw_figures(records, tmp_path / "figures", vs_k={})
    assert {tmp_path / f"figures/{name}.png", tmp_path / f"figures/{name}.pdf"} <= set(figs)
    assert all(p.stat().st_size > 0 for p in figs)

    (tmp_path / "runs/s1/ckpt/last.pt").unlink()  # a run whose checkpoint was deleted: said, left out
    skipped = []
    [g1] = gate_groups(collect(tmp_path / "runs"), skipped)
    one = g1["gates"]
    assert g1["n"] == 1 and [list(one[one["block"] == b]["end"]) for b in (0, 1)] == ends[0]
    assert one["end_lo"].isna().all()
    assert skipped == [f"{tmp_path / 'runs/s1/ckpt/last.pt'}: not found (or no learned gates in it); "
                       f"{tmp_path / 'runs/s1'} left out"]


def test_summary_answers_which_heads_went_laplacian():
    """Known gates: of 4 heads, h1 of block 0 crossed 0.5 upward (its interval above 0), h2 (started
    Laplacian) fell (its interval below 0), the rest moved within their intervals."""
    lo, hi = 1 / (1 + math.exp(1)), 1 / (1 + math.exp(-1))
    gates = pd.DataFrame({"layer": ["blocks.0", "blocks.0", "blocks.1", "blocks.1"], "head": [0, 1, 0, 1],
                          "start": [lo, lo, lo, hi], "end": [lo + 0.01, 0.6, lo, hi - 0.3]})
    gates["move"] = gates["end"] - gates["start"]
    half = pd.Series([0.05, 0.1, 0.01, 0.2])
    gates["move_lo"], gates["move_hi"] = gates["move"] - half, gates["move"] + half
    g = {"gates": gates, "n": 3}
    top = 0.6 - lo
    assert summary(g) == [
        "moved toward Laplacian (end > start): 2 of 4 heads (50%; 1 with a 95% interval above 0); away from it: "
        "1 (1 below 0)",
        "ended above 0.5: 1 of 4 heads (started above 0.5: 1): blocks.0 h1 0.600",
        "crossed 0.5 toward Laplacian: blocks.0 h1",
        "crossed 0.5 toward standard: blocks.1 h1",
        f"moved most: blocks.0 h1 {lo:.3f} -> 0.600 ({top:+.3g} [{top - 0.1:+.3g}, {top + 0.1:+.3g}])",
        "mean move of the 1 heads that started Laplacian: -0.3",
        f"mean move of the 3 heads that started standard: {(0.01 + 0.6 - lo) / 3:+.3g}",
    ]
