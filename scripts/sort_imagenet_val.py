"""Sort ImageNet's flat validation folder (ILSVRC2012_val_00000001.JPEG ...) into <wnid>/ folders.

    python scripts/sort_imagenet_val.py /data/imagenet/val --devkit /data/ILSVRC2012_devkit_t12.tar.gz
    python scripts/sort_imagenet_val.py /data/imagenet/val --devkit /data/ILSVRC2012_devkit_t12
    python scripts/sort_imagenet_val.py ILSVRC/Data/CLS-LOC/val --solution LOC_val_solution.csv \
        --out /data/imagenet/val --link

ILSVRC2012_img_val.tar holds the 50,000 validation images in one flat folder; the folder route of
laplace.data.imagenet (and torchvision's ImageFolder) wants val/<wnid>/*.JPEG. The labels come from

  --devkit    ILSVRC2012_devkit_t12 (the .tar.gz or its extracted folder): data/ILSVRC2012_validation_
              ground_truth.txt holds one ILSVRC2012_ID per line, line k for ILSVRC2012_val_<k:08d>.JPEG,
              and data/meta.mat's `synsets` struct maps each leaf synset's ILSVRC2012_ID (1..1000) to its
              WNID (read with scipy.io.loadmat, by field name);
  --solution  Kaggle's LOC_val_solution.csv (ImageNet Object Localization Challenge): `ImageId,
              PredictionString` rows, ImageId the file name without .JPEG, the first token of
              PredictionString the wnid (then boxes: "<wnid> x0 y0 x1 y1 <wnid> ...").

Images are moved (os.rename, same folder tree) into <out>/<wnid>/, or with --link hard-linked there
(the flat folder stays; --out must be another folder on the same file system). A re-run on a sorted
folder does nothing. A half-sorted folder (a run stopped mid-way) is refused unless --resume, which
sorts the rest; images in the wrong class folder, or named by the labels but found nowhere, are
always refused. torchvision's ImageNet does the devkit part only inside its own archive handling
(verified md5s, a meta.bin beside the tars), so the few steps are written here.
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import re
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout: python scripts/...

from laplace.errors import UserError, cli_errors  # noqa: E402

GROUND_TRUTH = "data/ILSVRC2012_validation_ground_truth.txt"
META = "data/meta.mat"
WNID = re.compile(r"n\d{8}")
EXTENSIONS = (".jpeg", ".jpg")


def _devkit_files(devkit: Path) -> tuple[bytes, bytes]:
    """(meta.mat, ground truth) bytes from the devkit folder or its .tar.gz."""
    if devkit.is_dir():
        try:
            return (devkit / META).read_bytes(), (devkit / GROUND_TRUTH).read_bytes()
        except FileNotFoundError as e:
            raise UserError(f"--devkit {devkit}: no {e.filename}; give the extracted "
                            f"ILSVRC2012_devkit_t12 folder (it holds data/meta.mat) or its .tar.gz") from None
    try:
        with tarfile.open(devkit) as tar:
            found = {}
            for m in tar.getmembers():
                for want in (META, GROUND_TRUTH):
                    if m.isfile() and m.name.endswith(want):
                        found[want] = tar.extractfile(m).read()
    except (OSError, tarfile.TarError) as e:
        raise UserError(f"--devkit {devkit}: not a readable devkit folder or tar ({e}); give "
                        f"ILSVRC2012_devkit_t12.tar.gz or its extracted folder") from None
    if len(found) < 2:
        missing = [w for w in (META, GROUND_TRUTH) if w not in found][0]
        raise UserError(f"--devkit {devkit} holds no {missing}: is it ILSVRC2012_devkit_t12.tar.gz?")
    return found[META], found[GROUND_TRUTH]


def devkit_labels(devkit: Path) -> dict[str, str]:
    """{file name: wnid} of the 50,000 validation images from the devkit."""
    import scipy.io

    meta, truth = _devkit_files(devkit)
    synsets = scipy.io.loadmat(io.BytesIO(meta), squeeze_me=True)["synsets"]
    # Leaf synsets (no children) are the 1,000 classes; the rest are WordNet's inner nodes.
    id_to_wnid = {int(s["ILSVRC2012_ID"]): str(s["WNID"]) for s in synsets.ravel() if int(s["num_children"]) == 0}
    labels = {}
    for k, line in enumerate(truth.decode().split(), start=1):
        if not line.isdigit() or int(line) not in id_to_wnid:
            raise UserError(f"--devkit {devkit}: line {k} of {GROUND_TRUTH} is {line!r}, not one of "
                            f"meta.mat's {len(id_to_wnid)} class ids")
        labels[f"ILSVRC2012_val_{k:08d}.JPEG"] = id_to_wnid[int(line)]
    return labels


def solution_labels(path: Path) -> dict[str, str]:
    """{file name: wnid} from Kaggle's LOC_val_solution.csv."""
    labels = {}
    try:
        with open(path, newline="") as f:
            rows = csv.DictReader(f)
            if rows.fieldnames is None or not {"ImageId", "PredictionString"} <= set(rows.fieldnames):
                raise UserError(f"--solution {path}: header is {rows.fieldnames}, not ImageId,PredictionString "
                                f"(Kaggle's LOC_val_solution.csv)")
            for k, row in enumerate(rows, start=2):
                wnid = (row["PredictionString"] or "").split()[:1]
                if not wnid or not WNID.fullmatch(wnid[0]):
                    raise UserError(f"--solution {path}: line {k} ({row['ImageId']}) has no wnid (n + 8 digits) "
                                    f"first in PredictionString: {row['PredictionString']!r}")
                labels[f"{row['ImageId']}.JPEG"] = wnid[0]
    except FileNotFoundError:
        raise UserError(f"--solution {path}: no such file") from None
    return labels


