"""Unreadable images in the real on-disk layouts (laplace/data/images.py): a truncated JPEG or a
non-image named .JPEG in an ImageFolder, a bad image row in the HF parquet layout. Each is one
line naming the file (parquet: file and row), also from a data-loader worker; with
data.skip_corrupt=true the next sample is served in its place and the skips are counted."""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fakedata
from conftest import ROOT, TINY_VIT
from laplace.data.images import CorruptImageError
from laplace.data.imagenet import build_imagenet
from laplace.data.transforms import eval_transform
from train import run

IMAGENET = [*TINY_VIT, "data=imagenet", "model=vitt_0L", "model.depth=1", "data.img_size=32", "data.patch_size=8",
            "data.num_classes=3", "trainer.global_batch_size=4", "trainer.max_steps=6", "trainer.eval_every=1000"]


def _break(folder: Path, text: bool = True) -> tuple[Path, Path]:
    """Truncate one real JPEG to half its bytes; write text into the next file named .JPEG."""
    truncated, html = sorted(folder.glob("*/*.JPEG"))[1:3]
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    if text:
        html.write_text("<html>403 Forbidden</html>\n")
    return truncated, html


def test_a_broken_image_folder_names_each_file(tmp_path):
    fakedata.write_imagenet_folder(tmp_path, n_classes=2, per_class=3)
    truncated, text = _break(tmp_path / "train")
    ds = build_imagenet(tmp_path, train=True, transform=eval_transform(16))
    for i, path in ((1, truncated), (2, text)):
        with pytest.raises(CorruptImageError) as e:
            ds[i]
        assert str(e.value).startswith(f"{path} is not a readable image (") and "\n" not in str(e.value)
        assert "data.skip_corrupt=true" in str(e.value)
    assert "runcated" in str(pytest.raises(CorruptImageError, ds.__getitem__, 1).value)  # PIL's words vary
    assert "(not an image format PIL reads)" in str(pytest.raises(CorruptImageError, ds.__getitem__, 2).value)
    skipping = build_imagenet(tmp_path, train=True, transform=eval_transform(16), skip_corrupt=True)
    x, y = skipping[1]  # both bad files: the sample after them instead
    assert (x == ds[3][0]).all() and y == ds[3][1] and skipping.skipped_corrupt == 2


def _parquet_with_a_bad_row(root: Path, bad: int) -> str:
    from datasets import Dataset

    rng = np.random.default_rng(0)
    images = [{"bytes": fakedata._jpeg_bytes(rng, 24), "path": f"{i}.JPEG"} for i in range(4)]
    images[bad]["bytes"] = images[bad]["bytes"][:100]  # a download cut short
    (root / "data").mkdir(parents=True)
    for k, rows in enumerate((slice(0, 2), slice(2, 4))):
        Dataset.from_dict({"image": images[rows], "label": [0, 1][: len(images[rows])]}).to_parquet(
            str(root / "data" / f"train-{k:05d}-of-00002.parquet"))
    return str(root / "data" / "train-00001-of-00002.parquet")


def test_a_bad_parquet_row_names_file_and_row(tmp_path):
    second = _parquet_with_a_bad_row(tmp_path, bad=3)
    ds = build_imagenet(tmp_path, train=True, fmt="parquet", cache_dir=tmp_path / "cache")
    with pytest.raises(CorruptImageError, match=f"^{second} row 1 is not a readable image"):
        ds[3]
    skipping = build_imagenet(tmp_path, train=True, fmt="parquet", cache_dir=tmp_path / "cache", skip_corrupt=True)
    assert skipping[3][1] == ds[0][1] and skipping.skipped_corrupt == 1  # wrapped round to row 0


@pytest.mark.slow
def test_a_truncated_jpeg_in_training_is_one_line_or_skipped(tmp_path, make_cfg, capsys):
    """Through train.py with a data worker (torch re-raises its error with a traceback inside the
    message): one line naming the file; then the same data with data.skip_corrupt=true trains and
    says how many it skipped."""
    fakedata.write_imagenet_folder(tmp_path / "in", n_classes=3, per_class=4)
    truncated, _ = _break(tmp_path / "in/train", text=False)
    args = [*IMAGENET, f"data.root={tmp_path / 'in'}", "trainer.num_workers=1", "trainer.device=cpu"]
    proc = subprocess.run([sys.executable, "train.py", *args, f"run_dir={tmp_path / 'cli'}"], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {truncated} is not a readable image ("), proc.stderr[-3000:]
    run(make_cfg(*IMAGENET, f"data.root={tmp_path / 'in'}", "data.skip_corrupt=true"))
    out = capsys.readouterr()
    assert f"data.skip_corrupt: skipped {truncated} (" in out.err
    assert "[laplace] data.skip_corrupt: " in out.out and "reads of an unreadable image served the next sample (train " in out.out
