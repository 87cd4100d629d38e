"""One data-loader worker's images/s on the training input paths (`python -m bench loader`).

Each row times the training set that `python train.py <its overrides>` builds (the trainer's own
build_datasets), read one sample at a time with one torch thread, as a worker runs it
(torch.utils.benchmark.Timer). The images are real photographs that installed packages ship
(scikit-learn's china.jpg and flower.jpg, matplotlib's grace_hopper.jpg), cut to 4:3 and
re-encoded as ImageNet's typical JPEG, written as an ImageFolder. "decode only" is the full-size
decode with no transform: a worker's limit.
"""
import io
import itertools
import os
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
from PIL import Image, ImageOps
from torch.utils import benchmark

from train import get_trainer
from train.recipe import compose_config

PHOTO_SIZE, QUALITY = (500, 375), 90  # ImageNet's most common size and a typical quality
# The one GPU measurement of a ViT training step so far (issue 33: an H200, ViT-B/16 at 224 px,
# eager, bf16; no committed record), and the author's sweep's 8 workers per GPU (32 CPUs / 4 GPUs).
GPU_RECORD = dict(gpu="NVIDIA H200", model="ViT-B/16", img_size=224, mode="eager", images_per_s=2285.0,
                  source="issue 33 (first wave; no committed record)")
WORKERS_PER_GPU = 8
RUNS = [  # the overrides of `python train.py` whose training set is timed; the first also decode only
    ["experiment=deit3_in1k"],  # DeiT-III's 3-Augment at 192 px
    ["experiment=deit3_in1k", "data.reduced_decode=false"],
    ["experiment=deit3_in1k", "data.device_augment=true"],  # crops and colour left to the GPU
    ["experiment=deit3_in1k_author"],  # timm's create_transform with '3a'
    ["experiment=dino_in1k"],  # multi-crop: 2 x 224 + 8 x 96
    ["experiment=dino_in1k", "data.reduced_decode=false"],
    ["experiment=dino_in1k", "trainer.multicrop.device_augment=true"],
]


def photos() -> list[Image.Image]:
    """The installed packages' photographs, each cut to 4:3 (3:4 if portrait) at PHOTO_SIZE (bicubic)."""
    import matplotlib
    from sklearn.datasets import load_sample_images

    found = [Image.fromarray(a) for a in load_sample_images().images]
    found.append(Image.open(Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg").convert("RGB"))
    # ImageOps.fit: the largest centred box of the target's aspect, resized to it.
    return [ImageOps.fit(img, PHOTO_SIZE if img.width >= img.height else PHOTO_SIZE[::-1], Image.BICUBIC)
            for img in found]


def jpeg(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=QUALITY)
    return buf.getvalue()


def tokens(img_size: int) -> int:
    return (img_size // 16) ** 2 + 1  # patches of 16 + the class token


def demand(cfg) -> float:
    """Images/s one worker must give: GPU_RECORD's rate in ViT-B tokens, over the row's tokens per
    image (a ViT's cost is near linear in them), over WORKERS_PER_GPU."""
    rate = GPU_RECORD["images_per_s"] * tokens(GPU_RECORD["img_size"])
    if cfg.trainer.name == "dino":
        mc = cfg.trainer.multicrop
        n_global, glob = len(mc.global_blur), tokens(mc.global_size)
        # The student sees every crop, the teacher the global ones forward only (a third of a
        # training step); a ViT-S costs a quarter of a ViT-B per token (22 M / 86 M parameters).
        per_image = (n_global * glob + mc.local_crops * tokens(mc.local_size) + n_global * glob / 3) * 22.1 / 86.6
    else:
        per_image = tokens(cfg.data.img_size)
    return rate / per_image / WORKERS_PER_GPU


def run(args) -> pd.DataFrame:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_images_") as root:
        shots = [jpeg(img) for img in photos()]
        for i in range(args.images):  # the photographs in turn, two classes
            folder = Path(root, "train", f"n{1440764 + i % 2:08d}")
            os.makedirs(folder, exist_ok=True)
            (folder / f"{i}.JPEG").write_bytes(shots[i % len(shots)])
        os.symlink(Path(root, "train"), Path(root, "val"))  # DeiT-III's builder opens both splits
        for overrides in [None] + RUNS:
            cfg = compose_config((overrides or RUNS[0]) + [f"data.root={root}", "data.format=folder"])
            # The trainer's own data builder (it reads cfg and the micro batch): the set training's workers index.
            ds = get_trainer(cfg.trainer.name).build_data(SimpleNamespace(cfg=cfg, micro_bs=2)).train
            if overrides is None:
                ds.transform = None  # the decoded RGB image, nothing else
            it = itertools.cycle(range(len(ds)))
            # A worker's CPU time per image (one thread): other jobs on the host do not count.
            timer = benchmark.Timer("ds[next(it)]", globals=dict(ds=ds, it=it), num_threads=1, timer=time.process_time)
            m = timer.blocked_autorange(min_run_time=args.min_time)
            rows.append(dict(path=" ".join(overrides) if overrides else "decode only", img_per_s=1 / m.median,
                             iqr_ms=1e3 * m.iqr, runs=len(m.times), demand_per_worker=demand(cfg)))
            print(f"[loader] {rows[-1]['path']:60s} {1 / m.median:8.1f} img/s", flush=True)
    df = pd.DataFrame(rows)
    df["supply / demand"] = df.img_per_s / df.demand_per_worker
    return df
