"""ADE20K (SceneParse150) for semantic segmentation, its DINOv2 / mmseg pipelines, and a tiny
ADE20K-layout set built from the built-in digits.

The standard layout, as released (ADEChallengeData2016.zip):

    <root>/ADEChallengeData2016/images/{training,validation}/*.jpg
    <root>/ADEChallengeData2016/annotations/{training,validation}/*.png   (uint8: 0 = other, 1..150)

`data.root` may point at the folder holding ADEChallengeData2016/ or at it.

Pipelines (mmseg's ADE20K config, as DINOv2's linear evaluation uses it):
    train  short side to `scale` x U(0.5, 2.0) -> random crop `crop` (re-drawn up to 10 times
           while it holds fewer than 2 labelled classes or one covers 75% of it), padded with
           0 / 255 -> horizontal flip -> photometric distortion -> normalise
    eval   short side to `scale` (the image only: predictions are resized back to the full-size
           annotation, on which mIoU is computed)

    ds = ADE20K("/data/ade", "training", SegTrainTransform(crop=512, scale=512))
    img, label = ds[0]                      # float [3, 512, 512], int64 [512, 512] (255 = ignore)
    write_digits_ade20k("data/digits_ade20k")   # the tiny built-in set, 10 classes
"""
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from laplace.data import DatasetNotFoundError

IGNORE = 255  # the label of pixels left out of loss and metrics (mmseg's)
FOLDER = "ADEChallengeData2016"


def reduce_zero_label(mask: np.ndarray) -> np.ndarray:
    """ADE20K's annotation (0 = other, 1..K) -> labels 0..K-1 with 255 for "other"."""
    # mmseg's reduce-zero-label convention: "other" is not a class of the benchmark, so it is
    # ignored and the 150 classes become 0..149.
    label = mask.astype(np.int64) - 1
    label[mask == 0] = IGNORE
    return label


def find_root(root: str | os.PathLike) -> Path:
    """The ADEChallengeData2016 folder given it or its parent; a one-line error if absent."""
    root = Path(root).expanduser()
    for cand in (root / FOLDER, root):
        if (cand / "images").is_dir() and (cand / "annotations").is_dir():
            return cand
    raise DatasetNotFoundError(
        f"ADE20K not found: looked for {root / FOLDER}/{{images,annotations}}/{{training,validation}}; "
        f"unzip ADEChallengeData2016.zip (http://sceneparsing.csail.mit.edu) there, or set data.root")


class ADE20K(Dataset):
    """One split of an ADE20K-layout folder; items are transform(PIL RGB image, uint8 mask).

    Args:
        root: the folder holding ADEChallengeData2016/ (or that folder itself).
        split: "training" or "validation".
        transform: (image, mask) -> (image tensor, label tensor); labels reduced (see module).
    """

    def __init__(self, root, split: str, transform=None):
        base = find_root(root)
        images = sorted((base / "images" / split).glob("*.jpg"))
        if not images:
            raise DatasetNotFoundError(f"ADE20K {split} split is empty: no *.jpg in {base / 'images' / split}")
        # Every annotation is looked for now: a missing one stops the run at its start, in one
        # line, not hours later in a worker.
        self.items = [(img, base / "annotations" / split / f"{img.stem}.png") for img in images]
        for img, ann in self.items:
            if not ann.is_file():
                raise DatasetNotFoundError(f"ADE20K annotation missing: {ann} (for {img.name})")
        self.transform = transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        img_path, ann_path = self.items[i]
        with Image.open(img_path) as im:
            img = im.convert("RGB")
        # The annotation as its palette indices: a conversion (RGB, L) would change the class ids
        with Image.open(ann_path) as an:
            mask = np.array(an)  # the class indices as stored, never converted
        if self.transform is None:
            return img, torch.from_numpy(reduce_zero_label(mask))
        return self.transform(img, mask)


