"""Our Muon (train/optim.py: StackedMuon, torch.optim.Muon with row blocks) takes torch.optim.Muon's
step: on plain matrices, on the stacked q/k/v of a GPT (three matrices to torch), and across a
saved optimizer state."""
from __future__ import annotations

import io
import math

import pytest
import torch
from omegaconf import OmegaConf

from laplace import create_model
from train.optim import StackedMuon, build_muon_adamw

MUON_CFG = OmegaConf.load("configs/optim/muon.yaml")


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
    assert torch.equal(ours.detach(), theirs.detach())
    assert torch.equal(opts[0].state[ours]["momentum_buffer"], opts[1].state[theirs]["momentum_buffer"])


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
        assert torch.equal(params[name].detach().chunk(n)[i], q.detach()), f"{name} block {i}"


def test_torchs_saved_state_resumes_in_ours():
    """A run saved with torch's Muon (or with our hand-written Muon before StackedMuon became a subclass
    of it) resumes in ours: the same group keys and `momentum_buffer`, and the next step is the same."""
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


def test_row_blocks_must_divide_the_rows():
    p = torch.nn.Parameter(torch.zeros(4, 2))
    p.grad = torch.ones(4, 2)
    opt = StackedMuon([{"params": [p], "row_blocks": 3}])
    with pytest.raises(ValueError, match=r"a \[4, 2\] matrix has no 3 equal row blocks"):
        opt.step()
