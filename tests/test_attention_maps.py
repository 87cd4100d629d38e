"""`python -m analysis.attention` on a tiny trained ViT and a real PNG: every map is a row of the
heads' attention probabilities P (it sums to 1 with the class token's weight), the hooks give
the P the attention's own return_attn path forms and leave the forward unchanged, heads are
labelled standard / Laplacian (the last k) or by their gate, and bad input is one line."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import laplace.zoo
from hydra import compose, initialize_config_dir
from PIL import Image

from analysis.attention import capture_attention, mass_mask, run
from conftest import CONFIGS, ROOT, randomize_, train_tiny_vit
from laplace.checkpoint import load_model, save_checkpoint
from train.config import model_node
from laplace.zoo import create_model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A 2-step tiny vitt_1L (3 heads, the last one Laplacian) on digits: 32 px, 4x4 patches."""
    return train_tiny_vit(tmp_path_factory.mktemp("attn"))


@pytest.fixture
def png(tmp_path):
    """A real 40x40 RGB PNG (the evaluation transform resizes it to the checkpoint's 32 px)."""
    rng = np.random.default_rng(0)
    path = tmp_path / "noise.png"
    Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(path)
    return path


def _attention(*overrides):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return run(compose("attention", overrides=[*overrides, "device=cpu"]))


def test_maps_are_rows_of_P_on_the_grid(ckpt, png, tmp_path):
    got = _attention(f"checkpoint={ckpt}", f"image={png}", f"out={tmp_path}", "layers=all", "threshold=0.6")
    assert got["grid"] == (4, 4) and got["blocks"] == [0, 1] and got["patch_rc"] == (2, 2)  # the centre
    assert got["cls"].shape == got["patch"].shape == (2, 3, 4, 4)
    for kind in ("cls", "patch"):  # patches + the class token = the whole row of P
        assert (got[kind] >= 0).all()
        np.testing.assert_allclose(got[kind].sum((2, 3)) + got[f"{kind}_to_cls"], 1.0, atol=1e-5)
    assert got["labels"] == [["head 0: standard", "head 1: standard", "head 2: Laplacian"]] * 2
    axes = got["axes"]
    assert axes.shape == (4, 4)  # (class token, patch) per block x (image + 3 heads)
    assert [ax.get_title() for ax in axes[0, 1:]] == got["labels"][0]
    assert axes[0, 3].title.get_color() != axes[0, 1].title.get_color()  # the Laplacian head stands out
    assert "V - PV" in got["title"] and "shown is P" in got["title"] and "60%" in got["title"]
    names = [p.name for p in got["paths"]]
    assert names == ["attention_noise.png", "attention_noise.pdf", "attention_noise.npz"]
    assert got["paths"][0].parent.name == "vitt_1L_last_analysis"
    saved = np.load(got["paths"][2])
    np.testing.assert_array_equal(saved["cls"], got["cls"])
    np.testing.assert_array_equal(saved["weights"], [[0, 0, 1], [0, 0, 1]])


def test_hooks_give_the_reference_P_and_leave_the_forward_unchanged(ckpt):
    model = randomize_(load_model(ckpt))  # random weights: attention far from uniform
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want_logits = model(x)
        P = capture_attention(model, x, [0, 1])
        got_logits = model(x)
        t, ref = laplace.zoo.embed(model, x), {}
        for i, blk in enumerate(model.blocks):
            ref[i] = blk.attn(blk.norm1(t), return_attn=True)[1]
            t = blk(t)
    assert all(not blk.attn._forward_hooks and not blk.attn._forward_pre_hooks for blk in model.blocks)
    torch.testing.assert_close(got_logits, want_logits)
    for i in (0, 1):
        assert P[i].shape == (2, 3, 17, 17)
        torch.testing.assert_close(P[i], ref[i])
    assert P[0].std() > 0.01  # not the uniform 1/17 of an untrained model


def test_a_chosen_patch_and_learned_gates(png, tmp_path):
    node = model_node("vitt_1L")
    node.update(depth=1, embed_dim=48, patch_size=8, img_size=32, num_classes=10, laplacian_mode="learned")
    model = randomize_(create_model(**node))
    with torch.no_grad():
        model.blocks[0].attn.laplacian_gate.copy_(torch.tensor([-1.0, 0.0, 1.0]))
    data = {"name": "digits", "img_size": 32, "patch_size": 8, "eval_crop_pct": 1.0, "augment": "none",
            "mean": [0.5] * 3, "std": [0.5] * 3}
    ck = save_checkpoint(tmp_path / "learned" / "ckpt" / "last.pt", model=model, config={"model": node, "data": data})
    got = _attention(f"checkpoint={ck}", f"image={png}", "patch=[0,3]", "upsample=bilinear")
    assert got["patch_rc"] == (0, 3) and got["blocks"] == [0]
    assert got["labels"] == [["head 0: gate a=0.27", "head 1: gate a=0.50", "head 2: gate a=0.73"]]
    assert "(1 - a) PV + a (V - PV)" in got["title"]
    np.testing.assert_allclose(got["patch"].sum((2, 3)) + got["patch_to_cls"], 1.0, atol=1e-5)
    with pytest.raises(ValueError, match=r"patch=\[4,0\]: outside the 4x4 patch grid"):
        _attention(f"checkpoint={ck}", f"image={png}", "patch=[4,0]")


def test_mass_mask_keeps_the_largest_patches():
    m = np.array([[0.05, 0.3], [0.5, 0.15]])
    np.testing.assert_array_equal(mass_mask(m, 0.6), [[False, True], [True, False]])  # 0.5 + 0.3 >= 0.6
    np.testing.assert_array_equal(mass_mask(m, 0.9), [[False, True], [True, True]])


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "analysis.attention", *args, "device=cpu"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_bad_input_is_one_line(ckpt, png, tmp_path):
    node = model_node("gpt_d2_1L")
    node.update(vocab_size=257, max_seq_len=64)
    gpt = save_checkpoint(tmp_path / "gpt.pt", model=create_model(**node),
                          config={"model": node, "data": {"name": "pydoc_text", "vocab_size": 257, "seq_len": 64}})
    for args, expect in [((f"checkpoint={gpt}", f"image={png}"), f"error: checkpoint={gpt}: model gpt_d2_1L is not a ViT"),
                         ((f"checkpoint={ckpt}", f"image={tmp_path / 'no.png'}"), f"error: image={tmp_path / 'no.png'}: no such file")]:
        proc = _cli(*args)
        err = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(err) == 1 and err[0].startswith(expect), proc.stderr[-2000:]
    (tmp_path / "text.png").write_text("not an image")
    for args, expect in [((f"checkpoint={tmp_path / 'no.pt'}", f"image={png}"), "no such file; pass checkpoint=PATH"),
                         ((f"checkpoint={ckpt}", f"image={tmp_path / 'text.png'}"), "text.png: not a readable image"),
                         ((f"checkpoint={ckpt}", f"image={png}", "threshold=1.5"), "threshold=1.5: a fraction"),
                         ((f"checkpoint={ckpt}", f"image={png}", "layers=[2]"), r"layers=\[2\]: 2 is not a block index")]:
        with pytest.raises(ValueError, match=expect):
            _attention(*args, f"out={tmp_path}")