class SegTrainTransform:
    """mmseg's ADE20K training pipeline (module docstring), on torchvision's v2 transforms where
    they do the same thing. All draws come from torch's RNG, which the training feed seeds per sample.

    Args:
        crop: side of the square training crop.
        scale: base short side before the random ratio.
        ratio_range: the random scale ratio's range.
        cat_max_ratio: the largest share of the crop one class may cover.
        mean, std: normalisation constants.
    """

    def __init__(self, crop: int, scale: int, ratio_range=(0.5, 2.0), cat_max_ratio: float = 0.75,
                 mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)):
        self.crop, self.scale, self.ratio_range, self.cat_max_ratio = crop, scale, tuple(ratio_range), cat_max_ratio
        # After the crop: image and mask flipped together; colours, dtype and normalisation touch
        # the image only (v2 passes a Mask through them).
        self.after_crop = v2.Compose([
            v2.RandomHorizontalFlip(),
            # mmseg's PhotoMetricDistortion: brightness +-32/255, contrast and saturation 0.5-1.5,
            # hue +-18 degrees, each applied with probability 1/2.
            v2.RandomApply([v2.ColorJitter(brightness=32 / 255)], p=0.5),
            v2.RandomApply([v2.ColorJitter(contrast=(0.5, 1.5))], p=0.5),
            v2.RandomApply([v2.ColorJitter(saturation=(0.5, 1.5))], p=0.5),
            v2.RandomApply([v2.ColorJitter(hue=18 / 360)], p=0.5),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(list(mean), list(std))])

    def _crop_box(self, label: torch.Tensor) -> tuple[int, int]:
        H, W = label.shape

        def draw():
            return (int(torch.randint(0, max(H - self.crop, 0) + 1, ())),
                    int(torch.randint(0, max(W - self.crop, 0) + 1, ())))

        # mmseg's RandomCrop with cat_max_ratio (torchvision's RandomCrop has no such rule): 10
        # checks, each failed one re-draws, so the 11th box is taken unchecked (a crop of ignored
        # pixels only can stay: the loss is 0 on it).
        top, left = draw()
        if self.cat_max_ratio < 1:
            for _ in range(10):
                window = label[top:top + self.crop, left:left + self.crop]
                _, counts = torch.unique(window[window != IGNORE], return_counts=True)
                if len(counts) > 1 and counts.max() / counts.sum() < self.cat_max_ratio:
                    break
                top, left = draw()
        return top, left

    def __call__(self, img: Image.Image, mask: np.ndarray):
        img, label = tv_tensors.Image(TF.pil_to_tensor(img)), tv_tensors.Mask(reduce_zero_label(mask))
        lo, hi = self.ratio_range
        short = round(self.scale * float(torch.empty(()).uniform_(lo, hi)))
        img, label = v2.Resize(short)(img, label)  # the image bilinear (antialiased), the mask nearest
        top, left = self._crop_box(label)
        # mmseg crops, then pads images smaller than the crop at the bottom / right (hand-written:
        # torchvision's RandomCrop pads before it crops); the padding's labels are ignored.
        img = img[:, top:top + self.crop, left:left + self.crop]
        label = label[top:top + self.crop, left:left + self.crop]
        pad = (0, self.crop - img.shape[2], 0, self.crop - img.shape[1])
        img, label = F.pad(img, pad, value=0), F.pad(label, pad, value=IGNORE)
        return self.after_crop(tv_tensors.Image(img), tv_tensors.Mask(label))


class SegEvalTransform:
    """The image's short side to `scale`, normalised; the label kept at full resolution."""

    def __init__(self, scale: int, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)):
        # Resized as a tensor (antialiased bilinear), as in training: not by PIL.
        self.image = v2.Compose([v2.PILToTensor(), v2.Resize(scale), v2.ToDtype(torch.float32, scale=True),
                                 v2.Normalize(list(mean), list(std))])

    def __call__(self, img: Image.Image, mask: np.ndarray):
        return self.image(img), torch.from_numpy(reduce_zero_label(mask))


def write_digits_ade20k(root, n_train: int = 300, n_val: int = 60, canvas: int = 64, seed: int = 0) -> Path:
    """A tiny ADE20K-layout set from scikit-learn's digits (ships with the package): canvases
    of 2 x 2 cells, each holding a digit (upsampled 8 -> canvas / 2 px) or nothing; the mask
    is the digit's class + 1 on its pixels (intensity above half its maximum), 0 elsewhere.
    Training canvases use the digits of `Digits(train=True)`, validation ones the held-out
    digits, so a backbone trained on data=digits never saw the validation digits.

    Written once (a marker file says it is complete); returns the ADEChallengeData2016 folder.
    """
    from .digits import Digits

    base = Path(root) / FOLDER
    if (base / ".complete").exists():
        return base
    rng = np.random.default_rng(seed)
    cell = canvas // 2
    for split, n, train in (("training", n_train, True), ("validation", n_val, False)):
        (base / "images" / split).mkdir(parents=True, exist_ok=True)
        (base / "annotations" / split).mkdir(parents=True, exist_ok=True)
        digits = Digits(train)
        for i in range(n):
            img = np.zeros((canvas, canvas), np.float32)
            mask = np.zeros((canvas, canvas), np.uint8)
            for r, c in np.ndindex(2, 2):  # the cells row by row
                if rng.random() < 0.2:
                    continue  # an empty cell: background only
                j = int(rng.integers(len(digits)))
                d = np.asarray(Image.fromarray(digits.images[j]).resize((cell, cell), Image.BICUBIC), np.float32)
                img[r * cell:(r + 1) * cell, c * cell:(c + 1) * cell] = d
                fg = d > 0.5 * max(d.max(), 1.0)
                mask[r * cell:(r + 1) * cell, c * cell:(c + 1) * cell][fg] = digits.targets[j] + 1
            name = f"ADE_{split}_{i:08d}"
            Image.fromarray(img.clip(0, 255).astype(np.uint8)).convert("RGB").save(
                base / "images" / split / f"{name}.jpg", quality=95)
            Image.fromarray(mask).save(base / "annotations" / split / f"{name}.png")
    (base / ".complete").write_text("written by laplace.data.ade20k.write_digits_ade20k\n")
    return base
