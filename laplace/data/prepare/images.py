"""`prepare source=imagefolder`: ImageNet's folder layout -> parquet shards in the Hugging Face layout.

    python prepare.py source=imagefolder in=/data/imagenet out=/data/imagenet_parquet

`in` holds train/<wnid>/*.JPEG and val/<wnid>/*.JPEG (either may be absent, not both); `out` gets
out/data/train-00000-of-00321.parquet ... and out/data/validation-*.parquet, the files the
parquet route of laplace.data.imagenet reads (data.root=<out>). On a cluster file system one
parquet file of a few thousand images opens far faster than as many small JPEGs.

Each row is `image` {bytes, path} and `label`, with the HF features (Image, ClassLabel) in the
schema's metadata, as the hub's imagenet-1k files: the bytes are the file's own (no re-encoding),
path its file name. Rows follow torchvision ImageFolder's order (classes in sorted wnid order, then
files in sorted order), and labels are its class indices, so row i of a split is sample i of the
folder route, and the labels are the hub's (its ids are the sorted-wnid order too). The class
names in the schema are the wnids (the folders know no others). In that order a row group holds one
or two classes: `shuffle_seed` puts the training rows in a seeded random order instead, for readers
that draw whole row groups (the paper's first author's ParquetDistributedSampler); our training
feed draws a uniform permutation either way.

Shard i holds rows [i * images_per_shard, (i + 1) * images_per_shard). Each is written to a hidden
temp file and renamed (laplace.io.atomic_write), so a killed run leaves whole shards and a temp
file; a re-run removes the temp file, keeps the whole shards (their row counts checked from the
footer) and writes the rest. What decides the shards (the file lists, images_per_shard) is pinned
in out/.settings.json: a re-run into the same out after the folders changed is refused.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from laplace.data import DatasetNotFoundError
from laplace.errors import ConfigError
from laplace.io import atomic_write

META_VERSION = 1
SPLITS = (("train", "train"), ("val", "validation"))  # (folder under `in`, the hub's split name)


def shard_name(split: str, i: int, n: int) -> str:
    """The hub's file name: train-00007-of-00321.parquet."""
    return f"{split}-{i:05d}-of-{n:05d}.parquet"


def _row_group_bytes() -> int:
    # `datasets`' own target when it writes parquet (Dataset.to_parquet): row groups of ~100 MB.
    from datasets import config
    from datasets.utils.py_utils import convert_file_size_to_int

    return convert_file_size_to_int(config.MAX_ROW_GROUP_SIZE)


def features(classes: list[str]):
    """The HF features of the hub's imagenet-1k files: image {bytes, path}, label (ClassLabel)."""
    from datasets import ClassLabel, Features, Image

    return Features({"image": Image(), "label": ClassLabel(names=classes)})


def scan(folder: Path):
    """(classes, [(path, label)]) of one split folder, as the folder route reads it."""
    from laplace.data.imagenet import ImageFolder

    try:
        ds = ImageFolder(str(folder))
    except FileNotFoundError as e:  # a class folder without images, or no class folders
        raise DatasetNotFoundError(f"in={folder.parent}: {folder} is not a <wnid>/*.JPEG folder tree "
                                   f"({e}); point in= at the folder holding train/ and val/") from None
    return ds.classes, ds.samples


def fingerprint(folder: Path, classes: list[str], samples: list) -> dict:
    """What decides a split's shards: its image count and a hash of its relative file names."""
    h = hashlib.sha256("\n".join(classes).encode())
    for path, label in samples:
        h.update(f"\n{os.path.relpath(path, folder)}\t{label}".encode())
    return {"images": len(samples), "files_sha256": h.hexdigest()}


