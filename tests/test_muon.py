"""Muon + AdamW (optim=muon): our Muon (train/optim.py, torch's update) is nanochat's update, and
the GPT's parameters are routed as nanochat routes them."""
from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from laplace import create_model
from laplace.errors import ConfigError
from train.optim import StackedMuon, apply_group_schedules, build_muon_adamw, build_schedules

MUON_CFG = OmegaConf.load("configs/optim/muon.yaml")


def newton_schulz_reference(g: torch.Tensor, steps: int = 5, dtype=torch.bfloat16) -> torch.Tensor:
    """nanochat's / Keller Jordan's zeropower_via_newtonschulz5, written out (bf16 as theirs)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        A = x @ x.T
        B = b * A + c * A @ A
        x = a * x + B @ x
    return x.T if tall else x


MUONS = {"ours": StackedMuon, "torch": torch.optim.Muon}


@pytest.mark.parametrize("muon", MUONS)
@pytest.mark.parametrize("shape", [(8, 16), (16, 8)])
def test_muon_is_nanochats_update(shape, muon):
    """Two steps (the second uses the momentum buffer) against the hand-written update:
    Nesterov momentum, Newton-Schulz, lr x sqrt(max(1, rows / cols)); for our Muon and torch's."""
    torch.manual_seed(0)
    w0 = torch.randn(shape)
    grads = [torch.randn(shape), torch.randn(shape)]
    lr, mom = 0.02, 0.95
    p = torch.nn.Parameter(w0.clone())
    opt = MUONS[muon]([p], lr=lr, momentum=mom, nesterov=True, ns_steps=5, weight_decay=0.0, adjust_lr_fn="original")
    ref, buf = w0.clone(), torch.zeros(shape)
    for g in grads:
        p.grad = g.clone()
        opt.step()
        buf = buf.lerp(g, 1 - mom)                      # momentum buffer
        update = g.lerp(buf, mom)                       # Nesterov
        o = newton_schulz_reference(update).float()
        ref = ref - lr * math.sqrt(max(1.0, shape[0] / shape[1])) * o
    torch.testing.assert_close(p.detach(), ref, atol=2e-3, rtol=0)
    # The orthogonalised update has singular values near 1 (0.5 .. 1.5 by design).
    s = torch.linalg.svdvals(newton_schulz_reference(torch.randn(shape)).float())
    assert 0.4 < s.min() and s.max() < 1.6


def test_routing_on_a_real_d2_gpt():
    model = create_model("gpt_d2_1L", vocab_size=300)
    opts = build_muon_adamw(model, MUON_CFG)
    assert set(opts) == {"muon", "adamw"}
    muon_params = {id(p) for g in opts["muon"].param_groups for p in g["params"]}
    matrices = {id(p) for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2}
    assert muon_params == matrices and len(matrices) == 2 * 4  # qkv, proj, c_fc, c_proj per block
    groups = {g["name"]: g for g in opts["adamw"].param_groups}
    assert groups["embedding"]["params"] == [model.wte.weight]
    assert groups["unembedding"]["params"] == [model.lm_head.weight]
    assert "scalars" not in groups  # fixed Laplacian heads have no parameters
    every = muon_params | {id(p) for g in groups.values() for p in g["params"]}
    assert every == {id(p) for p in model.parameters()}
    # nanochat's width scaling of the AdamW rates: (width / 768) ** -0.5, width 128 here.
    scale = (128 / 768) ** -0.5
    assert groups["embedding"]["lr"] == pytest.approx(0.2 * scale)
    assert groups["unembedding"]["lr"] == pytest.approx(0.004 * scale)
    assert opts["muon"].param_groups[0]["lr"] == pytest.approx(0.02)


def test_learned_gates_go_to_adamw_and_schedules_scale_every_group():
    model = create_model("gpt_d2_1L", vocab_size=300, laplacian_mode="learned")
    opts = build_muon_adamw(model, MUON_CFG)
    groups = {g["name"]: g for g in opts["adamw"].param_groups}
    assert len(groups["scalars"]["params"]) == 2  # one gate vector per block
    # lr is a multiplier of each group's base rate; momentum is Muon's only.
    sched = build_schedules(MUON_CFG.schedules, "optim.schedules", total_steps=1000, steps_per_epoch=100)
    values = apply_group_schedules(opts, sched, step=0)
    assert values == {"lr": 1.0, "momentum": pytest.approx(0.85)}
    assert opts["muon"].param_groups[0]["momentum"] == pytest.approx(0.85)
    assert "momentum" not in groups["embedding"]
    apply_group_schedules(opts, sched, step=900)  # half-way through the 20% warm-down
    assert groups["embedding"]["lr"] == pytest.approx(0.5 * 0.2 * (128 / 768) ** -0.5)
    assert opts["muon"].param_groups[0]["lr"] == pytest.approx(0.5 * 0.02)
    assert opts["muon"].param_groups[0]["momentum"] == pytest.approx(0.95)


def test_muon_on_a_vit_is_a_one_line_error():
    with pytest.raises(ConfigError, match="use optim=adamw"):
        build_muon_adamw(create_model("vitt_0L", img_size=32, num_classes=10), MUON_CFG)


def test_one_muon_step_on_q_k_v_is_nanochats_separate_matrices(monkeypatch):
    """nanochat has c_q, c_k, c_v [C, C]; ours one qkv [3C, C]. One Muon step of a d2 GPT
    (width 128) must update each of q, k, v as nanochat's Muon updates its own matrix
    (momentum buffer, Nesterov, Newton-Schulz of that block alone, shape scale 1), and every
    other matrix as one matrix (the MLP's [4C, C] with scale 2).

    In float64: bf16 Newton-Schulz differs by ~30% between two orders of the same operations,
    which would hide the 70% of a wrong split. So torch's Newton-Schulz (equal to nanochat's
    above) is replaced by the float64 one written here, on both sides."""
    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz",
                        lambda g, coefs, steps, eps: newton_schulz_reference(g, steps, torch.float64))
    torch.manual_seed(0)
    model = create_model("gpt_d2_1L", vocab_size=300).double()
    for p in model.parameters():  # nanochat's zero-initialised projections give no gradient to q, k
        if p.ndim == 2:
            torch.nn.init.normal_(p, std=0.05)
    opts = build_muon_adamw(model, MUON_CFG)
    idx = torch.randint(0, 300, (2, 16))
    model(idx[:, :-1], targets=idx[:, 1:]).backward()
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
    lr, mom, C = MUON_CFG.matrix_lr, MUON_CFG.momentum, model.width
    opts["muon"].step()

    def expected_update(g, scale):
        buf = torch.zeros_like(g).lerp(g, 1 - mom)              # the first step's momentum buffer
        return -lr * scale * newton_schulz_reference(g.lerp(buf, mom), 5, torch.float64)

    checked = []
    for name, p in model.named_parameters():
        if not name.startswith("blocks.") or p.ndim != 2:
            continue
        w, g = before[name]
        if name.endswith("attn.qkv.weight"):
            parts = [(f"{name}[{part}]", slice(i * C, (i + 1) * C), 1.0) for i, part in enumerate("qkv")]
        else:
            parts = [(name, slice(None), math.sqrt(max(1.0, p.shape[0] / p.shape[1])))]
        for label, rows, scale in parts:
            got, want = p.detach()[rows] - w[rows], expected_update(g[rows], scale)
            rel = ((got - want).norm() / want.norm()).item()
            assert rel < 1e-9, f"{label}: the update differs from nanochat's by {rel:.1%}"
            checked.append(label)
    assert len(checked) == 2 * (3 + 3)  # q, k, v, proj, c_fc, c_proj per block
