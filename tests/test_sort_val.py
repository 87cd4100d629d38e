"""Sorting ImageNet's flat validation images into <wnid>/ folders with torchvision's one-liner
(docs/data.md), on small files in the real formats: real JPEGs named and packed as in
ILSVRC2012_img_val.tar and a devkit .tar.gz (meta.mat in its `synsets` struct layout, written by
scipy.io, and the ground-truth file); the folder route then reads every image under its label."""
from __future__ import annotations

import hashlib
import tarfile
from pathlib import Path

import numpy as np
import pytest
import scipy.io
from PIL import Image

from laplace.data.imagenet import ImageFolder

WNIDS = ["n01440764", "n01443537", "n01484850"]  # ILSVRC2012_IDs 1, 2, 3 (leaves)
TRUTH = [2, 1, 3, 3, 1, 2, 2, 3, 1]  # line k: the class id of ILSVRC2012_val_<k:08d>.JPEG


def name(k: int) -> str:
    return f"ILSVRC2012_val_{k:08d}.JPEG"


def truth() -> dict[str, str]:
    return {name(k): WNIDS[c - 1] for k, c in enumerate(TRUTH, start=1)}


def write_devkit(root: Path) -> Path:
    """ILSVRC2012_devkit_t12.tar.gz: data/meta.mat (3 leaf synsets + an inner node with ID 1001, as
    the real file's 1,000 leaves precede 860 inner nodes) and data/ILSVRC2012_validation_ground_truth.txt."""
    kit = root / "ILSVRC2012_devkit_t12"
    (kit / "data").mkdir(parents=True)
    fields = ["ILSVRC2012_ID", "WNID", "words", "gloss", "num_children", "children", "wordnet_height",
              "num_train_images"]
    synsets = np.zeros((4, 1), dtype=[(f, object) for f in fields])  # MATLAB: a 4x1 struct array
    rows = [(i + 1, w, f"class {i}, alias", f"gloss {i}", 0, np.zeros((1, 0)), 0, 1300) for i, w in enumerate(WNIDS)]
    rows.append((1001, "n00001740", "entity", "that which is perceived", 3, np.array([[1, 2, 3]]), 19, 0))
    for i, (sid, wnid, words, gloss, nch, ch, height, ntrain) in enumerate(rows):
        synsets[i, 0] = (np.array([[sid]], dtype=np.uint16), np.array([wnid]), np.array([words]),
                         np.array([gloss]), np.array([[nch]], dtype=np.uint8), ch.astype(np.uint16),
                         np.array([[height]], dtype=np.uint8), np.array([[ntrain]], dtype=np.uint16))
    scipy.io.savemat(kit / "data" / "meta.mat", {"synsets": synsets})
    (kit / "data" / "ILSVRC2012_validation_ground_truth.txt").write_text("".join(f"{c}\n" for c in TRUTH))
    tgz = root / "ILSVRC2012_devkit_t12.tar.gz"
    with tarfile.open(tgz, "w:gz") as tar:
        tar.add(kit, arcname="ILSVRC2012_devkit_t12")
    return tgz


def write_val_tar(root: Path) -> dict[str, bytes]:
    """ILSVRC2012_img_val.tar: 9 real JPEGs at the archive's top level; returns their bytes."""
    rng = np.random.default_rng(0)
    flat = root / "flat"
    flat.mkdir()
    images = {}
    with tarfile.open(root / "ILSVRC2012_img_val.tar", "w") as tar:
        for k in range(1, len(TRUTH) + 1):
            Image.fromarray(rng.integers(0, 256, (20, 23, 3), dtype=np.uint8)).save(flat / name(k), format="JPEG")
            tar.add(flat / name(k), arcname=name(k))
            images[name(k)] = (flat / name(k)).read_bytes()
    return images


@pytest.fixture
def archives(tmp_path, monkeypatch) -> tuple[Path, dict[str, bytes]]:
    """(folder holding the devkit and the val tar, {image name: bytes}); torchvision checks the
    archives' md5s against the real files', so the fake archives' own md5s stand in for them."""
    import torchvision.datasets.imagenet as tv

    root = tmp_path / "imagenet"
    root.mkdir()
    tgz, images = write_devkit(root), write_val_tar(root)
    for key, path in (("devkit", tgz), ("val", root / "ILSVRC2012_img_val.tar")):
        monkeypatch.setitem(tv.ARCHIVE_META, key, (path.name, hashlib.md5(path.read_bytes()).hexdigest()))
    return root, images


def assert_sorted(val: Path, images: dict[str, bytes]):
    """val/<wnid>/ holds every image under its label, as the folder route reads it."""
    ds = ImageFolder(str(val))
    assert ds.classes == WNIDS and len(ds) == len(TRUTH)
    for path, label in ds.samples:
        assert WNIDS[label] == truth()[Path(path).name] and Path(path).read_bytes() == images[Path(path).name]


def test_torchvision_sorts_the_val_tar(archives):
    import torchvision

    root, images = archives
    ds = torchvision.datasets.ImageNet(str(root), split="val")  # the documented one-liner
    assert ds.wnids == WNIDS and len(ds) == len(TRUTH)
    assert_sorted(root / "val", images)
