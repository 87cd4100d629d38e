"""The arms beside the Laplacian heads (laplace.attention.ARMS): XSA against its formula with P
written out, gated and DIFF attention against timm's own classes with the same weights (and by
hand), inside any timm ViT and the GPT (causal, KV cache), trained a few steps from train.py's
configs, recorded in checkpoints and exports."""
from __future__ import annotations

import json
import math

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.layers import Attention as TimmAttention
from timm.layers import DiffAttention as TimmDiffAttention

import laplace
from conftest import TINY_VIT, randomize_
from laplace.attention import ARMS, DiffAttention, LaplacianAttention, RMSNorm, attn_layer
from laplace.checkpoint import load_checkpoint, load_model, save_checkpoint
from laplace.errors import ConfigError
from laplace.export import export
from laplace.zoo import create_model
from train import run

DIM, HEADS = 32, 4
D = DIM // HEADS


def _x(B=2, N=6, seed=0):
    return torch.randn(B, N, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _explicit_P(q, k, causal):
    """softmax(q k^T / sqrt(d)) written out, future keys masked when causal."""
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_xsa_is_the_formula_with_P_written_out(fused, causal):
    attn = randomize_(LaplacianAttention(DIM, HEADS, attention="xsa", qkv_bias=True).double())
    attn.fused_attn = fused
    x = _x()
    q, k, v = (x @ attn.qkv.weight.T + attn.qkv.bias).view(2, 6, 3, HEADS, D).permute(2, 0, 3, 1, 4)
    y = _explicit_P(q, k, causal) @ v
    # z_i = y_i - (y_i . v_i) v_i / |v_i|^2, per head and token
    z = y - (y * v).sum(-1, keepdim=True) / (v * v).sum(-1, keepdim=True) * v
    want = attn.proj(z.transpose(1, 2).reshape(2, 6, DIM))
    torch.testing.assert_close(attn(x, is_causal=causal), want)
    # nothing of a token's own value is left in its output (before the projection)
    assert (z * v).sum(-1).abs().max() < 1e-12


@pytest.mark.parametrize("fused", [True, False])
def test_gated_is_timms_gated_attention_and_gates_laplacian_heads_too(fused):
    ours = randomize_(LaplacianAttention(DIM, HEADS, attention="gated", qkv_bias=True).double())
    theirs = TimmAttention(DIM, HEADS, qkv_bias=True, gated=True).double()
    theirs.load_state_dict(ours.state_dict(), strict=True)  # timm's parameter names, `gate` included
    ours.fused_attn = theirs.fused_attn = fused
    x = _x()
    torch.testing.assert_close(ours(x), theirs(x))
    torch.testing.assert_close(ours(x, is_causal=True), theirs(x, is_causal=True))
    # with 2 Laplacian heads, by hand: the gate multiplies (I - P) V as it multiplies P V
    ours.set_laplacian_heads(2)
    q, k, v = (x @ ours.qkv.weight.T + ours.qkv.bias).view(2, 6, 3, HEADS, D).permute(2, 0, 3, 1, 4)
    y = _explicit_P(q, k, False) @ v
    y = torch.cat((y[:, :2], v[:, 2:] - y[:, 2:]), dim=1).transpose(1, 2).reshape(2, 6, DIM)
    torch.testing.assert_close(ours(x), ours.proj(y * torch.sigmoid(ours.gate(x))))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_diff_is_timms_and_its_map_is_P1_minus_lambda_P2(fused, causal):
    ours = randomize_(DiffAttention(DIM, HEADS, qkv_bias=True, depth=3).double())
    theirs = TimmDiffAttention(DIM, HEADS, qkv_bias=True, depth=3).double()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    ours.fused_attn = theirs.fused_attn = fused
    x = _x()
    out, P = ours(x, is_causal=causal, return_attn=True)  # our own path (timm's forward has no maps)
    torch.testing.assert_close(out, theirs(x, is_causal=causal))
    # by hand: each head's two halves of q and k, P1 - lambda P2 on the head's whole value, RMSNorm
    d = D // 2
    q, k, v = (x @ ours.qkv.weight.T + ours.qkv.bias).split(DIM, -1)
    q, k = (t.view(2, 6, HEADS, 2, d).permute(0, 2, 3, 1, 4) for t in (q, k))  # [B, H, 2, N, d]
    lam = ours._compute_lambda().double()
    want_P = _explicit_P(q[:, :, 0], k[:, :, 0], causal) - lam * _explicit_P(q[:, :, 1], k[:, :, 1], causal)
    torch.testing.assert_close(P, want_P)
    y = want_P @ v.view(2, 6, HEADS, D).transpose(1, 2)
    y = F.rms_norm(y, (D,), ours.sub_norm.weight, eps=1e-5) * (1 - ours.lambda_init)
    torch.testing.assert_close(out, ours.proj(y.transpose(1, 2).reshape(2, 6, DIM)))


@pytest.mark.parametrize("arm", ARMS)
def test_any_timm_vit_takes_every_arm(arm):
    kw = dict(img_size=32, patch_size=8, embed_dim=DIM, depth=3, num_heads=HEADS, num_classes=5)
    model = timm.create_model("vit_tiny_patch16_224", attn_layer=laplace.attn_layer(attention=arm), **kw).eval()
    x = torch.randn(2, 3, 32, 32)
    assert model(x).shape == (2, 5) and all(b.attn.attention == arm for b in model.blocks)
    if arm == "diff":  # timm gives DIFF the block's depth: lambda's start rises with it, as timm's own DIFF ViT
        timm_diff = timm.create_model("vit_tiny_patch16_224", attn_layer="diff", **kw).eval()
        timm_diff.load_state_dict(model.state_dict(), strict=True)
        assert [b.attn.lambda_init for b in model.blocks] == [b.attn.lambda_init for b in timm_diff.blocks]
        with torch.no_grad():
            torch.testing.assert_close(model(x), timm_diff(x))
    assert laplace.create_model("vitt_0L", attention=arm, depth=1).blocks[0].attn.attention == arm  # the zoo too


@pytest.mark.parametrize("arm", ARMS)
def test_gpt_under_each_arm_is_causal_and_its_cache_is_exact(arm):
    torch.manual_seed(0)
    gpt = randomize_(create_model("gpt_d2_0L", attention=arm, vocab_size=50, width=64, num_heads=2)).eval()
    for blk in gpt.blocks:  # DIFF's lambda at timm's start, not randomize_'s
        blk.attn.reset_laplacian()
    x = torch.randint(0, 50, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 50  # change the future only
    with torch.no_grad():
        a, b = gpt(x), gpt(y)
        assert torch.equal(a[0, :8], b[0, :8]) and not torch.equal(a[0, 8:], b[0, 8:])
        assert torch.equal(gpt.generate(x[:, :5], 6, temperature=0), gpt.generate(x[:, :5], 6, temperature=0,
                                                                                   use_cache=False))
        for blk in gpt.blocks:  # the reference path that forms P gives the same logits
            blk.attn.fused_attn = False
        torch.testing.assert_close(gpt(x), a, rtol=1e-5, atol=1e-5)


def test_diff_rotary_acts_on_each_half_head_and_identity_rotary_is_timms():
    attn = randomize_(DiffAttention(DIM, HEADS, qk_norm=True, norm_layer=RMSNorm, depth=1).double())
    x = _x(N=7)
    ones, zeros = torch.ones(7, D // 2, dtype=torch.float64), torch.zeros(7, D // 2, dtype=torch.float64)
    # rotation by 0: timm's own forward, so the layout of the two halves is timm's
    torch.testing.assert_close(attn(x, is_causal=True, rope=(ones, zeros)), attn(x, is_causal=True))
    # scores depend on relative positions only: shifting every position by 5 leaves the output
    gpt_rope = lambda s: [t[s:s + 7].double() for t in  # noqa: E731
                          create_model("gpt_d1_0L", vocab_size=8, width=DIM, num_heads=HEADS)._rope(0, 12, torch.float32)]
    torch.testing.assert_close(attn(x, is_causal=True, rope=gpt_rope(0)), attn(x, is_causal=True, rope=gpt_rope(5)))


def test_arms_that_exclude_laplacian_heads_and_unknown_arms_are_one_line():
    with pytest.raises(ConfigError, match="attention=xsa takes no Laplacian heads: set num_laplacian_heads=0"):
        create_model("vitt_2L", attention="xsa")
    with pytest.raises(ConfigError, match="attention=diff takes no Laplacian heads"):
        create_model("gpt_d2_0L", attention="diff", num_laplacian_heads=[0, 1], vocab_size=8)
    with pytest.raises(ConfigError, match="attention=xsa takes no Laplacian heads"):
        attn_layer(0, "learned", "xsa")
    with pytest.raises(ConfigError, match="attention='sparse': choose one of softmax, xsa, gated, diff"):
        create_model("vitt_0L", attention="sparse")
    assert create_model("vitt_2L", attention="gated", depth=1).blocks[0].attn.num_laplacian_heads == 2


def test_diffs_parameters_go_to_muon_and_adamw_as_nanochats_would():
    from omegaconf import OmegaConf

    from train.optim import build_muon_adamw

    gpt = create_model("gpt_d2_0L", attention="diff", vocab_size=64)
    opt = build_muon_adamw(gpt, OmegaConf.load("configs/optim/muon.yaml"))
    groups = {g["name"]: g["params"] for o in opt.values() for g in o.param_groups}
    assert {id(p) for p in groups["qkv"]} == {id(b.attn.qkv.weight) for b in gpt.blocks}  # q, k, v apart
    assert {id(b.attn.lambda_q1) for b in gpt.blocks} <= {id(p) for p in groups["scalars"]}


@pytest.mark.parametrize("arm", ["xsa", "gated", "diff"])
def test_train_py_trains_each_arm_and_the_checkpoint_rebuilds_it(arm, make_cfg, tmp_path):
    """`python train.py model=vitt_0L model.attention=<arm>` and the GPT's, a few steps each; the run's
    config and results name the arm, load_model rebuilds it (XSA adds no parameter: only the node tells)."""
    for name, args in (("vit", ["model=vitt_0L", *TINY_VIT]),
                       ("gpt", ["experiment=gpt_pydoc", "model=gpt_d2_0L", "data.seq_len=32", "trainer.global_batch_size=8",
                                "trainer.num_workers=0", "trainer.progress=false", "trainer.eval_every=100",
                                "trainer.sample_prompts=[]"])):
        cfg = make_cfg(*args, f"model.attention={arm}", "trainer.max_steps=2", run_dir=tmp_path / name)
        assert math.isfinite(run(cfg)["val_loss"])
        ckpt = tmp_path / name / "ckpt" / "last.pt"
        assert load_checkpoint(ckpt)["config"]["model"]["attention"] == arm
        assert json.loads((tmp_path / name / "results.json").read_text())["attention"] == arm
        model = load_model(ckpt)
        assert {b.attn.attention for b in model.blocks} == {arm}


@pytest.mark.parametrize("arm", ["xsa", "diff"])
def test_exports_of_arms_load_in_laplace_and_diff_in_plain_timm(arm, tmp_path):
    node = {"name": "vitt_0L", "depth": 2, "embed_dim": 48, "img_size": 32, "patch_size": 4, "num_classes": 10,
            "attention": arm}
    model = randomize_(create_model(**node)).eval()
    run_dir = tmp_path / "runs/deit3/x/vitt_0L_s0"
    ckpt = save_checkpoint(run_dir / "ckpt/last.pt", model=model, loop={"step": 1},
                           config={"model": node, "data": {"name": "digits"}, "run_dir": str(run_dir)})
    out = export(ckpt, tmp_path / "export")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(load_model(out)(x), model(x))
    timm_built = json.loads((out / "config.json").read_text())["laplace"]["timm"]
    assert timm_built == (arm == "diff")  # timm's ViT has DIFF (attn_layer="diff"), not XSA
    if arm == "diff":
        with torch.no_grad():
            torch.testing.assert_close(timm.create_model(f"local-dir:{out}", pretrained=True).eval()(x), model(x))


@pytest.mark.parametrize("name,arm", [("vitt_0L", "xsa"), ("vitt_1L", "gated"), ("vitt_0L", "diff"),
                                      ("gpt_d2_0L", "xsa"), ("gpt_d2_1L", "gated"), ("gpt_d2_0L", "diff")])
def test_the_mechanism_and_the_geometry_run_on_every_arm(name, arm):
    """Each head's term as the diagnostic writes it (XSA's projection, the gate, DIFF's signed map and
    head norm) sums to the attention's own output; the heads are typed by their arm."""
    from analysis.geometry import analyze_model
    from analysis.mechanism import mechanism_model

    vit = name.startswith("vit")
    kw = dict(depth=2, embed_dim=48, patch_size=8, img_size=32, num_classes=10) if vit else dict(vocab_size=97, num_heads=2)
    torch.manual_seed(0)
    model = randomize_(create_model(name, attention=arm, **kw)).eval()
    for blk in model.blocks:  # DIFF's lambda back to timm's start (randomize_'s 1 + noise: lambda = -e^64)
        blk.attn.reset_laplacian()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(3, 32, 32, generator=g), i % 2) if vit else
            (torch.randint(0, 97, (16,), generator=g), torch.randint(0, 97, (16,), generator=g)) for i in range(4)]
    res = mechanism_model(model, data, batch_size=2)
    assert res["recon_err"] < 1e-5
    k = model.blocks[0].attn.num_laplacian_heads
    heads = model.blocks[0].attn.num_heads
    assert [h["type"] for h in res["heads"]["blocks.0"]] == [arm] * (heads - k) + ["laplacian"] * k
    assert math.isfinite(res["summary"][f"dshare.{arm}"])
    geo = analyze_model(model, data, metrics=["anova"], layers="all", batch_size=2, progress=False)
    part = geo["results"]["patch" if vit else "tokens"]["norm"]["anova"]
    assert 0 < part["within_seq_share"] < 1  # the geometry reads features only: any arm


def test_arms_without_parameters_start_from_the_softmax_weights():
    """The arms study's pairing (docs/arms.md): under one seed, XSA and Laplacian heads start exactly
    where softmax does; gated and DIFF draw their own parameters in between."""
    def weights(name, **kw):
        torch.manual_seed(0)
        return create_model(name, depth=2, **kw).state_dict()

    base = weights("vitt_0L")
    for other in (weights("vitt_3L"), weights("vitt_0L", attention="xsa")):
        assert other.keys() == base.keys() and all(torch.equal(other[k], base[k]) for k in base)
    gated = weights("vitt_0L", attention="gated")
    assert not torch.equal(gated["blocks.1.attn.qkv.weight"], base["blocks.1.attn.qkv.weight"])
