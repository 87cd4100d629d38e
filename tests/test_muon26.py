"""optim=muon26, nanochat 92d63d4's MuonAdamW and horizon: the parameter groups by name, the
schedules and scaling rules against hand-computed values, and (with LAPLACE_NANOCHAT pointing at a
nanochat checkout) one optimizer step and the first steps' lr, momentum and decay against its code."""
from __future__ import annotations

import csv
import json
import math
import os
import re
import sys

import pytest
import torch
from omegaconf import OmegaConf

from laplace import create_model
from laplace.errors import ConfigError
from train.optim import apply_group_schedules, build_muon26, build_schedules, muon26_groups
from train import run
from train.plan import nanochat_scaling, resolve_batch

CFG = OmegaConf.load("configs/optim/muon26.yaml")
NANOCHAT = os.environ.get("LAPLACE_NANOCHAT")


class Tiny26(torch.nn.Module):
    """The 2026 GPT's parameter names (upstream's where new) and shapes: width 16, 2 heads of 8 and
    1 kv head (GQA: qkv rows [16, 8, 8]), value embeddings on layer 1, vocabulary 32."""

    def __init__(self, C=16, kv=8, V=32):
        super().__init__()
        P, L = torch.nn.Parameter, torch.nn.Linear
        self.width = C
        self.wte, self.lm_head = torch.nn.Embedding(V, C), L(C, V, bias=False)
        self.value_embeds = torch.nn.ModuleDict({"1": torch.nn.Embedding(V, kv)})
        self.resid_lambdas, self.x0_lambdas = P(torch.ones(2)), P(torch.zeros(2))
        self.smear_gate, self.smear_lambda = L(24, 1, bias=False), P(torch.zeros(1))
        self.backout_lambda = P(torch.ones(1))
        self.blocks = torch.nn.ModuleList()
        for i in range(2):
            b = torch.nn.Module()
            b.attn, b.mlp = torch.nn.Module(), torch.nn.Module()
            b.attn.qkv, b.attn.proj = L(C, C + 2 * kv, bias=False), L(C, C, bias=False)
            if i == 1:
                b.attn.ve_gate = L(12, 1, bias=False)
            b.mlp.c_fc, b.mlp.c_proj = L(C, 4 * C, bias=False), L(4 * C, C, bias=False)
            self.blocks.append(b)


def test_groups_route_the_2026_names_as_nanochat_and_refuse_unknown_ones():
    model = Tiny26()
    groups = {g: [n for n, _ in ps] for g, ps in muon26_groups(model).items()}
    assert sorted(groups["smear"]) == ["backout_lambda", "smear_gate.weight", "smear_lambda"]
    assert groups["value_embeds"] == ["value_embeds.1.weight"]
    assert "blocks.1.attn.ve_gate.weight" in groups["matrices"]  # upstream: all of transformer.h -> Muon
    assert groups["qkv"] == ["blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.weight"]
    opts = build_muon26(model, CFG, lr_scale=0.5, muon_weight_decay=0.1)
    adam = {g["name"]: g for g in opts["adamw"].param_groups}
    w = (16 / 768) ** -0.5
    assert adam["unembedding"]["lr"] == pytest.approx(0.008 * w * 0.5)
    assert adam["embedding"]["lr"] == pytest.approx(0.3 * w * 0.5) and adam["embedding"]["betas"] == (0.8, 0.995)
    assert adam["value_embeds"]["lr"] == pytest.approx(0.15 * w * 0.5)
    assert adam["resid_lambdas"]["lr"] == pytest.approx(0.0025) and adam["resid_lambdas"]["weight_decay"] == 0.05
    assert adam["x0_lambdas"]["betas"] == (0.96, 0.95)
    assert adam["smear"]["lr"] == 0.2  # not batch-scaled (nanochat's constant)
    muon = {g["name"]: g for g in opts["muon"].param_groups}
    assert muon["qkv"]["row_splits"] == [16, 8, 8] and muon["qkv"]["lr"] == pytest.approx(0.01)
    assert muon["matrices"]["weight_decay"] == 0.1
    model.blocks[0].attn.norm_scale = torch.nn.Parameter(torch.ones(8))
    with pytest.raises(ConfigError, match="blocks.0.attn.norm_scale"):
        build_muon26(model, CFG)


