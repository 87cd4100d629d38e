"""Sorting ImageNet's flat validation images into <wnid>/ folders, on small files in the real
formats: real JPEGs named and packed as in ILSVRC2012_img_val.tar, a devkit .tar.gz (meta.mat in
its `synsets` struct layout, written by scipy.io, and the ground-truth file) and Kaggle's
LOC_val_solution.csv. Checked: torchvision's one-liner (README, scripts/sort_imagenet_val.py's
docstring) and scripts/sort_imagenet_val.py; the folder route then reads every image under its label."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import scipy.io
from PIL import Image

from laplace.data.imagenet import ImageFolder
from laplace.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("sort_imagenet_val", ROOT / "scripts" / "sort_imagenet_val.py")
sv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sv)

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


def write_solution(path: Path) -> Path:
    """Kaggle's LOC_val_solution.csv: rows in no particular order, the wnid then its boxes, repeated."""
    lines = ["ImageId,PredictionString"]
    for k in (5, 2, 9, 1, 3, 8, 4, 7, 6):
        w = truth()[name(k)]
        lines.append(f"ILSVRC2012_val_{k:08d},{w} 12 30 200 180 {w} 5 5 40 40 ")
    path.write_text("\n".join(lines) + "\n")
    return path


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


def test_the_label_files_agree(archives, tmp_path):
    root, _ = archives
    assert sv.devkit_labels(root / "ILSVRC2012_devkit_t12.tar.gz") == truth()
    assert not (root / "meta.bin").exists()  # torchvision's meta.bin went to a temp folder
    assert sv.solution_labels(write_solution(tmp_path / "LOC_val_solution.csv")) == truth()


def test_move_in_place_then_a_rerun_sorts_the_rest(archives):
    root, images = archives
    val = root / "flat"
    labels = sv.devkit_labels(root / "ILSVRC2012_devkit_t12.tar.gz")
    (val / name(3)).rename(root / name(3))
    with pytest.raises(UserError, match=f"1 labelled images are in neither .*{name(3)}"):
        sv.sort_val(val, labels)
    assert len([p for p in val.iterdir() if p.is_file()]) == 8  # refused before anything moved
    (root / name(3)).rename(val / name(3))
    assert sv.sort_val(val, labels) == 9
    for k in (3, 7):  # as if a run had stopped before these two
        (val / truth()[name(k)] / name(k)).rename(val / name(k))
    assert sv.sort_val(val, labels) == 2  # the two left flat
    assert not [p for p in val.iterdir() if p.is_file()]
    assert_sorted(val, images)
    assert sv.sort_val(val, labels) == 0  # sorted: nothing to do


def test_hard_links_into_another_folder(archives, tmp_path):
    root, images = archives
    val, out = root / "flat", tmp_path / "imagenet_sorted" / "val"
    labels = sv.solution_labels(write_solution(tmp_path / "LOC_val_solution.csv"))
    with pytest.raises(UserError, match="--link keeps the flat images: give --out"):
        sv.sort_val(val, labels, link=True)
    assert sv.sort_val(val, labels, out=out, link=True) == 9
    for n, w in truth().items():
        assert os.path.samefile(val / n, out / w / n)  # the flat folder stays, the same inodes
    assert_sorted(out, images)
    assert sv.sort_val(val, labels, out=out, link=True) == 0


def test_bad_label_files_are_one_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("ImageId,PredictionString\nILSVRC2012_val_00000001,12 30 200 180\n")
    with pytest.raises(UserError, match="line 2 is no `ImageId,<wnid> boxes...` row"):
        sv.solution_labels(bad)
    bad.write_text("id,label\nILSVRC2012_val_00000001,n01440764\n")
    with pytest.raises(UserError, match="line 2 is no"):
        sv.solution_labels(bad)
    with pytest.raises(UserError, match="no such file"):
        sv.solution_labels(tmp_path / "absent.csv")
    bad.write_text("")  # pandas' EmptyDataError, said in one line
    with pytest.raises(UserError, match="not Kaggle's LOC_val_solution.csv"):
        sv.solution_labels(bad)


def test_command_line(archives, tmp_path, capsys):
    root, images = archives
    val, csv = root / "flat", write_solution(tmp_path / "LOC_val_solution.csv")
    assert sv.main([str(val), "--solution", str(csv)]) == 0
    assert capsys.readouterr().out.endswith("9 images moved, 9 in 3 class folders\n")
    assert_sorted(val, images)
    # The script itself, as a user runs it: bad input is one `error:` line and exit status 1.
    # Here the devkit is refused by torchvision's md5 check (the fixture's md5 is not this process's).
    cmd = [sys.executable, str(ROOT / "scripts" / "sort_imagenet_val.py"), str(val), "--devkit",
           str(root / "ILSVRC2012_devkit_t12.tar.gz")]
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert bad.returncode == 1 and bad.stderr.startswith("error: --devkit ") and bad.stderr.count("\n") == 1
    assert "is not present in the root directory or is corrupted" in bad.stderr
