"""One data-loader worker's images/s on each training input path (`python -m bench --sections images`).

The photographs are real ones that installed packages ship (scikit-learn's china.jpg and
flower.jpg, matplotlib's grace_hopper.jpg), cut to ImageNet's typical 4:3 and re-encoded as
ImageNet's typical JPEG (500 x 375, the portrait one 375 x 500, quality 90). They are written
as an ImageFolder and as the Hugging Face parquet layout, both read by laplace.data.imagenet as
training reads them. Each path runs in this process with one torch thread, through the training
feed's SeededDataset (sample i seeded with i), so its rate is one worker's:

    decode     the image decoded to RGB, no transform: the limit of a full-size decode
    deit3      DeiT-III's 3-Augment (laplace.data.transforms.three_augment) at data.img_size
    timm_3a    timm's create_transform with '3a', the paper's own recipe (experiment=deit3_in1k_author)
    dino       DINO's multi-crop, 2 x 224 + 8 x 96 (laplace.data.multicrop, trainer=dino's defaults)
    eval       the evaluation transform (resize + centre crop) at data.img_size / data.eval_crop_pct

deit3, timm_3a and eval run with the full-size decode (`full`: `data.reduced_decode=false`, the
code before issue 33) and decoded at the size the crop needs (`reduced`, laplace.data.decode; the
pixel difference between the two on the same seeds is recorded); deit3 and dino also with
`device`: the worker decodes, crops and draws, the colour work is left to the training device
(data.device_augment, trainer.multicrop.device_augment; its cost there is not in these figures).
dino decodes each image once (in full: its crops rarely allow a reduction). The demand is the GPU's images/s (GPU_RECORD, scaled to the path's model and
resolution) divided by the workers one GPU gets (WORKERS_PER_GPU).
"""
from __future__ import annotations

import io
import os
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
PHOTO_SIZE, QUALITY = (500, 375), 90  # ImageNet's most common size and a typical quality
# The one GPU measurement of a ViT training step so far (issue 33: the first wave, an H200, ViT-B/16
# at 224 px, eager, bf16); there is no committed record of it. The author's sweep gives each GPU 8
# workers (trainer.num_workers=8, 32 CPUs / 4 GPUs).
GPU_RECORD = dict(gpu="NVIDIA H200", model="ViT-B/16", img_size=224, mode="eager", images_per_s=2285.0,
                  source="issue 33 (first wave; no committed record)")
WORKERS_PER_GPU = 8
PATHS = ("decode", "deit3", "timm_3a", "dino", "eval")
MODES = dict(decode=("full",), deit3=("full", "reduced", "device"), timm_3a=("full", "reduced"), dino=("full", "device"),
             eval=("full", "reduced"))


