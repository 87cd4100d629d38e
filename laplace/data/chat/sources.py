"""Where chat tasks come from: one split of a hub dataset, or of a local copy of its files
(docs/text_data.md: the folder layouts and why the files are found here, not by `datasets`)."""
import os
import re
from pathlib import Path

from laplace.data import DatasetNotFoundError
from laplace.errors import one_line

HUB_IDS = {"smoltalk": "HuggingFaceTB/smol-smoltalk", "mmlu": "cais/mmlu", "gsm8k": "openai/gsm8k",
           "arc": "allenai/ai2_arc"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_FORMATS = (("parquet", "parquet"), ("jsonl", "json"), ("json", "json"))  # file suffix, builder


def _split_files(folder: Path, split: str) -> tuple[str | None, list[str]]:
    """(builder, files) of `split` directly in `folder`: `<split>-*.<ext>` or `<split>.<ext>`."""
    for ext, builder in _FORMATS:
        files = sorted({*folder.glob(f"{split}-*.{ext}"), *folder.glob(f"{split}.{ext}")})
        if files:
            return builder, [str(f) for f in files]
    return None, []


def load_split(path: str, subset: str | None, split: str, *, key: str = "path",
               cache_dir: str | None = None):
    """A `datasets.Dataset`: one split of a hub dataset or of a local copy of its files.

    Args:
        path: a local folder (the hub repo's layout, or the subset folder itself) or a hub id.
        subset: the hub's config name (cais/mmlu: auxiliary_train, all, a subject; None: the
            dataset has one).
        split: train, test, validation, dev, ...
        key: the config key that gave `path`, named in errors.
        cache_dir: where `datasets` keeps its Arrow cache (None: HF_DATASETS_CACHE).
    """
    import datasets

    local = Path(os.path.expanduser(str(path)))
    # We find a local copy's files ourselves: load_dataset(folder, name=subset) knows only subsets
    # a README's YAML declares, and data_dir=subset maps MMLU's `dev` to validation.
    if local.exists():
        if not local.is_dir():
            raise DatasetNotFoundError(f"{key}={path} is a file; give the dataset's folder (its "
                                       f"hub layout: <folder>/<subset>/<split>-*.parquet)")
        # The hub layout: <path>/<subset>/ (mmlu, gsm8k, ai2_arc) or <path>/data/ (smol-smoltalk),
        # or the subset folder itself.
        candidates = ([local / subset] if subset else [local / "data"]) + [local]
        for folder in candidates:
            builder, files = _split_files(folder, split)
            if files:
                return datasets.load_dataset(builder, data_files={split: files}, split=split,
                                             cache_dir=cache_dir)
        looked = " or ".join(f"{c}/{split}-*.parquet" for c in candidates)
        raise DatasetNotFoundError(f"{key}={path}: no {split!r} split files ({looked}); download the "
                                   f"dataset with `hf download <hub id> --repo-type dataset "
                                   f"--local-dir {path}`")
    if not _HUB_ID.match(str(path)):  # a mistyped folder: do not ask the hub about it
        raise DatasetNotFoundError(f"{key}={path}: no such folder; download the dataset with "
                                   f"`hf download <hub id> --repo-type dataset "
                                   f"--local-dir {path}`, or give its hub id")
    try:
        return datasets.load_dataset(str(path), name=subset, split=split, cache_dir=cache_dir)
    except (ConnectionError, OSError, datasets.exceptions.DatasetNotFoundError) as e:
        # Offline, or no such dataset: one line with the command that makes a local copy.
        raise DatasetNotFoundError(f"{key}={path}: cannot load the hub dataset (subset {subset}, split "
                                   f"{split}): {one_line(e)[:200]}; offline, download it with `hf download "
                                   f"{path} --repo-type dataset --local-dir DIR` and set "
                                   f"{key}=DIR") from None