def test_the_current_gpt_trains_a_step_with_muon26():
    model = create_model("gpt_d2_1L", vocab_size=64, laplacian_mode="learned")
    opts = build_muon26(model, CFG)
    assert {g["name"] for g in opts["adamw"].param_groups} == {"unembedding", "embedding", "laplacian_gates"}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randint(0, 64, (2, 16))
    for _ in range(3):  # nanochat's zero output layers: every weight has a gradient from the third step
        model(x, targets=x).backward()
        for opt in opts.values():
            opt.step()
            opt.zero_grad()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())
    state = opts["muon"].state[model.blocks[0].attn.qkv.weight]
    assert [tuple(v.shape) for v in state["second_momentum_buffer"]] == [(128, 1)] * 3  # q, k, v apart


def test_schedules_are_base_trains_rules_by_hand():
    """N = 2000: warm-up (s + 1) / 40, warm-down over the last round(1300) steps to 0.05; momentum
    0.85 -> 0.97 over 400 steps, 0.97 -> 0.90 over the warm-down; decay cos from 1 to 0."""
    s = build_schedules(CFG.schedules, "optim.schedules", total_steps=2000, steps_per_epoch=2000)
    assert [s["lr"](i) for i in (0, 1, 38, 39, 700)] == pytest.approx([0.025, 0.05, 0.975, 1.0, 1.0])
    assert s["lr"](1350) == pytest.approx(0.525) and s["lr"](1999) == pytest.approx(0.05 + 0.95 / 1300)
    assert [s["momentum"](i) for i in (0, 200, 400, 700, 1350)] == pytest.approx([0.85, 0.91, 0.97, 0.97, 0.935])
    assert [s["weight_decay"](i) for i in (0, 1000, 2000)] == pytest.approx([1.0, 0.5, 0.0])
    # the AdamW groups keep their decay; Muon's is the multiplier x its scaled decay
    opts = build_muon26(Tiny26(), CFG, muon_weight_decay=0.2)
    apply_group_schedules(opts, s, 1000)
    assert {g["name"]: g["weight_decay"] for g in opts["adamw"].param_groups}["unembedding"] == 0.01
    assert all(g["weight_decay"] == pytest.approx(0.1) and g["momentum"] == pytest.approx(0.97 - 0.07 * 300 / 1300)
               for g in opts["muon"].param_groups)


def config(**over):
    """A composed-like config: the d12 reference shapes with vocabulary 32,768 and context 2048."""
    base = dict(model=dict(name="gpt", depth=12, num_laplacian_heads=0, vocab_size=32768, max_seq_len=2048),
                data=dict(seq_len=2048), trainer=dict(global_batch_size=None, max_steps=None), optim=CFG)
    return OmegaConf.merge(base, over)