def tokens(img_size: int, patch: int = 16) -> int:
    return (img_size // patch) ** 2 + 1


def demand(path: str, img_size: int, multicrop) -> tuple[float, str]:
    """(images/s one GPU consumes on this path, how it is derived from GPU_RECORD).

    Scaled by tokens per image (a ViT's cost is close to linear in them at these sizes); DINO's
    ViT-S costs about a quarter of ViT-B per token (22 M / 86 M parameters) and its teacher
    runs forward only (a third of forward + backward) on the global crops."""
    rate, t224 = GPU_RECORD["images_per_s"], tokens(GPU_RECORD["img_size"])
    if path == "dino":
        student = multicrop.n_global * tokens(multicrop.global_size) + multicrop.n_local * tokens(multicrop.local_size)
        per_image = (student + multicrop.n_global * tokens(multicrop.global_size) / 3) * 22.1 / 86.6
        return rate * t224 / per_image, f"ViT-S/16 multi-crop: {per_image:.0f} ViT-B token-equivalents per image"
    train = rate * t224 / tokens(img_size)
    if path == "eval":
        return 3 * train, f"ViT-B/16 {img_size} px forward only (3x a training step)"
    return train, f"ViT-B/16 {img_size} px training step ({tokens(img_size)} tokens)"


def photos() -> list[tuple[str, Image.Image]]:
    """The real photographs installed packages ship, each cut to 4:3 (3:4 if portrait) and
    resized to PHOTO_SIZE (bicubic)."""
    from sklearn.datasets import load_sample_images

    s = load_sample_images()
    found = [(Path(f).name, Image.fromarray(a)) for f, a in zip(s.filenames, s.images)]
    try:
        import matplotlib

        hopper = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
        if hopper.is_file():
            found.append((hopper.name, Image.open(hopper).convert("RGB")))
    except ImportError:
        pass
    out = []
    for name, img in found:
        w, h = PHOTO_SIZE if img.width >= img.height else PHOTO_SIZE[::-1]
        scale = max(w / img.width, h / img.height)
        cw, ch = w / scale, h / scale
        box = ((img.width - cw) / 2, (img.height - ch) / 2, (img.width + cw) / 2, (img.height + ch) / 2)
        out.append((name, img.resize((w, h), Image.BICUBIC, box=box)))
    return out


def jpeg(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=QUALITY)
    return buf.getvalue()


def write_layouts(root: str, n_files: int) -> dict:
    """n_files JPEGs (the photographs in turn, two classes) as root/train/<wnid>/*.JPEG and as
    root/data/train-00000-of-00001.parquet (image {bytes, path}, label), as in the HF hub's files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    shots = [(name, jpeg(img), img.size) for name, img in photos()]
    rows = []
    for i in range(n_files):
        name, data, _ = shots[i % len(shots)]
        wnid = f"n{1440764 + i % 2:08d}"
        os.makedirs(os.path.join(root, "train", wnid), exist_ok=True)
        path = os.path.join(root, "train", wnid, f"{wnid}_{i}.JPEG")
        with open(path, "wb") as f:
            f.write(data)
        rows.append(({"bytes": data, "path": os.path.basename(path)}, i % 2))
    os.makedirs(os.path.join(root, "data"), exist_ok=True)
    table = pa.table({"image": [r[0] for r in rows], "label": [r[1] for r in rows]})
    pq.write_table(table, os.path.join(root, "data", "train-00000-of-00001.parquet"))
    return dict(photos=[dict(name=n, size=list(sz), jpeg_kib=len(d) / 1024) for n, d, sz in shots],
                files=n_files)


def data_node(img_size: int | None):
    """The data node of experiment=deit3_in1k_author (data=imagenet with the experiment's values)."""
    node = OmegaConf.merge(OmegaConf.load(ROOT / "configs/data/imagenet.yaml"),
                           OmegaConf.load(ROOT / "configs/experiment/deit3_in1k_author.yaml").data)
    if img_size:
        node.img_size = img_size
    return node


def transform(path: str, node, multicrops: dict, mode: str):
    """The path's transform; mode: full (the reference: full-size decode), reduced (laplace.data.decode),
    device (DINO with device_augment: the worker decodes and crops)."""
    from laplace.data.vision import build_transform

    if path == "decode":
        return None
    if path == "dino":
        return multicrops[mode]
    cfg = OmegaConf.merge(node, {"augment": "three_augment" if path == "deit3" else node.augment,
                                 "device_augment": mode == "device", "reduced_decode": mode != "full"})
    return build_transform(cfg, train=path != "eval")


def run_path(ds, items: int, warmup: int) -> dict:
    """images/s of ds[(i, i)] over `items` samples after `warmup` (wall and CPU time)."""
    from train.feeds import SeededDataset

    seeded = SeededDataset(ds)
    n = len(ds)
    for i in range(warmup):
        seeded[(i % n, i)]
    t, c = time.perf_counter(), time.process_time()
    for i in range(items):
        seeded[(i % n, i)]
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    return dict(items=items, seconds=wall, images_per_s=items / wall, cpu_images_per_s=items / max(cpu, 1e-9))


def pixel_difference(ds_ref, ds_fast, node, items: int) -> dict:
    """Reduced against full-size decode on the same seeds: abs difference in 0-255 pixel units
    (the normalised tensors times std x 255), mean and max over every pixel of `items` samples."""
    from train.feeds import SeededDataset

    std = torch.tensor(list(node.std)).view(3, 1, 1) * 255
    diffs = []
    for i in range(items):
        a, b = SeededDataset(ds_ref)[(i % len(ds_ref), i)][0], SeededDataset(ds_fast)[(i % len(ds_fast), i)][0]
        diffs.append(((a - b).abs() * std).flatten())
    d = torch.cat(diffs)
    return dict(items=items, mean_abs=float(d.mean()), max_abs=float(d.max()),
                share_over_8=float((d > 8).float().mean()))


def run(args) -> dict:
    """The images section: every path x layout (x decode mode), in this process."""
    from laplace.data.imagenet import build_imagenet
    from laplace.data.multicrop import MultiCrop

    node = data_node(args.images_size)
    # trainer=dino's crops at DINO's 224 px (its node takes global_size from data.img_size)
    mc_node = OmegaConf.merge(OmegaConf.load(ROOT / "configs/trainer/dino.yaml").multicrop, {"global_size": 224})
    multicrop = MultiCrop.from_config(mc_node, node.mean, node.std)
    multicrops = dict(full=multicrop,
                      device=MultiCrop.from_config(OmegaConf.merge(mc_node, {"device_augment": True}), node.mean, node.std))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a data-loader worker's: torch sets 1 thread in each
    rows, diffs = [], []
    try:
        with tempfile.TemporaryDirectory(prefix="bench_images_") as root:
            out = write_layouts(root, args.images_files)
            for layout in ("folder", "parquet"):
                ds = build_imagenet(root, True, None, fmt=layout, cache_dir=os.path.join(root, "hf_cache"))
                for path in PATHS:
                    for mode in MODES[path]:
                        ds.transform = transform(path, node, multicrops, mode)
                        r = run_path(ds, args.images_items, args.images_warmup)
                        need, how = demand(path, node.img_size, multicrop)
                        r.update(path=path, layout=layout, decode=mode, gpu_images_per_s=need,
                                 demand_per_worker=need / WORKERS_PER_GPU, demand_basis=how)
                        r["supply_over_demand"] = r["images_per_s"] / r["demand_per_worker"]
                        rows.append(r)
                        print(f"[images] {layout:7s} {path:8s} {mode:7s} {r['images_per_s']:7.1f} img/s "
                              f"(demand {r['demand_per_worker']:.0f}/worker, x{r['supply_over_demand']:.2f})",
                              flush=True)
            for path in ("deit3", "timm_3a", "eval"):
                pair = [build_imagenet(root, True, transform(path, node, multicrops, m), fmt="folder")
                        for m in ("full", "reduced")]
                diffs.append(dict(path=path, **pixel_difference(*pair, node, args.images_diff_items)))
    finally:
        torch.set_num_threads(threads)
    return dict(out, img_size=node.img_size, eval_crop_pct=node.eval_crop_pct, threads=1,
                workers_per_gpu=WORKERS_PER_GPU, gpu_record=GPU_RECORD, rows=rows, pixel_difference=diffs)
