"""scripts/sort_imagenet_val.py on small files in the real formats: real JPEGs named as in
ILSVRC2012_img_val.tar, a devkit (meta.mat in its `synsets` struct layout, written by scipy.io,
and the ground-truth file; as a folder and as a .tar.gz) and Kaggle's LOC_val_solution.csv."""
from __future__ import annotations

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


@pytest.fixture
def val(tmp_path) -> Path:
    """The flat folder ILSVRC2012_img_val.tar extracts to: 9 real JPEGs."""
    folder = tmp_path / "val"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for k in range(1, len(TRUTH) + 1):
        Image.fromarray(rng.integers(0, 256, (20, 23, 3), dtype=np.uint8)).save(folder / name(k), format="JPEG")
    return folder


@pytest.fixture
def devkit(tmp_path) -> Path:
    """ILSVRC2012_devkit_t12/: data/meta.mat (3 leaf synsets + an inner node with ID 1001, as the
    real file's 1,000 leaves precede 860 inner nodes) and data/ILSVRC2012_validation_ground_truth.txt."""
    root = tmp_path / "ILSVRC2012_devkit_t12"
    (root / "data").mkdir(parents=True)
    fields = ["ILSVRC2012_ID", "WNID", "words", "gloss", "num_children", "children", "wordnet_height",
              "num_train_images"]
    synsets = np.zeros((4, 1), dtype=[(f, object) for f in fields])  # MATLAB: a 4x1 struct array
    rows = [(i + 1, w, f"class {i}", f"gloss {i}", 0, np.zeros((1, 0)), 0, 1300) for i, w in enumerate(WNIDS)]
    rows.append((1001, "n00001740", "entity", "that which is perceived", 3, np.array([[1, 2, 3]]), 19, 0))
    for i, (sid, wnid, words, gloss, nch, ch, height, ntrain) in enumerate(rows):
        synsets[i, 0] = (np.array([[sid]], dtype=np.uint16), np.array([wnid]), np.array([words]),
                         np.array([gloss]), np.array([[nch]], dtype=np.uint8), ch.astype(np.uint16),
                         np.array([[height]], dtype=np.uint8), np.array([[ntrain]], dtype=np.uint16))
    scipy.io.savemat(root / "data" / "meta.mat", {"synsets": synsets})
    (root / "data" / "ILSVRC2012_validation_ground_truth.txt").write_text("".join(f"{c}\n" for c in TRUTH))
    return root


def write_solution(path: Path) -> Path:
    """Kaggle's LOC_val_solution.csv: rows in no particular order, the wnid then its boxes, repeated."""
    lines = ["ImageId,PredictionString"]
    for k in (5, 2, 9, 1, 3, 8, 4, 7, 6):
        w = truth()[name(k)]
        lines.append(f"ILSVRC2012_val_{k:08d},{w} 12 30 200 180 {w} 5 5 40 40 ")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_label_files_agree(devkit, tmp_path):
    tgz = tmp_path / "ILSVRC2012_devkit_t12.tar.gz"
    with tarfile.open(tgz, "w:gz") as tar:
        tar.add(devkit, arcname="ILSVRC2012_devkit_t12")
    assert sv.devkit_labels(devkit) == sv.devkit_labels(tgz) == truth()
    assert sv.solution_labels(write_solution(tmp_path / "LOC_val_solution.csv")) == truth()


def test_move_in_place_then_idempotent(val, devkit):
    before = {p.name: p.read_bytes() for p in val.iterdir()}
    assert sv.sort_val(val, sv.devkit_labels(devkit)) == 9
    assert not [p for p in val.iterdir() if p.is_file()]
    ds = ImageFolder(str(val))  # the folder route now reads it, each image under its label
    assert ds.classes == WNIDS
    for path, label in ds.samples:
        assert WNIDS[label] == truth()[Path(path).name] and Path(path).read_bytes() == before[Path(path).name]
    assert len(ds) == 9
    assert sv.sort_val(val, sv.devkit_labels(devkit)) == 0  # sorted: nothing to do


def test_half_sorted_is_refused_unless_resume(val, tmp_path):
    labels = sv.solution_labels(write_solution(tmp_path / "LOC_val_solution.csv"))
    sv.sort_val(val, labels)
    for k in (3, 7):  # as if the run had stopped before these two
        (val / truth()[name(k)] / name(k)).rename(val / name(k))
    with pytest.raises(UserError, match=r"half-sorted: 7 of 9 images are in class folders and 2 are not.*--resume"):
        sv.sort_val(val, labels)
    assert sv.sort_val(val, labels, resume=True) == 2
    assert sorted(p.name for p in val.rglob("*.JPEG")) == sorted(truth())


def test_hard_links_into_another_folder(val, devkit, tmp_path):
    out = tmp_path / "imagenet" / "val"
    labels = sv.devkit_labels(devkit)
    with pytest.raises(UserError, match="--link keeps the flat images: give --out"):
        sv.sort_val(val, labels, link=True)
    assert sv.sort_val(val, labels, out=out, link=True) == 9
    for n, w in truth().items():
        assert os.path.samefile(val / n, out / w / n)  # the flat folder stays, the same inodes
    assert sv.sort_val(val, labels, out=out, link=True) == 0


def test_wrong_states_are_refused(val, devkit):
    labels = sv.devkit_labels(devkit)
    (val / name(4)).unlink()
    with pytest.raises(UserError, match=r"1 of the 9 labelled images are in neither .*ILSVRC2012_val_00000004"):
        sv.sort_val(val, labels)
    (val / "ILSVRC2012_val_00000010.JPEG").write_bytes((val / name(1)).read_bytes())
    with pytest.raises(UserError, match="holds 1 images the labels do not name"):
        sv.sort_val(val, labels)
    (val / "ILSVRC2012_val_00000010.JPEG").unlink()
    (val / WNIDS[0]).mkdir()
    (val / name(1)).rename(val / WNIDS[0] / name(1))  # its class is WNIDS[1]
    with pytest.raises(UserError, match=f"is in {WNIDS[0]}/ but the labels put it in {WNIDS[1]}/"):
        sv.sort_val(val, labels)


def test_bad_label_files_are_one_line(devkit, tmp_path):
    (devkit / "data" / "ILSVRC2012_validation_ground_truth.txt").write_text("1\n7\n")
    with pytest.raises(UserError, match="line 2 of .* is '7', not one of meta.mat's 3 class ids"):
        sv.devkit_labels(devkit)
    with pytest.raises(UserError, match="no .*meta.mat"):
        sv.devkit_labels(tmp_path)
    bad = tmp_path / "bad.csv"
    bad.write_text("ImageId,PredictionString\nILSVRC2012_val_00000001,12 30 200 180\n")
    with pytest.raises(UserError, match="line 2 .* has no wnid"):
        sv.solution_labels(bad)
    bad.write_text("id,label\n")
    with pytest.raises(UserError, match="not ImageId,PredictionString"):
        sv.solution_labels(bad)


def test_command_line(val, tmp_path, capsys):
    csv = write_solution(tmp_path / "LOC_val_solution.csv")
    assert sv.main([str(val), "--solution", str(csv)]) == 0
    assert capsys.readouterr().out.endswith("9 images moved into 3 class folders (9 labelled)\n")
    (val / WNIDS[1] / name(1)).rename(val / name(1))
    # The script itself, as a user runs it: bad input is one `error:` line and exit status 1.
    cmd = [sys.executable, str(ROOT / "scripts" / "sort_imagenet_val.py"), str(val), "--solution", str(csv)]
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert bad.returncode == 1 and bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1
    assert "half-sorted: 8 of 9 images" in bad.stderr
