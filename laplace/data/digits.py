"""`data=digits`: scikit-learn's 1,797 real 8x8 handwritten digits, shipped inside the package.

The quick start's dataset: it needs no download, and a tiny ViT learns it on CPU in a minute.
Images are served as PIL RGB images (grey levels 0..16 stretched to 0..255) so the same
transforms as CIFAR / ImageNet upsample and normalise them.
"""
import numpy as np
from PIL import Image
from torch.utils.data import Dataset


class Digits(Dataset):
    """Train / val split of sklearn's digits: the last `val_fraction` of a fixed permutation is
    the validation set.

    Args:
        train: training (True) or validation split.
        transform: applied to the PIL image.
        val_fraction: share of the 1,797 images held out.
    """

    def __init__(self, train: bool = True, transform=None, val_fraction: float = 0.2):
        from sklearn.datasets import load_digits

        d = load_digits()
        images = (d.images * (255.0 / 16.0)).round().astype(np.uint8)  # [1797, 8, 8]
        # A fixed permutation: the split never depends on the run's seed.
        order = np.random.RandomState(0).permutation(len(images))
        n_val = int(round(len(images) * val_fraction))
        keep = order[:-n_val] if train else order[-n_val:]
        self.images, self.targets = images[keep], d.target[keep].astype(np.int64)
        self.transform = transform

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        # RGB, so that CIFAR's and ImageNet's transforms take it as they are.
        img = Image.fromarray(self.images[i], mode="L").convert("RGB")
        if self.transform is not None:
            img = self.transform(img)
        return img, int(self.targets[i])
