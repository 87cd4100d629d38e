"""`prepare source=imagefolder`: ImageNet's folder layout -> parquet shards in the Hugging Face layout.

    python prepare.py source=imagefolder in=/data/imagenet out=/data/imagenet_parquet

`in` holds train/<wnid>/*.JPEG and val/<wnid>/*.JPEG (either may be absent, not both); `out` gets
out/data/train-00000-of-00321.parquet ... and out/data/validation-*.parquet, the files the parquet
route of laplace.data.imagenet reads (data.root=<out>): `image` {bytes, path} and `label`, with the
HF features in the schema, as the hub's imagenet-1k files. Row i of a split is sample i of the
folder route (shuffle_seed: the training rows in that seed's order). A killed run is resumed by the
same command; one with other settings or changed folders is refused (rebuild=true starts again).
"""
import contextlib
import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from laplace.data import DatasetNotFoundError
from laplace.errors import ConfigError
from laplace.io import atomic_write

SPLITS = (("train", "train"), ("val", "validation"))  # (folder under `in`, the hub's split name)


def scan(folder: Path):
    """(classes, [(path, label)]) of one split folder, as the folder route reads it."""
    from laplace.data.imagenet import ImageFolder

    try:
        ds = ImageFolder(str(folder))
    except FileNotFoundError as e:  # a class folder without images, or no class folders
        raise DatasetNotFoundError(f"in={folder.parent}: {folder} is not a <wnid>/*.JPEG folder tree "
                                   f"({e}); point in= at the folder holding train/ and val/") from None
    return ds.classes, ds.samples


def write_shards(ds, split: str, folder: Path, per_shard: int, pool: ThreadPoolExecutor, progress: bool) -> list:
    """`ds` (an HF Dataset of file paths) as parquet shards of `per_shard` rows; returns [{file, images}]."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.table import embed_table_storage

    def embed(table):
        # datasets' own embedding (the file's bytes, not re-encoded; the path's base name), on
        # threads: a cluster file system serves many reads at once.
        parts = [table.slice(i, 16) for i in range(0, len(table), 16)]
        return pa.concat_tables(pool.map(embed_table_storage, parts))

    n = max(1, -(-len(ds) // per_shard))
    shards, t0 = [], time.perf_counter()
    for i in range(n):
        path = folder / f"{split}-{i:05d}-of-{n:05d}.parquet"  # the hub's file names
        rows = range(i * per_shard, min((i + 1) * per_shard, len(ds)))
        shards.append({"file": f"data/{path.name}", "images": len(rows)})
        # A whole shard (its footer's row count) from an earlier run is kept; absent, or cut short
        # by a kill (OSError, ValueError), it is written.
        with contextlib.suppress(OSError, ValueError):
            if pq.read_metadata(path).num_rows == len(rows):
                continue
        # One shard's images in memory (~0.5 GB at 4,000 ImageNet JPEGs), written to a temp file
        # and renamed: a killed run leaves whole shards (and a temp file the next run removes).
        # new_fingerprint: names the result, so datasets does not hash `embed` (seconds, with dill).
        shard = ds.select(rows).with_format("arrow").map(embed, batched=True, batch_size=512, keep_in_memory=True,
                                                         new_fingerprint=path.name)
        atomic_write(path, shard.to_parquet, sole_writer=True)
        if progress:
            print(f"[prepare] {split} shard {i + 1}/{n}: {rows.stop:,}/{len(ds):,} images "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return shards


def prepare_images(cfg) -> dict:
    """Convert cfg.in's train/ and val/ folders into parquet shards in out (configs/prepare.yaml)."""
    from datasets import ClassLabel, Dataset, Features, Image, disable_progress_bars

    from laplace.tokenizer import cpu_cores

    from .settings import output_dir, pin, positive_int, remove_outputs

    if cfg["in"] is None:
        raise ConfigError("source=imagefolder needs in=<folder holding train/<wnid>/*.JPEG and "
                          "val/<wnid>/*.JPEG>, e.g. in=/data/imagenet")
    src = Path(str(cfg["in"])).expanduser().absolute()
    per_shard = positive_int(cfg, "images_per_shard")
    seed = positive_int(cfg, "shuffle_seed", allow_null=True, allow_zero=True)
    threads = positive_int(cfg, "num_workers", allow_null=True) or cpu_cores()
    out = output_dir(cfg, f"{src.name}_parquet")
    if out.absolute() == src:
        raise ConfigError(f"out={out} is in=: write the shards to another folder")
    found = [(d, s) for d, s in SPLITS if (src / d).is_dir()]
    if not found:
        raise DatasetNotFoundError(f"in={src} holds neither train/ nor val/ (<wnid>/*.JPEG folders); point "
                                   f"in= at the extracted ImageNet (docs/data.md: torchvision sorts val/)")
    # The folder route's own listing (torchvision's ImageFolder: sorted wnids, then sorted files),
    # so row i is its sample i by construction. datasets' imagefolder builder lists the same way,
    # but writes an Arrow cache of the paths and labels no single-class folder.
    scans = {s: scan(src / d) for d, s in found}
    classes = next(iter(scans.values()))[0]
    if any(cls != classes for cls, _ in scans.values()):  # label i must mean one class in both splits
        raise ConfigError(f"in={src}: train/ and val/ hold different class folders; is val/ sorted "
                          f"(docs/data.md)?")
    print(f"[prepare] {src}: {len(classes)} classes, " + ", ".join(f"{s} {len(smp):,} images" for s, (_, smp)
                                                                   in scans.items()) + f" -> {out}", flush=True)

    # A killed run's temp files; with rebuild=true every output
    remove_outputs(out, ("data/*.parquet", "meta.json", ".settings.json"), everything=bool(cfg.rebuild))
    # What decides the shards: a re-run must match it. A split's files: their count and a hash
    # of their relative names and labels.
    files = {f"{s} images": f"{len(smp)} files, sha256 " + hashlib.sha256("\n".join(
        f"{os.path.relpath(p, src)}\t{y}" for p, y in smp).encode()).hexdigest()[:16] for s, (_, smp) in scans.items()}
    pin(out, {"source": "imagefolder", "images_per_shard": per_shard, "shuffle_seed": seed, **files})

    features = Features({"image": Image(), "label": ClassLabel(names=classes)})
    disable_progress_bars()  # datasets' two bars per shard; progress=true prints a line per shard
    meta = {"source": f"imagefolder {src}", "images_per_shard": per_shard, "shuffle_seed": seed, "classes": classes}
    with ThreadPoolExecutor(threads) as pool:
        for s, (_, samples) in scans.items():
            paths, labels = zip(*samples)
            ds = Dataset.from_dict({"image": list(paths), "label": list(labels)}, features=features)
            if seed is not None and s == "train":  # rows in np.random.default_rng(seed).permutation's order
                ds = ds.shuffle(seed=seed)
            shards = write_shards(ds, s, out / "data", per_shard, pool, bool(cfg.progress))
            meta[s] = {"images": len(ds), "shards": shards}
    atomic_write(out / "meta.json", json.dumps(meta, indent=1).encode())
    print("[prepare] " + ", ".join(f"{s}: {meta[s]['images']:,} images in {len(meta[s]['shards'])} shards"
                                    for s in scans) + f"; read them with data.root={out}", flush=True)
    return meta
