"""Our Muon (train/optim.py: StackedMuon, its Newton-Schulz and lr adjustment, no private torch
function) takes torch.optim.Muon's step: on plain matrices, on the stacked q/k/v of a GPT (three
matrices to torch), and across a saved optimizer state. Checked against torch's public class as
long as torch has one."""
from __future__ import annotations

import io
import math

import pytest
import torch
from omegaconf import OmegaConf

from laplace import create_model
from train.optim import NS_COEFFICIENTS, NS_EPS, StackedMuon, adjust_lr, build_muon_adamw, zeropower_via_newtonschulz

needs_torch_muon = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="this torch has no torch.optim.Muon")

MUON_CFG = OmegaConf.load("configs/optim/muon.yaml")


def torch_defaults():
    """torch.optim.Muon's default coefficients and eps (ours must be the same numbers)."""
    d = torch.optim.Muon([torch.nn.Parameter(torch.zeros(2, 2))]).defaults
    return tuple(d["ns_coefficients"]), d["eps"]


@needs_torch_muon
def test_our_constants_are_torchs_defaults():
    assert torch_defaults() == (NS_COEFFICIENTS, NS_EPS)


@needs_torch_muon
@pytest.mark.parametrize("shape", [(12, 20), (20, 12), (16, 16)])
@pytest.mark.parametrize("nesterov, weight_decay, adjust", [
    (True, 0.0, "original"), (False, 0.1, "original"), (True, 0.05, "match_rms_adamw"), (True, 0.0, None)])
def test_our_step_is_torchs_on_a_plain_matrix(shape, nesterov, weight_decay, adjust):
    """Four steps (momentum buffer, weight decay, lr adjustment), the lr and momentum changed
    between steps as the schedules change them."""
    torch.manual_seed(0)
    w0 = torch.randn(shape)
    ours, theirs = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    kw = dict(lr=0.02, momentum=0.9, nesterov=nesterov, ns_steps=5, weight_decay=weight_decay, adjust_lr_fn=adjust)
    opts = [StackedMuon([ours], **kw), torch.optim.Muon([theirs], **kw)]
    for step in range(4):
        g = torch.randn(shape)
        for p, opt in zip((ours, theirs), opts):
            opt.param_groups[0].update(lr=0.02 * (1 - step / 8), momentum=0.85 + 0.03 * step)
            p.grad = g.clone()
            opt.step()
    assert not torch.equal(ours.detach(), w0)
    torch.testing.assert_close(ours.detach(), theirs.detach())
    torch.testing.assert_close(opts[0].state[ours]["momentum_buffer"], opts[1].state[theirs]["momentum_buffer"])


def test_newton_schulz_orthogonalises_in_bf16():
    torch.manual_seed(0)
    for shape in [(32, 64), (64, 32)]:
        o = zeropower_via_newtonschulz(torch.randn(shape), NS_COEFFICIENTS, 5, NS_EPS)
        assert o.dtype == torch.bfloat16 and o.shape == shape
        s = torch.linalg.svdvals(o.float())
        assert 0.4 < s.min() and s.max() < 1.6  # US'V^T with S' in 0.5 .. 1.5 by design
    with pytest.raises(ValueError, match="2-D"):
        zeropower_via_newtonschulz(torch.randn(2, 3, 4), NS_COEFFICIENTS, 5, NS_EPS)


def test_adjust_lr():
    assert adjust_lr(0.02, "original", (256, 64)) == pytest.approx(0.04)
    assert adjust_lr(0.02, None, (64, 256)) == pytest.approx(0.02)
    assert adjust_lr(0.02, "match_rms_adamw", (64, 256)) == pytest.approx(0.02 * 0.2 * 16)
    with pytest.raises(ValueError, match="adjust_lr_fn='spectral'"):
        StackedMuon([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.1, momentum=0.9, nesterov=True, ns_steps=5,
                    weight_decay=0.0, adjust_lr_fn="spectral")


@needs_torch_muon
def test_stacked_qkv_is_torchs_muon_on_three_matrices():
    """A d2 GPT's Muon (the fused qkv [3C, C] as row_blocks 3) for three steps equals
    torch.optim.Muon on separate copies of q, k and v [C, C] and of every other matrix: the
    behaviour nanochat's separate c_q, c_k, c_v have."""
    torch.manual_seed(0)
    model = create_model("gpt_d2_1L", vocab_size=300)
    for p in model.parameters():  # nanochat's zero-initialised projections give no gradient to q, k
        if p.ndim == 2:
            torch.nn.init.normal_(p, std=0.05)
    muon = build_muon_adamw(model, MUON_CFG)["muon"]
    C = model.width
    copies = {}  # (our parameter's name, row block) -> torch's separate parameter
    for name, p in model.named_parameters():
        if name.startswith("blocks.") and p.ndim == 2:
            n = 3 if name.endswith("attn.qkv.weight") else 1
            for i, block in enumerate(p.detach().chunk(n)):
                copies[name, i] = torch.nn.Parameter(block.clone())
    theirs = torch.optim.Muon(list(copies.values()), lr=MUON_CFG.matrix_lr, momentum=MUON_CFG.momentum,
                              nesterov=MUON_CFG.nesterov, ns_steps=MUON_CFG.ns_steps,
                              weight_decay=MUON_CFG.muon_weight_decay, adjust_lr_fn="original")
    params = dict(model.named_parameters())
    for _ in range(3):
        model.zero_grad()
        idx = torch.randint(0, 300, (2, 17))
        model(idx[:, :-1], targets=idx[:, 1:]).backward()
        for (name, i), q in copies.items():
            n = 3 if name.endswith("attn.qkv.weight") else 1
            q.grad = params[name].grad.chunk(n)[i].clone()
        muon.step()
        theirs.step()
    assert len(copies) == 2 * (3 + 3)  # q, k, v, proj, c_fc, c_proj per block
    for (name, i), q in copies.items():
        n = 3 if name.endswith("attn.qkv.weight") else 1
        assert params[name].shape[0] == n * q.shape[0] and (n == 1 or q.shape == (C, C))
        torch.testing.assert_close(params[name].detach().chunk(n)[i], q.detach(), msg=f"{name} block {i}")


@needs_torch_muon
def test_torchs_saved_state_resumes_in_ours():
    """A run saved with torch's Muon (our StackedMuon was a subclass of it) resumes in ours: the
    same group keys and `momentum_buffer`, and the next step is the same."""
    torch.manual_seed(0)
    w0, g1, g2 = torch.randn(16, 24), torch.randn(16, 24), torch.randn(16, 24)
    kw = dict(lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.01, adjust_lr_fn="original")
    a = torch.nn.Parameter(w0.clone())
    opt_a = torch.optim.Muon([a], **kw)
    a.grad = g1.clone()
    opt_a.step()
    b = torch.nn.Parameter(a.detach().clone())
    opt_b = StackedMuon([b], **{**kw, "momentum": 0.5, "lr": 1.0})  # the load restores torch's values
    saved = io.BytesIO()
    torch.save(opt_a.state_dict(), saved)  # as a checkpoint does: the loaded state is a copy, not opt_a's
    saved.seek(0)
    opt_b.load_state_dict(torch.load(saved, weights_only=True))
    assert opt_b.param_groups[0]["lr"] == 0.02 and opt_b.param_groups[0]["momentum"] == 0.95
    a.grad, b.grad = g2.clone(), g2.clone()
    opt_a.step()
    opt_b.step()
    torch.testing.assert_close(b.detach(), a.detach())
    assert math.isfinite(b.detach().norm().item())
