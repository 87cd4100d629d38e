"""Tiny datasets written in the real on-disk formats, for tests that cannot download anything.

    import fakedata
    data, labels = fakedata.write_cifar(tmp_path, "cifar10", n_train=20, n_test=10)
    labels = fakedata.write_imagenet_folder(tmp_path, n_classes=3, per_class=2)
    labels = fakedata.write_imagenet_parquet(tmp_path, n_classes=3, per_class=2)
    jpegs = fakedata.photo_jpegs()      # real photographs as ImageNet-like JPEG bytes

The real readers (torchvision's CIFAR unpickling, ImageFolder, `datasets` parquet) then load
them exactly as they load the real data.
"""

import io
import os
import pickle

import numpy as np
from PIL import Image

_CIFAR = {
    # name: (folder, train files, test file, meta file, label key, meta key, classes)
    "cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], "test_batch", "batches.meta",
                "labels", "label_names", 10),
    "cifar100": ("cifar-100-python", ["train"], "test", "meta", "fine_labels", "fine_label_names", 100),
}


def write_cifar(root, name: str, n_train: int = 20, n_test: int = 10, seed: int = 0):
    """Write a CIFAR-10/100 folder under root; return {"train"/"test": (uint8 [N,32,32,3], labels)}.

    The real batches are Python-2 pickles whose str keys load as str under torchvision's
    `encoding="latin1"`; Python-3 str keys load identically. Pixels are stored channel-major
    (uint8 [N, 3072] = R plane, G plane, B plane), as in the real files.
    """
    folder, train_files, test_file, meta_file, label_key, meta_key, n_classes = _CIFAR[name]
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(root, folder), exist_ok=True)

    def dump(fname, obj):
        with open(os.path.join(root, folder, fname), "wb") as f:
            pickle.dump(obj, f, protocol=2)

    out = {}
    for split, files, n in (("train", train_files, n_train), ("test", [test_file], n_test)):
        hwc = rng.integers(0, 256, size=(n, 32, 32, 3), dtype=np.uint8)
        labels = rng.integers(0, n_classes, size=n).tolist()
        chunks = np.array_split(np.arange(n), len(files))
        for fname, idx in zip(files, chunks):
            entry = {"data": hwc[idx].transpose(0, 3, 1, 2).reshape(len(idx), 3072), label_key: [labels[i] for i in idx]}
            if name == "cifar100":
                entry["coarse_labels"] = [lab // 5 for lab in entry[label_key]]
            dump(fname, entry)
        out[split] = (hwc, labels)
    meta = {meta_key: [f"class_{i}" for i in range(n_classes)]}
    if name == "cifar100":
        meta["coarse_label_names"] = [f"super_{i}" for i in range(20)]
    dump(meta_file, meta)
    return out


def _jpeg_bytes(rng, size: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, size=(size, size + 3, 3), dtype=np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


def write_imagenet_folder(root, n_classes: int = 3, per_class: int = 2, size: int = 24, seed: int = 0):
    """Write root/train/<wnid>/*.JPEG and root/val/<wnid>/*.JPEG; return the wnids in label order."""
    rng = np.random.default_rng(seed)
    wnids = [f"n{1440764 + i:08d}" for i in range(n_classes)]
    for split in ("train", "val"):
        for wnid in wnids:
            os.makedirs(os.path.join(root, split, wnid), exist_ok=True)
            for j in range(per_class):
                with open(os.path.join(root, split, wnid, f"{wnid}_{j}.JPEG"), "wb") as f:
                    f.write(_jpeg_bytes(rng, size))
    return wnids


def write_imagenet_parquet(root, n_classes: int = 3, per_class: int = 2, size: int = 24, seed: int = 0):
    """Write root/data/{train,validation}-0000k-of-00002.parquet in the HF imagenet-1k layout.

    Returns {"train"/"validation": labels in row order}. Written through `datasets` with the
    `Image()` / `ClassLabel` features, so the files carry the same schema and HF metadata as
    the hub's: image = struct<bytes: binary, path: string>, label = int64.
    """
    from datasets import ClassLabel, Dataset, Features
    from datasets import Image as HFImage

    rng = np.random.default_rng(seed)
    features = Features({"image": HFImage(), "label": ClassLabel(num_classes=n_classes)})
    out = {}
    for split in ("train", "validation"):
        labels = [c for c in range(n_classes) for _ in range(per_class)]
        rows = {
            "image": [{"bytes": _jpeg_bytes(rng, size), "path": f"{split}_{i}.JPEG"} for i in range(len(labels))],
            "label": labels,
        }
        ds = Dataset.from_dict(rows, features=features)
        os.makedirs(os.path.join(root, "data"), exist_ok=True)
        half = len(labels) // 2  # two shards, to exercise multi-file loading
        for k, (lo, hi) in enumerate(((0, half), (half, len(labels)))):
            ds.select(range(lo, hi)).to_parquet(os.path.join(root, "data", f"{split}-{k:05d}-of-00002.parquet"))
        out[split] = labels
    return out


def photo_jpegs(size=(500, 375), quality: int = 90) -> list[bytes]:
    """Real photographs that installed packages ship (scikit-learn's china.jpg and flower.jpg,
    matplotlib's grace_hopper.jpg), cut to 4:3 (3:4 if portrait), resized to ImageNet's typical
    500 x 375 (bicubic) and encoded as JPEG at quality 90: as bench/images.py makes them."""
    from pathlib import Path

    from sklearn.datasets import load_sample_images

    s = load_sample_images()
    found = [Image.fromarray(a) for a in s.images]
    try:
        import matplotlib

        hopper = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
        if hopper.is_file():
            found.append(Image.open(hopper).convert("RGB"))
    except ImportError:
        pass
    out = []
    for img in found:
        w, h = size if img.width >= img.height else size[::-1]
        scale = max(w / img.width, h / img.height)
        cw, ch = w / scale, h / scale
        box = ((img.width - cw) / 2, (img.height - ch) / 2, (img.width + cw) / 2, (img.height + ch) / 2)
        buf = io.BytesIO()
        img.resize((w, h), Image.BICUBIC, box=box).save(buf, format="JPEG", quality=quality)
        out.append(buf.getvalue())
    return out
