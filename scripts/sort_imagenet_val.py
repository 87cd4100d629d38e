"""Sort ImageNet's flat validation images into val/<wnid>/ folders (what the folder route reads).

With the official archives in one folder (ILSVRC2012_devkit_t12.tar.gz, ILSVRC2012_img_val.tar),
torchvision does it all, checking their md5s, extracting the tar into <folder>/val and sorting it:

    python -c "import torchvision; torchvision.datasets.ImageNet('/data/imagenet', split='val')"

This script covers what that one-liner does not: a val folder already extracted (labels from the
devkit, parsed by torchvision), and Kaggle's copy (ImageNet Object Localization Challenge),
whose labels are in LOC_val_solution.csv:

    python scripts/sort_imagenet_val.py /data/imagenet/val --devkit /data/ILSVRC2012_devkit_t12.tar.gz
    python scripts/sort_imagenet_val.py ILSVRC/Data/CLS-LOC/val --solution LOC_val_solution.csv \
        --out /data/imagenet/val --link

Images are moved into <out>/<wnid>/ (out: the val folder itself), or hard-linked with --link.
A re-run, after a stopped one, sorts what is still flat.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout: python scripts/...

from laplace.errors import UserError, cli_errors  # noqa: E402


def devkit_labels(devkit: Path) -> dict[str, str]:
    """{file name: wnid} of the 50,000 validation images, by torchvision's devkit parser."""
    from torchvision.datasets.imagenet import load_meta_file, parse_devkit_archive

    with tempfile.TemporaryDirectory() as tmp:
        # An absolute `file` joins to itself, so meta.bin goes to tmp, not beside the devkit.
        try:
            parse_devkit_archive(tmp, str(Path(devkit).absolute()))
        except RuntimeError as e:  # torchvision's "not present ... or is corrupted" (md5)
            raise UserError(f"--devkit {devkit}: {e}") from None
        # meta.bin holds (wnid -> class names, the wnid of each ground-truth line).
        wnids = load_meta_file(tmp)[1]  # line k of the ground truth: the class of image k
    return {f"ILSVRC2012_val_{k:08d}.JPEG": w for k, w in enumerate(wnids, start=1)}


def solution_labels(path: Path) -> dict[str, str]:
    """{file name: wnid} from Kaggle's LOC_val_solution.csv: `ImageId,PredictionString` rows,
    whose PredictionString starts with the wnid (then boxes: "<wnid> x0 y0 x1 y1 <wnid> ...")."""
    if not Path(path).is_file():
        raise UserError(f"--solution {path}: no such file")
    try:
        raw = pd.read_csv(path, dtype=str)
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as e:  # not a CSV, or an empty file
        raise UserError(f"--solution {path}: not Kaggle's LOC_val_solution.csv ({e})") from None
    rows = raw.reindex(columns=["ImageId", "PredictionString"]).astype("string")  # a column it lacks: NA
    # An image holds one class: every box repeats the same wnid, so the first token is it.
    wnid = rows.PredictionString.str.split().str[0]
    if (bad := rows.ImageId.isna() | ~wnid.str.fullmatch(r"n\d{8}", na=False)).any():
        k = bad.idxmax()  # the first bad row; line k + 2 of the file (after the header)
        raise UserError(f"--solution {path}: line {k + 2} is no `ImageId,<wnid> boxes...` row of "
                        f"Kaggle's LOC_val_solution.csv: {raw.iloc[k].to_dict()}")
    return dict(zip(rows.ImageId + ".JPEG", wnid))


def sort_val(val: Path, labels: dict[str, str], out: Path | None = None, link: bool = False) -> int:
    """Move (or hard-link) val's flat images into out/<wnid>/ (out: val itself); returns how many."""
    out = out or val
    if link and Path(out).absolute() == Path(val).absolute():
        raise UserError("--link keeps the flat images: give --out, another folder on the same file system")
    # Images already in their class folder were sorted by an earlier (stopped) run.
    todo = sorted(n for n, wnid in labels.items() if not (out / wnid / n).exists())
    missing = [n for n in todo if not (val / n).exists()]
    if missing:  # checked before anything moves
        raise UserError(f"{len(missing):,} labelled images are in neither {val} nor {out}/<wnid>/ (e.g. "
                        f"{missing[0]}): is {val} the whole extracted ILSVRC2012_img_val.tar, and are the "
                        f"labels for it?")
    for n in todo:
        (out / labels[n]).mkdir(parents=True, exist_ok=True)
        # A rename or a hard link: no byte is copied, so 6.4 GB sort in seconds on one file system.
        (os.link if link else os.replace)(val / n, out / labels[n] / n)
    print(f"{out}: {len(todo):,} images {'linked' if link else 'moved'}, {len(labels):,} in "
          f"{len(set(labels.values()))} class folders")
    return len(todo)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("val", type=Path, help="the flat folder ILSVRC2012_img_val.tar was extracted into")
    labels = p.add_mutually_exclusive_group(required=True)
    labels.add_argument("--devkit", type=Path, help="ILSVRC2012_devkit_t12.tar.gz")
    labels.add_argument("--solution", type=Path, help="Kaggle's LOC_val_solution.csv")
    p.add_argument("--out", type=Path, help="where the <wnid>/ folders go (default: the val folder itself)")
    p.add_argument("--link", action="store_true", help="hard-link instead of moving (needs --out)")
    a = p.parse_args(argv)
    sort_val(a.val, devkit_labels(a.devkit) if a.devkit else solution_labels(a.solution), a.out, a.link)
    return 0


if __name__ == "__main__":
    sys.exit(cli_errors(main)())