def _whole(path: Path, rows: int) -> bool:
    """A finished shard: readable footer with the expected row count."""
    import pyarrow.parquet as pq

    try:
        return pq.read_metadata(path).num_rows == rows
    except (OSError, ValueError):  # absent, or not a whole parquet file (pyarrow's errors are OSErrors)
        return False


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def write_shard(path: Path, rows: list, feats, pool: ThreadPoolExecutor, batch: int, group_bytes: int) -> int:
    """Write rows [(file, label)] to `path` atomically; return the bytes of the images written.

    The pool's threads read the files `batch` at a time (a network file system serves many reads
    at once; Executor.map reads all it is given before yielding, so not the whole shard at once),
    in order; rows go out in row groups of about `group_bytes`: memory holds about one row group."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = feats.arrow_schema
    total = 0

    def write(f):
        nonlocal total
        writer = pq.ParquetWriter(f, schema)
        images, labels, size = [], [], 0
        for lo in range(0, len(rows), batch):
            chunk = rows[lo:lo + batch]
            for (file, label), data in zip(chunk, pool.map(_read, (r[0] for r in chunk))):
                images.append({"bytes": data, "path": os.path.basename(file)})
                labels.append(label)
                size += len(data)
            if size >= group_bytes or lo + batch >= len(rows):
                writer.write_table(pa.table({"image": images, "label": labels}, schema=schema))
                total, images, labels, size = total + size, [], [], 0
        writer.close()

    atomic_write(path, write, sole_writer=True)  # sole_writer: a killed run's temp file is removed first
    return total


PINNED = ("images_per_shard", "shuffle_seed")  # besides the file lists: what decides the shards


def _settings(cfg, fingerprints: dict) -> dict:
    return {"source": "imagefolder", **{k: cfg[k] for k in PINNED}, "splits": fingerprints}


def _check_settings(out: Path, settings: dict, where: str) -> None:
    path = out / ".settings.json"
    if not path.is_file():
        return
    old = json.loads(path.read_text())
    if old.get("source") != "imagefolder":
        raise ConfigError(f"out={out} holds another prepare output (source={old.get('source')}); "
                          f"set out= to a new folder")
    for k in PINNED:
        if old.get(k) != settings[k]:
            now, was = ("null" if v is None else v for v in (settings[k], old.get(k)))  # as YAML says it
            raise ConfigError(f"{k}={now}, but out={out} holds shards made with {k}={was}; set {k}={was} "
                              f"to resume, or out= to another folder, or add rebuild=true")
    for split, fp in settings["splits"].items():
        was = old["splits"].get(split)
        if was is not None and was != fp:
            raise ConfigError(f"in={where}: its {split} images changed since out={out} was written from "
                              f"them ({was['images']:,} images then, {fp['images']:,} now, other file "
                              f"names): prepare into another out=, or add rebuild=true to start again")


def _remove_outputs(out: Path, everything: bool) -> None:
    """Temp files of a killed run, and with `everything` (rebuild=true) the outputs too."""
    for p in list((out / "data").glob(".*.parquet.*tmp*")) + list(out.glob(".*.json.*tmp*")):
        p.unlink(missing_ok=True)
    if everything:
        for split in ("train", "validation"):
            for p in (out / "data").glob(f"{split}-*.parquet"):
                p.unlink()
        for name in ("meta.json", ".settings.json"):
            (out / name).unlink(missing_ok=True)


def convert_split(samples: list, split: str, folder: Path, per_shard: int, feats, pool, batch: int,
                  group_bytes: int, progress: bool) -> list[dict]:
    """The shards of one split in `folder`; returns [{file, images}] in order."""
    n = max(1, -(-len(samples) // per_shard))
    stale = [p for p in folder.glob(f"{split}-*.parquet") if not p.name.endswith(f"-of-{n:05d}.parquet")]
    if stale:  # the settings pin the count, so only a hand-made file gets here
        raise ConfigError(f"{stale[0]} is not one of the {n} {split} shards this run writes; remove it, "
                          f"or add rebuild=true")
    shards, kept, t0, new_images, new_bytes = [], 0, time.perf_counter(), 0, 0
    for i in range(n):
        rows = samples[i * per_shard:(i + 1) * per_shard]
        path = folder / shard_name(split, i, n)
        shards.append({"file": f"data/{path.name}", "images": len(rows)})
        if _whole(path, len(rows)):
            kept += 1
            continue
        if path.exists():
            print(f"[prepare] {path} is not a whole shard of {len(rows)} images: writing it again", flush=True)
        new_bytes += write_shard(path, rows, feats, pool, batch, group_bytes)
        new_images += len(rows)
        if progress:  # the rates are this run's: shards kept from an earlier run do not count
            secs = max(time.perf_counter() - t0, 1e-9)
            print(f"[prepare] {split} shard {i + 1}/{n}: {sum(s['images'] for s in shards):,}/{len(samples):,} "
                  f"images, {new_images / secs:,.0f} images/s, {new_bytes / 1e6 / secs:,.1f} MB/s", flush=True)
    if kept:
        print(f"[prepare] {split}: {kept} of {n} shards existed, kept", flush=True)
    return shards


def prepare_images(cfg) -> dict:
    """Convert cfg.in's train/ and val/ folders into parquet shards in out (configs/prepare.yaml)."""
    from laplace.tokenizer import _cores

    from .settings import _positive

    if cfg["in"] is None:
        raise ConfigError("source=imagefolder needs in=<folder holding train/<wnid>/*.JPEG and "
                          "val/<wnid>/*.JPEG>, e.g. in=/data/imagenet")
    src = Path(str(cfg["in"])).expanduser().absolute()
    per_shard = _positive(cfg, "images_per_shard")
    seed = _positive(cfg, "shuffle_seed", allow_null=True, allow_zero=True)
    threads = _positive(cfg, "num_workers", allow_null=True) or _cores()
    name = cfg.name or f"{src.name}_parquet"
    out = Path(str(cfg.out)).expanduser() if cfg.out is not None else Path(str(cfg.paths.data_dir)).expanduser() / name
    if out.absolute() == src:
        raise ConfigError(f"out={out} is in=: write the shards to another folder")
    found = [(d, s) for d, s in SPLITS if (src / d).is_dir()]
    if not found:
        raise DatasetNotFoundError(f"in={src} holds neither train/ nor val/ (<wnid>/*.JPEG folders); point "
                                   f"in= at the extracted ImageNet (scripts/sort_imagenet_val.py sorts val/)")
    t0 = time.perf_counter()
    scans = {s: (src / d, *scan(src / d)) for d, s in found}
    classes = next(iter(scans.values()))[1]
    for s, (folder, cls, _) in scans.items():
        if cls != classes:  # label i must mean the same class in both splits
            extra = sorted(set(cls) ^ set(classes))
            raise ConfigError(f"in={src}: train/ and val/ hold different class folders ({len(extra)} in one "
                              f"only, e.g. {extra[0] if extra else 'the order'}); is val/ sorted "
                              f"(scripts/sort_imagenet_val.py)?")
    print(f"[prepare] {src}: {len(classes)} classes, "
          + ", ".join(f"{s} {len(smp):,} images" for s, (_, _, smp) in scans.items())
          + f" (listed in {time.perf_counter() - t0:.1f} s) -> {out}", flush=True)

    settings = _settings(cfg, {s: fingerprint(f, c, smp) for s, (f, c, smp) in scans.items()})
    _remove_outputs(out, everything=bool(cfg.rebuild))
    _check_settings(out, settings, str(src))
    old = json.loads((out / ".settings.json").read_text())["splits"] if (out / ".settings.json").is_file() else {}
    atomic_write(out / ".settings.json", json.dumps({**settings, "splits": {**old, **settings["splits"]}},
                                                    indent=1).encode())

    if seed is not None and "train" in scans:  # after the fingerprint, which is of the folders' own order
        import numpy as np

        folder, cls, train = scans["train"]
        scans["train"] = (folder, cls, [train[i] for i in np.random.default_rng(seed).permutation(len(train))])
    feats, group_bytes = features(classes), _row_group_bytes()
    meta = {"version": META_VERSION, "source": f"imagefolder {src}", "images_per_shard": per_shard,
            "shuffle_seed": seed, "classes": classes}
    with ThreadPoolExecutor(threads) as pool:
        for s, (_, _, samples) in scans.items():
            shards = convert_split(samples, s, out / "data", per_shard, feats, pool, 8 * threads,
                                   group_bytes, bool(cfg.progress))
            meta[s] = {"images": len(samples), "shards": shards}
    atomic_write(out / "meta.json", json.dumps(meta, indent=1).encode())
    print("[prepare] " + ", ".join(f"{s}: {meta[s]['images']:,} images in {len(meta[s]['shards'])} shards"
                                    for s in scans) + f" in {time.perf_counter() - t0:.1f} s; "
          f"read them with data.root={out}", flush=True)
    return meta
