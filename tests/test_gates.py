"""Learned Laplacian gates (laplacian_mode=learned): they start where they can move, no
trainer's optimizer decays them, the engine logs them per layer and head, and the miniature
reports where they ended and how far they moved."""
from __future__ import annotations

import math
import sys

import pytest
import torch
from omegaconf import OmegaConf

from conftest import ROOT, TINY_VIT
from laplace import create_model
from laplace.attention import GATE_START_LOGIT, gate_metrics, learned_gates
from laplace.checkpoint import load_model, save_checkpoint
from train import run
from train.dino import dino_param_groups
from train.logger import read_metrics
from train.optim import build_muon_adamw, build_optimizer

sys.path.insert(0, str(ROOT / "scripts"))
import miniature  # noqa: E402


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
    opt = build_optimizer(model, cfg)
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


def test_miniature_reports_start_end_and_move(tmp_path):
    runs = []
    for seed, shift in [(0, 0.5), (1, 1.5)]:  # the logits moved by +-shift: mean move is +-1.0
        model = create_model("vitt_1L", img_size=32, num_classes=10, depth=2, embed_dim=48, laplacian_mode="learned")
        with torch.no_grad():
            model.blocks[1].attn.laplacian_gate.add_(torch.tensor([shift, 0.0, -shift]))
        cfg = {"model": {"name": "vitt_1L", "num_laplacian_heads": 1}}
        save_checkpoint(tmp_path / f"r{seed}/ckpt/last.pt", model=model, config=cfg)
        runs.append(tmp_path / f"r{seed}")
    lines = miniature.gate_report(runs)
    s, sig = 1 / (1 + math.exp(1)), lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    up = (sig(-1 + 0.5) + sig(-1 + 1.5)) / 2
    down = (sig(1 - 0.5) + sig(1 - 1.5)) / 2
    assert lines[0] == f"block 0: h0 {s:.3f} -> {s:.3f} (+0.000), h1 {s:.3f} -> {s:.3f} (+0.000), " \
                       f"h2 {1 - s:.3f} -> {1 - s:.3f} (+0.000)"
    assert lines[1] == (f"block 1: h0 {s:.3f} -> {up:.3f} ({up - s:+.3f}), h1 {s:.3f} -> {s:.3f} (+0.000), "
                        f"h2 {1 - s:.3f} -> {down:.3f} ({down - (1 - s):+.3f})")
    assert lines[2] == f"largest move of a gate: {max(up - s, 1 - s - down):.3f}"