def test_batch_lr_and_decay_scaling_by_hand():
    # d12 (768 wide, 6 heads): blocks 12 x 12 x 768^2 = 84,934,656, lm_head 32,768 x 768 = 25,165,824
    d12 = nanochat_scaling(config())
    assert (d12.params, d12.reference_params) == (110_100_480, 110_100_480)
    assert (d12.batch_tokens, d12.lr_scale, d12.tokens, d12.steps) == (524288, 1.0, 1_321_205_760, 2520)
    assert d12.muon_weight_decay == pytest.approx(0.28)
    # d20 (1280 wide): blocks 20 x 12 x 1280^2 = 393,216,000, lm_head 41,943,040; D / D_ref = 3.9523...
    d20 = nanochat_scaling(config(model=dict(depth=20)))
    ratio = 435_159_040 / 110_100_480
    assert d20.batch_tokens == 2 ** round(math.log2(524288 * ratio ** 0.383)) == 1_048_576
    assert d20.lr_scale == pytest.approx(math.sqrt(2)) and d20.steps == int(12 * 435_159_040) // 1_048_576 == 4980
    assert d20.muon_weight_decay == pytest.approx(0.28 * math.sqrt(2) / ratio)
    # a FLOPs budget sets the steps only; k does not move the reference
    f = nanochat_scaling(config(model=dict(depth=20, num_laplacian_heads=2), optim=dict(horizon=dict(flops=1e18))))
    assert f.batch_tokens == d20.batch_tokens and f.reference_params == d12.params
    with torch.device("meta"):
        model = create_model("gpt", depth=20, num_laplacian_heads=2, vocab_size=32768, max_seq_len=2048)
    fpt = model.flops_per_token(2048)
    assert f.steps == round(1e18 / (fpt * 1_048_576))
    # an explicit batch and max_steps win
    cfg = resolve_batch(config(trainer=dict(global_batch_size=4, max_steps=7), data=dict(seq_len=256)))
    s = nanochat_scaling(cfg)
    assert (cfg.trainer.global_batch_size, s.batch_tokens, s.steps) == (4, 1024, 7)
    assert s.lr_scale == pytest.approx(1 / math.sqrt(512))
    assert resolve_batch(config()).trainer.global_batch_size == 256  # 524,288 / 2,048


SWEEP = ["experiment=gpt26_sweep", "data=pydoc_text", "data.vocab_size=257", "data.seq_len=32", "data.val_tokens=256",
         "model.depth=2", "trainer.global_batch_size=4", "trainer.max_steps=3", "trainer.eval_every=3",
         "trainer.log_every=1", "trainer.progress=false", "trainer.num_workers=0"]


