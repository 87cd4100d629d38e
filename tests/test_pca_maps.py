"""PCA maps (analysis/pca_maps.py): the foreground step (the paper's sign rule, a threshold) on planted feature maps, sign
determinism, full-resolution files, the grid's cells, and `python -m analysis pca_maps=2` on two
tiny checkpoints.

    python -m pytest -q tests/test_pca_maps.py
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import CONFIGS, ROOT, TINY_VIT
from hydra import compose, initialize_config_dir
from omegaconf import open_dict
from PIL import Image

from analysis.pca_maps import (
    DPI,
    check_options,
    draw_pca_grid,
    foreground_mask,
    grid_figure,
    pca_rgb,
)
from laplace.errors import ConfigError
from train import run as train_run

GRID = (4, 4)


def _planted(seed: int = 0, noise: float = 0.05):
    """16 patches of a 4x4 grid: a central 2x2 object along one direction, background along another."""
    g = torch.Generator().manual_seed(seed)
    obj = torch.zeros(GRID, dtype=torch.bool)
    obj[1:3, 1:3] = True
    a, b = torch.eye(8)[0] * 3, torch.eye(8)[1] * 3
    x = torch.where(obj.flatten()[:, None], a, b) + noise * torch.randn(16, 8, generator=g)
    return x, obj


def test_foreground_is_the_object():
    x, obj = _planted()
    assert torch.equal(foreground_mask(x, GRID), obj)
    assert torch.equal(foreground_mask(-x, GRID), obj)  # the sign of PC1 is fixed by the border
    rgb = pca_rgb(x, GRID, threshold=0.5)
    assert (rgb[~obj.numpy()] == 0).all()  # background black
    assert rgb.shape == (*GRID, 3) and 0 <= rgb.min() and rgb.max() <= 1


@pytest.mark.parametrize("threshold", [None, 0.5, "sign"])
def test_signs_are_deterministic(threshold):
    x, _ = _planted(seed=1)
    rgb = pca_rgb(x, GRID, threshold)
    assert np.array_equal(rgb, pca_rgb(x.clone(), GRID, threshold))
    np.testing.assert_allclose(pca_rgb(-x, GRID, threshold), rgb, atol=1e-5)


def test_default_foreground_is_the_sign_of_the_first_component():
    """The paper's rule: patches with a positive first-component score. Scores along one
    direction: 12 border patches at -1, a central object of two strong (3) and two weak (0.5)
    patches. Centred, all four object patches are positive; min-max scaled, the weak ones sit
    at 0.375, under the 0.5 threshold (the option)."""
    score = -torch.ones(GRID, dtype=torch.float64)
    score[1, 1:3], score[2, 1:3] = 3.0, 0.5
    g = torch.Generator().manual_seed(0)
    x = score.flatten()[:, None] * torch.eye(8, dtype=torch.float64)[0] + 1e-3 * torch.randn(16, 8, generator=g,
                                                                                             dtype=torch.float64)
    obj = score > -1
    assert torch.equal(foreground_mask(x, GRID), obj) and torch.equal(foreground_mask(-x, GRID), obj)
    assert torch.equal(foreground_mask(x, GRID, 0.5), score == 3.0)
    assert (pca_rgb(x, GRID, "sign")[~obj.numpy()] == 0).all() and (pca_rgb(x, GRID, "sign")[obj.numpy()] > 0).any()
    assert check_options(True, "sign", "nearest") == "sign"


def test_rank_deficient_components_are_flat():
    """Noise-free planted features have one component: the others would be scaled rounding noise."""
    x, obj = _planted(noise=0.0)
    rgb = pca_rgb(x, GRID, threshold=0.5)
    assert (rgb[obj.numpy()] == 0.5).all()  # a constant foreground: mid-grey, not black
    assert (pca_rgb(x, GRID)[..., 1:] == 0).all()


def test_options_are_checked():
    assert check_options(False, 0.5, "nearest") is None
    assert check_options(True, 0.3, "bilinear") == 0.3
    for bad in [(True, 1.0, "nearest"), (True, None, "nearest"), (True, 0.5, "bicubic"), (True, "sgn", "nearest")]:
        with pytest.raises(ConfigError):
            check_options(*bad)


def test_grid_cells_and_full_resolution_files(tmp_path):
    K, H, W = 3, 32, 48
    rng = np.random.default_rng(0)
    images = rng.random((K, H, W, 3))
    maps = {"vitt_0L (0/3 Laplacian)": list(rng.random((K, H, W, 3))),
            "vitt_3L (3/3 Laplacian)": list(rng.random((K, H, W, 3)))}
    fig = grid_figure(images, maps, labels=[1, 2, 3])
    cells = [ax for ax in fig.axes if ax.images]
    assert len(cells) == K * 3
    for ax in cells:  # each cell spans at least the image's pixels
        w, h = ax.get_position().width * fig.get_figwidth() * DPI, ax.get_position().height * fig.get_figheight() * DPI
        assert round(w) >= W and round(h) >= H and round(w) * H == round(h) * W
    paths = draw_pca_grid(images, maps, tmp_path / "pca_maps", [1, 2, 3], names=["vitt_0L", "vitt_3L"])
    assert [p.name for p in paths] == ["pca_maps.png", "pca_maps.pdf"]
    gw, gh = Image.open(paths[0]).size
    assert gw >= 3 * W and gh >= K * H
    for name in ("image", "vitt_0L", "vitt_3L"):
        for i in range(K):
            assert Image.open(tmp_path / "pca_maps" / f"{name}_{i}.png").size == (W, H)


def _train(model: str, tmp) -> str:
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("config", overrides=[f"model={model}", *TINY_VIT, "model.depth=1", "trainer.max_steps=2",
                                           f"paths.runs_dir={tmp / 'runs'}"])
    with open_dict(cfg):
        cfg.run_dir = str(tmp / model)
    train_run(cfg)
    return str(tmp / model / "ckpt" / "last.pt")


def test_cli_writes_grid_and_files(tmp_path):
    ckpts = [_train(m, tmp_path) for m in ("vitt_0L", "vitt_3L")]
    out = tmp_path / "compare"
    proc = subprocess.run([sys.executable, "-m", "analysis", f"checkpoint=[{','.join(ckpts)}]", "pca_maps=2",
                           "metrics=[]", f"analysis_out={out}", "cpu_threads=1", "progress=false"],
                          cwd=ROOT, capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "pca_maps.png").stat().st_size > 5000 and (out / "pca_maps.pdf").is_file()
    from laplace.checkpoint import load_checkpoint
    from laplace.zoo import model_label

    labels = [model_label(load_checkpoint(c)["config"]["model"]) for c in ckpts]  # with the tiny shape's tags
    for name in ("image", *labels):
        for i in range(2):
            assert Image.open(out / "pca_maps" / f"{name}_{i}.png").size == (32, 32)  # digits: 32 px
    bad = subprocess.run([sys.executable, "-m", "analysis", f"checkpoint={ckpts[0]}", "pca_maps=2", "metrics=[]",
                          "pca_upsample=bicubic"], cwd=ROOT, capture_output=True, text=True, check=False,
                         timeout=120)
    assert bad.returncode == 1 and bad.stderr.strip().startswith("error: pca_upsample=bicubic")