def _state(src: Path, dst: Path, labels: dict[str, str]) -> tuple[set, set]:
    """(flat image names in src, names already in their dst/<wnid>/); refuses misplaced files."""
    flat = {p.name for p in src.iterdir() if p.is_file() and p.suffix.lower() in EXTENSIONS}
    unknown = sorted(flat - labels.keys())
    if unknown:
        raise UserError(f"{src} holds {len(unknown):,} images the labels do not name (e.g. {unknown[0]}): "
                        f"are the labels for this folder?")
    placed = set()
    for d in (p for p in dst.iterdir() if p.is_dir()) if dst.is_dir() else ():
        for f in d.iterdir():
            if labels.get(f.name) not in (None, d.name):
                raise UserError(f"{f} is in {d.name}/ but the labels put it in {labels[f.name]}/: "
                                f"this folder was sorted with other labels; start again from the tar")
            if f.name in labels:
                placed.add(f.name)
    return flat, placed


def sort_val(src: Path, labels: dict[str, str], out: Path | None = None, link: bool = False,
             resume: bool = False) -> int:
    """Move (or hard-link) src's flat images into out/<wnid>/ (out: src itself); returns how many."""
    src = src.absolute()
    dst = (out or src).absolute()
    if not src.is_dir():
        raise UserError(f"{src}: no such folder; give the folder ILSVRC2012_img_val.tar was extracted into")
    if link and dst == src:
        raise UserError("--link keeps the flat images: give --out, another folder on the same file system")
    flat, placed = _state(src, dst, labels)
    todo = sorted(labels.keys() - placed)
    missing = [n for n in todo if n not in flat]
    if missing:
        raise UserError(f"{len(missing):,} of the {len(labels):,} labelled images are in neither {src} nor "
                        f"{dst}/<wnid>/ (e.g. {missing[0]}): is {src} the whole extracted ILSVRC2012_img_val.tar?")
    if not todo:
        print(f"{dst}: already sorted ({len(labels):,} images in {len(set(labels.values()))} class folders)")
        return 0
    if placed and not resume:
        raise UserError(f"{dst} is half-sorted: {len(placed):,} of {len(labels):,} images are in class folders "
                        f"and {len(todo):,} are not (a stopped run?); add --resume to sort the rest, or start "
                        f"again from the extracted tar")
    for wnid in sorted({labels[n] for n in todo}):
        (dst / wnid).mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(todo, start=1):
        target = dst / labels[name] / name
        try:
            (os.link if link else os.rename)(src / name, target)
        except OSError as e:
            raise UserError(f"cannot {'link' if link else 'move'} {src / name} to {target} ({e.strerror}); "
                            f"{'hard links need one file system: drop --link to move' if link else 'check the permissions'}"
                            ) from None
        if i % 10000 == 0:
            print(f"{i:,}/{len(todo):,} images {'linked' if link else 'moved'}", flush=True)
    print(f"{dst}: {len(todo):,} images {'linked' if link else 'moved'} into "
          f"{len({labels[n] for n in todo})} class folders ({len(labels):,} labelled)")
    return len(todo)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("val", type=Path, help="the flat folder ILSVRC2012_img_val.tar was extracted into")
    labels = p.add_mutually_exclusive_group(required=True)
    labels.add_argument("--devkit", type=Path, help="ILSVRC2012_devkit_t12.tar.gz or its extracted folder")
    labels.add_argument("--solution", type=Path, help="Kaggle's LOC_val_solution.csv")
    p.add_argument("--out", type=Path, help="where the <wnid>/ folders go (default: the val folder itself)")
    p.add_argument("--link", action="store_true", help="hard-link instead of moving (needs --out)")
    p.add_argument("--resume", action="store_true", help="finish a half-sorted folder")
    a = p.parse_args(argv)
    table = devkit_labels(a.devkit) if a.devkit else solution_labels(a.solution)
    sort_val(a.val, table, a.out, link=a.link, resume=a.resume)
    return 0


if __name__ == "__main__":
    sys.exit(cli_errors(main)())