def test_the_sweep_runs_cell_by_cell_and_its_table_renders(make_cfg, tmp_path):
    """Two cells of the grid (k = 0, 1) at toy size, one re-run (it resumes at its end), and the
    gpt26_sweep table of `python -m analysis.tables` over them: one row per cell."""
    from analysis.runs import collect
    from analysis.tables import render_tables

    cells = {k: tmp_path / "runs" / "gpt26_sweep" / f"gpt26_d2_{k}L_s1" for k in (0, 1)}
    for k, d in cells.items():
        run(make_cfg(*SWEEP, f"model.num_laplacian_heads={k}", "seed=1", run_dir=d))
    first = json.loads((cells[1] / "results.json").read_text())
    run(make_cfg(*SWEEP, "model.num_laplacian_heads=1", "seed=1", run_dir=cells[1]))  # resumed: no step trained
    again = json.loads((cells[1] / "results.json").read_text())
    assert again["final"] == first["final"] and again["steps"] == 3
    params = first["params"]
    model = create_model("gpt26_d2_1L", vocab_size=257)  # the sweep's model: nanochat's 2026 GPT
    assert params["total"] == sum(p.numel() for p in model.parameters())
    # the blocks' matrices (value-embedding gate included, as nanochat counts them); lm_head padded to 320 rows
    assert params["transformer_matrices"] == sum(p.numel() for p in model.blocks.parameters()) == 2 * 12 * 128 ** 2 + 12
    assert params["lm_head"] == 320 * 128
    assert first["tokens"] == 3 * 4 * 32 and first["train_time_s"] > 0
    render_tables(collect(tmp_path / "runs"), tmp_path / "tables", only=["gpt26_sweep"], echo=False)
    with open(tmp_path / "tables" / "gpt26_sweep.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["column"] == "val_bpb"]
    assert sorted((r["model"], r["k"], r["seed"]) for r in rows) == [("gpt26_d2", "0", "1"), ("gpt26_d2", "1", "1")]
    assert {float(r["mean"]) for r in rows} == {json.loads((d / "results.json").read_text())["final"]["val_bpb"]
                                                 for d in cells.values()}


# ---- against nanochat's own code (skipped without a checkout) ---------------------------------------------
needs_nanochat = pytest.mark.skipif(not NANOCHAT, reason="set LAPLACE_NANOCHAT to a nanochat checkout (92d63d4)")


@pytest.fixture(scope="module")
def nanochat_optim():
    os.environ.setdefault("NANOCHAT_DTYPE", "bfloat16")  # its Muon in bf16, as ours (on CUDA: its default)
    sys.path.insert(0, NANOCHAT)
    try:
        from nanochat import gpt, optim
    finally:
        sys.path.remove(NANOCHAT)
    optim.GPT, optim.GPTConfig = gpt.GPT, gpt.GPTConfig  # for the group test
    # its Muon in bf16 also when another test imported nanochat first (its dtype is read at import)
    optim.COMPUTE_DTYPE = torch.bfloat16
    # its fused steps run eagerly (the same operations; torch.compile takes minutes on a CPU)
    optim.muon_step_fused = optim.muon_step_fused._torchdynamo_orig_callable
    optim.adamw_step_fused = optim.adamw_step_fused._torchdynamo_orig_callable
    return optim


@needs_nanochat
@pytest.mark.slow
def test_two_steps_equal_nanochats_muonadamw(nanochat_optim):
    """The same weights and gradients through nanochat's MuonAdamW (separate c_q, c_k, c_v; GQA) and
    ours (one fused qkv) for two steps, at nanochat's hyper-parameters and a nonzero cautious decay."""
    torch.manual_seed(0)
    model = Tiny26()
    with torch.no_grad():  # weights of both signs everywhere, gradients random
        for p in model.parameters():
            p.normal_()
    names = dict(model.named_parameters())
    ref = {n: p.detach().clone().requires_grad_() for n, p in names.items()}
    qkv = {n: ref.pop(n).detach().split([16, 8, 8]) for n in list(ref) if n.endswith("qkv.weight")}
    for n, (q, k, v) in qkv.items():
        for part, t in zip("qkv", (q, k, v)):
            ref[f"{n}.{part}"] = t.clone().requires_grad_()
    opts = build_muon26(model, CFG, lr_scale=1.0, muon_weight_decay=0.2)
    groups = muon26_groups(model)
    adam = [dict(kind="adamw", params=[ref[n] for n, _ in groups[g["name"]]], lr=g["lr"], betas=g["betas"],
                 eps=1e-10, weight_decay=g["weight_decay"]) for g in opts["adamw"].param_groups]
    mats = [p for n, p in ref.items() if n.startswith("blocks.")]
    muon = [dict(kind="muon", params=[p for p in mats if p.shape == s], lr=0.02, momentum=0.95, ns_steps=5,
                 beta2=0.9, weight_decay=0.2) for s in sorted({p.shape for p in mats})]
    theirs = nanochat_optim.MuonAdamW(adam + muon)
    for _ in range(2):
        grads = {n: torch.randn_like(p) for n, p in names.items()}
        for n, p in names.items():
            p.grad = grads[n].clone()
            if n in qkv:
                for part, g in zip("qkv", grads[n].split([16, 8, 8])):
                    ref[f"{n}.{part}"].grad = g.clone()
            else:
                ref[n].grad = grads[n].clone()
        for opt in opts.values():
            opt.step()
        theirs.step()
    diffs = {}
    for n, p in names.items():
        r = torch.cat([ref[f"{n}.{c}"] for c in "qkv"]) if n in qkv else ref[n]
        diffs[n] = (p - r).abs().max().item()
    print("max |ours - nanochat| after 2 steps:", diffs)
    assert max(diffs.values()) < 1e-5, diffs  # torch AdamW divides in another order than nanochat


@needs_nanochat
def test_first_steps_lr_momentum_and_decay_equal_base_train():
    """base_train.py's get_lr_multiplier, get_muon_momentum and get_weight_decay (copied out of the
    checkout's file and run) against our schedules at N = 2520 (d12) and N = 600 (warm-down before 400)."""
    src = open(os.path.join(NANOCHAT, "scripts", "base_train.py")).read()
    start = src.index("def get_lr_multiplier")
    code = src[start:src.index("# ----", start)]
    for n in (2520, 600):
        args = type("A", (), dict(warmup_steps=40, warmdown_ratio=0.65, final_lr_frac=0.05))
        ns = dict(args=args, num_iterations=n, weight_decay_scaled=1.0, math=math)
        exec(code, ns)  # the reference's own functions
        s = build_schedules(CFG.schedules, "optim.schedules", total_steps=n, steps_per_epoch=n)
        steps = [*range(0, 60), *range(n - 220, n)] if n > 800 else range(n)
        for i in steps:
            assert s["lr"](i) == pytest.approx(ns["get_lr_multiplier"](i), abs=1e-12), (n, i)
            assert s["weight_decay"](i) == pytest.approx(ns["get_weight_decay"](i), abs=1e-12), (n, i)
            if n > 800 or i < 400:  # short runs: see the recipe card's momentum row
                assert s["momentum"](i) == pytest.approx(ns["get_muon_momentum"](i), abs=1e-12), (n, i)


@needs_nanochat
def test_groups_equal_setup_optimizers(nanochat_optim):
    """nanochat's own GPT (GQA, value embeddings, every 2026 parameter) through its setup_optimizer,
    and the same parameters under our names through build_muon26: every group's hyper-parameters."""
    config = nanochat_optim.GPTConfig(sequence_len=64, vocab_size=64, n_layer=3, n_head=4, n_kv_head=2, n_embd=256)
    with torch.device("meta"):
        ref = nanochat_optim.GPT(config)
    s, wd = 1.3, 0.2  # a batch's lr scale and a scaled Muon decay, as base_train passes them
    theirs = ref.setup_optimizer(unembedding_lr=0.008 * s, embedding_lr=0.3 * s, scalar_lr=0.5 * s,
                                 matrix_lr=0.02 * s, weight_decay=wd)
    ours, names = torch.nn.Module(), {}  # theirs renamed ours (q, k, v fused as our qkv), sharing the tensors
    for name, p in ref.named_parameters():
        new = name.replace("transformer.h.", "blocks.").replace("transformer.", "").replace("attn.c_proj", "attn.proj")
        new = re.sub(r"attn\.c_[qkv]\.", "attn.qkv.", new)
        *path, leaf = new.split(".")
        m = ours
        for part in path:
            if part not in m._modules:
                m.add_module(part, torch.nn.Module())
            m = m._modules[part]
        old = m._parameters.get(leaf)  # c_q's, when c_k and c_v join it as its rows
        m.register_parameter(leaf, torch.nn.Parameter(p if old is None else torch.cat([old, p])))
        names[id(p)] = new
    ours.width = 256
    opts = build_muon26(ours, CFG, lr_scale=s, muon_weight_decay=wd)
    by_name = {n: g for o in opts.values() for g in o.param_groups for n, q in ours.named_parameters()
               if any(q is x for x in g["params"])}
    for g in theirs.param_groups:
        for p in g["params"]:
            mine = by_name[names[id(p)]]
            if g["kind"] == "adamw":
                assert (mine["lr"], mine["betas"], mine["weight_decay"]) == \
                    (pytest.approx(g["lr"]), tuple(g["betas"]), g["weight_decay"]), names[id(p)]
                assert mine["eps"] == g["eps"]
            else:
                assert (mine["lr"], mine["momentum"], mine["beta2"], mine["ns_steps"], mine["weight_decay"]) == \
                    (pytest.approx(g["lr"]), g["momentum"], g["beta2"], g["ns_steps"], g["weight_decay"]), names[id(p)]
    assert by_name["blocks.0.attn.qkv.weight"]["row_splits"] == [256, 128, 128]
