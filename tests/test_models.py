"""Tests of the ViT, the GPT and the model zoo (`laplace.vit`, `laplace.gpt`, `laplace.zoo`).

    .venv/bin/python -m pytest tests/test_models.py            # all
    .venv/bin/python -m pytest tests/test_models.py -m "not slow"

The ViT must be timm's DeiT-III exactly (same state dict, same logits), so published weights
load. The GPT must be nanochat's 561M model at depth 20, causal with Laplacian heads, and its
KV-cache generation must equal generation by full forwards. Every zoo name must build and run.
No weights are downloaded: timm models are built with pretrained=False and state dicts copied.
"""
import math

import numpy as np

import pytest
import timm
import torch
import torch.nn.functional as F

import laplace
from laplace.gpt import rms_norm
from train.config import model_node
from laplace.errors import ConfigError
from laplace.gpt import GPT, gpt_dims
from laplace.vit import load_timm_state_dict
from conftest import randomize_


def random_timm_state_dict(timm_model: torch.nn.Module, seed: int = 0) -> dict:
    """timm's own init, perturbed so LayerScale (1e-6) and the zero biases do not hide a bug."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, t in timm_model.state_dict().items():
        if name.endswith(".gamma"):  # LayerScale
            sd[name] = 0.5 + 0.5 * torch.rand(t.shape, generator=g)
        else:
            sd[name] = t + 0.02 * torch.randn(t.shape, generator=g)
    return sd


def _compare_with_timm(ours_name: str, timm_name: str):
    torch.manual_seed(0)
    theirs = timm.create_model(timm_name, pretrained=False).eval()
    sd = random_timm_state_dict(theirs)
    theirs.load_state_dict(sd, strict=True)
    ours = laplace.create_model(ours_name).eval()
    assert ours.state_dict().keys() == sd.keys()
    load_timm_state_dict(ours, sd)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        ref, out = theirs(x), ours(x)
        ref_tokens, our_tokens = theirs.forward_features(x), laplace.features(ours, x, layers=[])
    assert out.shape == (2, 1000)
    assert ref.std() > 0.1  # the perturbed weights give non-degenerate logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(our_tokens["norm"], ref_tokens, rtol=1e-4, atol=1e-4)


def test_vits_matches_timm_deit3_small():
    _compare_with_timm("vits_0L", "deit3_small_patch16_224")


@pytest.mark.slow
def test_vitb_matches_timm_deit3_base():
    _compare_with_timm("vitb_0L", "deit3_base_patch16_224")


def test_load_timm_state_dict_resamples_pos_embed():
    """DeiT-III trains at 192 px and fine-tunes at 224: a checkpoint's position embedding is
    resampled (plain bicubic, as deit's --finetune and mmseg) to the model's grid, and the load stays strict."""
    torch.manual_seed(0)
    # Two blocks are enough to test resampling (and keep the test fast).
    small = dict(num_classes=10, depth=2)
    src = timm.create_model("deit3_small_patch16_224", pretrained=False, **small)
    sd = random_timm_state_dict(src)
    ours = laplace.create_model("vits_2L", img_size=192, **small)
    load_timm_state_dict(ours, sd)
    D = sd["pos_embed"].shape[-1]
    grid = sd["pos_embed"].reshape(1, 14, 14, D).permute(0, 3, 1, 2)  # [1, D, 14, 14]
    expected = F.interpolate(grid, size=(12, 12), mode="bicubic", antialias=False,
                             align_corners=False).permute(0, 2, 3, 1).reshape(1, 144, D)
    torch.testing.assert_close(ours.pos_embed.detach(), expected)
    for name, t in ours.state_dict().items():  # every other tensor copied as is
        if name != "pos_embed":
            assert torch.equal(t, sd[name]), name
    # The resampled model is a valid 192 px model: timm built at 192 agrees with it.
    ours0 = laplace.create_model("vits_0L", img_size=192, **small).eval()
    load_timm_state_dict(ours0, sd)
    theirs = timm.create_model("deit3_small_patch16_224", pretrained=False, img_size=192,
                               **small).eval()
    theirs.load_state_dict(ours0.state_dict(), strict=True)
    x = torch.randn(1, 3, 192, 192)
    with torch.no_grad():
        torch.testing.assert_close(ours0(x), theirs(x), rtol=1e-4, atol=1e-4)


def test_load_timm_state_dict_refuses_bad_state_dicts():
    torch.manual_seed(0)
    model = laplace.create_model("vitt_0L", img_size=32, num_classes=10)
    sd = model.state_dict()
    missing = {k: v for k, v in sd.items() if k != "blocks.3.attn.proj.weight"}
    with pytest.raises(RuntimeError, match=r"blocks\.3\.attn\.proj\.weight"):
        load_timm_state_dict(model, missing)
    extra = dict(sd, **{"blocks.0.attn.extra": torch.zeros(1)})
    with pytest.raises(RuntimeError, match="blocks.0.attn.extra"):
        load_timm_state_dict(model, extra)
    # A ViT whose pos_embed covers the class token (1 + 14 x 14 positions) is not DeiT-III.
    with_cls = dict(sd, pos_embed=torch.zeros(1, 197, 192))
    with pytest.raises(ValueError, match="class token"):
        load_timm_state_dict(model, with_cls)


def test_qk_norm_vit_matches_timm_with_linear_drop_path():
    """The first author's models (timm fork e9c80e5): timm's ViT with qk_norm=True, drop-path rising
    linearly over depth. Ours with qk_norm=True, drop_path_schedule="linear" gives timm's logits in
    eval mode and, from the same seed, in train mode (the same drop-path draws, block by block).
    The fork's Laplacian variants are checked beside its own code by tests/test_author_fork.py."""
    torch.manual_seed(0)
    arch = dict(img_size=64, num_classes=10, depth=3, drop_path_rate=0.3)
    theirs = timm.models.VisionTransformer(patch_size=16, embed_dim=192, num_heads=3, no_embed_class=True,
                                           init_values=1e-6, qk_norm=True, **arch)
    sd = random_timm_state_dict(theirs)
    theirs.load_state_dict(sd, strict=True)
    ours = laplace.create_model("vitt_0L", qk_norm=True, drop_path_schedule="linear", **arch)
    assert [n for n in sd if ".0.attn." in n] == [n for n in ours.state_dict() if ".0.attn." in n]
    load_timm_state_dict(ours, sd)
    assert [b.drop_path1.drop_prob for b in ours.blocks[1:]] == [b.drop_path1.drop_prob for b in theirs.blocks[1:]]
    x = torch.randn(4, 3, 64, 64)
    for train in (False, True):
        theirs.train(train), ours.train(train)
        torch.manual_seed(1)
        ref = theirs(x)
        torch.manual_seed(1)
        torch.testing.assert_close(ours(x), ref, rtol=1e-5, atol=1e-5)
    # Loading across the QK-norm switch names the fix, both ways.
    with pytest.raises(ValueError, match=r"has QK-norm weights .*model\.qk_norm=true"):
        load_timm_state_dict(laplace.create_model("vitt_0L", **arch), sd)
    with pytest.raises(ValueError, match=r"has no QK-norm weights .*model\.qk_norm=false"):
        load_timm_state_dict(ours, laplace.create_model("vitt_0L", **arch).state_dict())


def test_vitl_is_timms_deit3_large():
    """vitl_{k}L: ViT-L/16 (1024 wide, 24 deep, 16 heads); with QK-norm at 192 px it has the
    parameters of the fork's deit3_large_qk_patch16_192 (timm's ViT-L with qk_norm)."""
    with torch.device("meta"):
        theirs = timm.models.VisionTransformer(img_size=192, patch_size=16, embed_dim=1024, depth=24, num_heads=16,
                                               no_embed_class=True, init_values=1e-6, qk_norm=True)
        ours = laplace.create_model("vitl_16L", qk_norm=True, img_size=192)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    assert sum(p.numel() for p in ours.parameters()) == 304_327_656
    assert laplace.list_models("vitl_*") == [f"vitl_{k}L" for k in range(17)]


# ---------------------------------------------------------------------------------------- GPT

@pytest.mark.parametrize("name", ["gpt_d20_0L", "gpt_d20_5L"])
def test_gpt_d20_has_nanochats_parameter_count(name):
    with torch.device("meta"):
        model = laplace.create_model(name)
    assert sum(p.numel() for p in model.parameters()) == 560_988_160
    assert (model.width, model.num_heads, model.head_dim, model.vocab_size) == (1280, 10, 128, 65536)
    assert model.num_laplacian_heads == [int(name[-2])] * 20


def small_gpt(name="gpt_d2_1L", seed=0, **kw):
    torch.manual_seed(seed)
    return randomize_(laplace.create_model(name, vocab_size=32, max_seq_len=64, **kw), seed).eval()


# gpt_d2 has a single (128-wide) head, so "1L" is all-Laplacian; the 4-head variant mixes kinds.
GPT_VARIANTS = {
    "d2_0L": ("gpt_d2_0L", {}),
    "d2_1L": ("gpt_d2_1L", {}),
    "d2_4heads_2L": ("gpt_d2_0L", dict(num_heads=4, num_laplacian_heads=2)),
}


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("variant", ["d2_1L", "d2_4heads_2L"])
def test_gpt_is_causal_with_laplacian_heads(variant, fused):
    name, kw = GPT_VARIANTS[variant]
    model = small_gpt(name, fused_attn=fused, **kw)
    torch.manual_seed(1)
    idx = torch.randint(0, 32, (2, 16))
    with torch.no_grad():
        base = model(idx)
        for t in [0, 3, 8, 14]:
            changed = idx.clone()
            changed[:, t + 1] = (changed[:, t + 1] + 1 + torch.arange(2)) % 32
            z = model(changed)
            torch.testing.assert_close(z[:, :t + 1], base[:, :t + 1], rtol=0, atol=1e-6)
            assert (z[:, t + 1:] - base[:, t + 1:]).abs().max() > 1e-3  # the change is seen


@pytest.mark.cuda
@pytest.mark.parametrize("variant", list(GPT_VARIANTS))
def test_gpt_kv_cache_logits_match_full_forward(variant, device):
    name, kw = GPT_VARIANTS[variant]
    model = small_gpt(name, **kw).double().to(device)
    idx = torch.randint(0, 32, (2, 13), device=device)
    with torch.no_grad():
        full = model(idx)
        cache = model.new_kv_cache(batch_size=2, max_len=13)
        pieces, t = [], 0
        for n in [6, 3, 1, 1, 1, 1]:  # prompt, a chunk after the prefix, then single tokens
            pieces.append(model(idx[:, t:t + n], kv_cache=cache))
            t += n
    assert cache.pos == 13
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("variant", list(GPT_VARIANTS))
def test_gpt_generate_with_cache_equals_full_forward(variant):
    name, kw = GPT_VARIANTS[variant]
    model = small_gpt(name, **kw).double()  # float64: no near-ties flip an argmax
    prompt = torch.randint(0, 32, (2, 5))
    greedy = [model.generate(prompt, 12, temperature=0, use_cache=c) for c in (True, False)]
    assert greedy[0].shape == (2, 17)
    assert torch.equal(greedy[0][:, :5], prompt)
    assert torch.equal(greedy[0], greedy[1])
    sampled = [model.generate(prompt, 12, temperature=1.0, top_k=10, use_cache=c,
                              generator=torch.Generator().manual_seed(7)) for c in (True, False)]
    assert torch.equal(sampled[0], sampled[1])
    assert not torch.equal(sampled[0], greedy[0])  # sampling really sampled


def test_gpt_softcap_bounds_logits():
    model = small_gpt("gpt_d2_1L")
    with torch.no_grad():
        model.lm_head.weight.mul_(1000.0)
    idx = torch.randint(0, 32, (2, 8))
    with torch.no_grad():
        z = model(idx)
        model.softcap = 0.0
        raw = model(idx)
    assert raw.abs().max() > 100  # without the cap these logits are far outside (-15, 15)
    assert z.abs().max() <= 15.0  # float32 tanh saturates to exactly 1 for huge inputs
    assert z.abs().max() > 14.9
    torch.testing.assert_close(z, 15.0 * torch.tanh(raw / 15.0))


# ----------------------------------------------------------------------------------- the zoo

VIT_NAMES = laplace.list_models("vit*")


def test_list_models_covers_the_paper():
    assert len(VIT_NAMES) == 4 + 7 + 13 + 17  # vitt 0..3, vits 0..6, vitb 0..12, vitl 0..16
    assert {"vitb_0L", "vitb_12L", "vits_5L", "gpt_d20_5L", "gpt_d20_10L"} <= set(laplace.list_models())
    assert laplace.list_models("vitb_*") == [f"vitb_{k}L" for k in range(13)]


def _check_vit(name: str, device: str, depth: int = 12):
    k = int(name.split("_")[1][:-1])
    with torch.device(device):
        model = laplace.create_model(name, img_size=32, patch_size=16, num_classes=3, depth=depth).eval()
        with torch.no_grad():
            out = model(torch.randn(2, 3, 32, 32))
    assert model.num_laplacian_heads == [k] * depth
    assert all(b.attn.num_laplacian_heads == k for b in model.blocks)
    assert out.shape == (2, 3)
    if device == "cpu":
        assert all(int(b.attn.gates().sum()) == k for b in model.blocks)
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", VIT_NAMES)
def test_every_vit_name_composes_on_meta(name):
    """Every name builds and runs a forward with shapes only (meta device: no memory, no init)."""
    _check_vit(name, "meta")


# Every name also builds for real with one block (each name's width, heads and Laplacian-head
# mask; depth only repeats it): a real full-depth ViT-S / ViT-B costs seconds each, and the timm
# comparisons above build those.
@pytest.mark.parametrize("name", VIT_NAMES)
def test_every_vit_name_builds_and_runs(name):
    torch.manual_seed(0)
    _check_vit(name, "cpu", depth=1)


GPT_NAMES = laplace.list_models("gpt*")


@pytest.mark.parametrize("name", GPT_NAMES)
def test_every_gpt_name_composes_on_meta(name):
    """Full depth, shapes only; the parameter count follows nanochat's shapes."""
    with torch.device("meta"):
        model = laplace.create_model(name)
        z = model(torch.zeros(1, 8, dtype=torch.long))
    depth, k = int(name.split("_")[1][1:]), int(name.split("_")[2][:-1])
    assert model.num_laplacian_heads == [k] * depth
    assert z.shape == (1, 8, 65536)
    # Width 64 x depth, 12 d^2 per block, untied embeddings: the parameter count follows.
    width = 64 * depth
    assert sum(p.numel() for p in model.parameters()) == depth * 12 * width ** 2 + 2 * 65536 * width


@pytest.mark.parametrize("name", laplace.list_models("gpt_d2_*") + laplace.list_models("gpt_d12_*"))
def test_small_gpt_names_build_and_run(name):
    """For real with one block of the name's width, heads and mask (gpt_d2 at its full two)."""
    torch.manual_seed(0)
    depth, k = int(name.split("_")[1][1:]), int(name.split("_")[2][:-1])
    width, heads = gpt_dims(depth)
    model = laplace.create_model(name, vocab_size=50, depth=min(depth, 2), width=width, num_heads=heads).eval()
    assert model.num_laplacian_heads == [k] * min(depth, 2)
    assert all(int(b.attn.gates().sum()) == k for b in model.blocks)
    idx = torch.randint(0, 50, (1, 6))
    with torch.no_grad():
        loss = model(idx, targets=idx)
    # nanochat's zero-initialised lm_head: every logit is 0, so the loss is exactly log(vocab).
    assert math.isclose(loss.item(), math.log(50), rel_tol=1e-5)


def test_model_defaults_and_the_node_hold_k_once():
    assert laplace.model_defaults("vitb_12L") == dict(arch="vit", name="vitb", embed_dim=768, depth=12,
                                                      num_heads=12, num_laplacian_heads=12)
    assert laplace.model_defaults("gpt_d26_13L") == dict(arch="gpt", name="gpt", depth=26, num_laplacian_heads=13)
    # A node names the family; k and (for the GPT) the depth are its keys, the label follows them.
    node = model_node("gpt_d12_6L")
    assert (node["name"], node["depth"], node["num_laplacian_heads"]) == ("gpt", 12, 6)
    assert laplace.model_label({**node, "num_laplacian_heads": [0] * 6 + [6] * 6}) == "gpt_d12_0-0-0-0-0-0-6-6-6-6-6-6L"
    assert laplace.model_label({**model_node("vitb_12L"), "num_laplacian_heads": 3}) == "vitb_3L"
    assert laplace.model_label({"name": "vitb_12L", "num_laplacian_heads": 3}) == "vitb_3L"  # a node of b601d55
    # a cut or widened ViT is not the zoo's (issue 53: a 2-block, 48-wide net read "vitt_1L" in results and legends)
    tiny = {**model_node("vitt_1L"), "depth": 2, "embed_dim": 48}
    assert laplace.model_label(tiny) == "vitt_d2_w48_1L" and laplace.model_label(tiny, shape=False) == "vitt_1L"
    assert laplace.model_label({**model_node("vits_5L"), "depth": 4}) == "vits_d4_5L"
    assert laplace.model_defaults("vitb") == dict(arch="vit", name="vitb", embed_dim=768, depth=12, num_heads=12)
    assert laplace.create_model("gpt", depth=2, num_laplacian_heads=1, vocab_size=8).num_laplacian_heads == [1, 1]


def _one_line_error(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg
    return msg


def test_bad_names_give_one_line_errors():
    with pytest.raises(ValueError) as e:
        laplace.create_model("vitx_3L")
    msg = _one_line_error(e)
    assert "'vitx_3L'" in msg and "vitb_{0..12}L" in msg and "vits_{0..6}L" in msg
    with pytest.raises(ValueError) as e:
        laplace.create_model("vitb_13L")
    assert "only 12 heads" in _one_line_error(e)
    with pytest.raises(ValueError) as e:
        laplace.create_model("gpt_d20_11L")
    assert "only 10 heads" in _one_line_error(e)
    with pytest.raises(ValueError) as e:
        laplace.create_model("gpt_d0_0L")
    assert "depth must be >= 1" in _one_line_error(e)
    with pytest.raises(ValueError) as e:
        laplace.create_model("vitb_3L", bogus_arg=1)
    assert "bogus_arg" in _one_line_error(e)


# -------------------------------------------------------------------------- laplace.features

def test_vit_features_are_timms_intermediates():
    model = randomize_(laplace.create_model("vitt_2L", img_size=32, patch_size=8,
                                            num_classes=5)).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        feats = laplace.features(model, x)
        assert feats.keys() == {f"blocks.{i}" for i in range(12)} | {"norm"}
        assert feats["norm"].shape == (2, 1 + 16, 192)
        torch.testing.assert_close(model.norm(feats["blocks.11"]), feats["norm"])
        torch.testing.assert_close(model.head(feats["norm"][:, 0]), model(x))  # class token
        last = laplace.features(model, x, layers=[-1])
        assert last.keys() == {"blocks.11", "norm"}
        torch.testing.assert_close(last["blocks.11"], feats["blocks.11"])
        only = laplace.features(model, x, layers=[-1], norm=False)
        assert only.keys() == {"blocks.11"}
        early = laplace.features(model, x, layers=[2], norm=False)
        assert early.keys() == {"blocks.2"}
        torch.testing.assert_close(early["blocks.2"], feats["blocks.2"])


def test_vit_mean_pooled_head_reads_the_mean_of_the_final_norm_patch_tokens():
    torch.manual_seed(0)
    model = laplace.create_model("vitt_3L", depth=2, img_size=32, patch_size=8, num_classes=5,
                                 global_pool="avg").eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        norm = laplace.features(model, x)["norm"]
        torch.testing.assert_close(model(x), model.head(norm[:, 1:].mean(1)))  # the class token left out
        assert not torch.allclose(model(x), model.head(norm[:, 0]))
    with pytest.raises(ConfigError, match="global_pool='max': choose token or avg"):
        laplace.create_model("vitt_3L", depth=2, global_pool="max")
    assert model_node("vitt_3L")["global_pool"] == "token"  # stated, so an override has a key


def test_gpt_features():
    model = small_gpt("gpt_d2_0L", num_heads=4, num_laplacian_heads=[1, 3])
    idx = torch.randint(0, 32, (2, 10))
    with torch.no_grad():
        feats = laplace.features(model, idx)
        assert feats.keys() == {"blocks.0", "blocks.1", "norm"}
        torch.testing.assert_close(rms_norm(feats["blocks.1"]), feats["norm"])
        torch.testing.assert_close(model.logits(feats["norm"]), model(idx))
        last = laplace.features(model, idx, layers=[-1])
        assert last.keys() == {"blocks.1", "norm"}
        assert laplace.features(model, idx, layers=[-1], norm=False).keys() == {"blocks.1"}


def test_meta_built_gpt_initialises_learned_gates_and_laplacian_heads():
    """Build on meta, to_empty, init_weights: the head assignment must be re-set, not garbage."""
    for mode in ("learned", "fixed"):
        with torch.device("meta"):
            g = GPT(vocab_size=16, depth=2, width=64, num_heads=4, num_laplacian_heads=1, laplacian_mode=mode)
        g.to_empty(device="cpu")
        g.init_weights()
        a = g.blocks[0].attn.gates()
        expected = torch.tensor([0.0, 0.0, 0.0, 1.0])
        torch.testing.assert_close(a, torch.sigmoid(2 * expected - 1) if mode == "learned" else expected)


def test_features_reject_out_of_range_layers():
    model = laplace.create_model("vitt_0L", img_size=32, patch_size=16, num_classes=3)
    with pytest.raises(IndexError, match="outside the 12 blocks"):
        laplace.features(model, torch.randn(1, 3, 32, 32), layers=[30])
    assert set(laplace.features(model, torch.randn(1, 3, 32, 32), layers=[-12], norm=False)) == {"blocks.0"}


def test_numpy_int_laplacian_count_is_accepted():
    model = laplace.create_model("vitt_1L", img_size=32, patch_size=16, num_laplacian_heads=np.int64(2))
    assert model.num_laplacian_heads == [2] * 12 and all(type(k) is int for k in model.num_laplacian_heads)
