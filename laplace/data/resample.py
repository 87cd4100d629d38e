"""PIL's bicubic resize of a crop, on a batch of crops of different images at once: the training
device's half of data.device_augment and trainer.multicrop.device_augment (windows: laplace.data.decode.window).

Written by hand because no library resizes a batch of *different* boxes of *different* images with
PIL's filter: torchvision's and kornia's resize take one size for the whole batch, and roi_align
samples bilinearly without PIL's widening of the filter. tests/test_resample.py compares with PIL.
"""
import contextlib

import torch

BICUBIC_SUPPORT = 2.0  # the bicubic filter is 0 beyond |x| = 2 (before widening)


def _bicubic(x: torch.Tensor) -> torch.Tensor:
    a, x = -0.5, x.abs()  # PIL's bicubic (torch's and OpenCV's use -0.75)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return torch.where(x < 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


def axis_weights(start: torch.Tensor, length: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                 n_in: int, n_out: int) -> torch.Tensor:
    """PIL's bicubic weights along one axis for a batch: [B, n_out, n_in] (libImaging/Resample.c
    `precompute_coeffs`: output pixel x is a weighted sum of the input pixels).

    Args:
        start, length: [B] the window's first pixel and its number of pixels on the image axis.
        lo, hi: [B] the box's ends in window coordinates (PIL's box).
        n_in: the (padded) image axis; n_out: the output's side.
    """
    # The filter's support and centres in double, as PIL's C (MPS has no float64).
    dtype = torch.float64 if start.device.type in ("cpu", "cuda") else torch.float32
    start, length, lo, hi = (v.to(dtype).view(-1, 1, 1) for v in (start, length, lo, hi))
    scale = (hi - lo) / n_out
    # Shrinking widens the filter by the scale factor (antialiasing); enlarging keeps it.
    filterscale = scale.clamp_min(1.0)
    support = BICUBIC_SUPPORT * filterscale
    center = lo + (torch.arange(n_out, device=start.device, dtype=dtype).view(1, -1, 1) + 0.5) * scale
    # PIL: xmin = max(int(center - support + 0.5), 0), xmax = min(int(center + support + 0.5), inSize)
    xmin = torch.floor(center - support + 0.5).clamp_min(0)
    xmax = torch.minimum(torch.floor(center + support + 0.5), length)
    x = torch.arange(n_in, device=start.device, dtype=dtype).view(1, 1, -1) - start  # window coordinates
    # Cut at the window's edges (the filter sees no pixel outside the crop's window: the padding
    # of a batch and the neighbours of the crop stay out), then normalised to sum 1 as PIL does.
    w = _bicubic((x - center + 0.5) / filterscale) * ((x >= xmin) & (x < xmax))
    return (w / w.sum(-1, keepdim=True)).float()


def resize_crops(images: torch.Tensor, windows: torch.Tensor, boxes: torch.Tensor, out: int) -> torch.Tensor:
    """One crop of each image, resized to out x out as PIL's bicubic `crop(window).resize(box=...)`.

    Args:
        images: [B, 3, H, W] float (0-255 integer values; padded images: the windows stay inside
            each image's own pixels).
        windows: [B, 4] the windows (x0, y0, x1, y1) and boxes: [B, 4] the boxes in window
            coordinates, as `window` gives them.
    Returns:
        [B, 3, out, out] float32 holding the 0-255 integer values PIL's uint8 result holds.
    """
    B, _, H, W = images.shape
    wx = axis_weights(windows[:, 0], windows[:, 2] - windows[:, 0], boxes[:, 0], boxes[:, 2], W, out)
    wy = axis_weights(windows[:, 1], windows[:, 3] - windows[:, 1], boxes[:, 1], boxes[:, 3], H, out)
    # Two batched matmuls, horizontal pass first, each rounded and clipped to 8 bits as PIL's 8-bit
    # path does. Where one pass runs the pixels are PIL's exactly; where two run, Pillow 13 runs the
    # vertical pass first for some sizes (measured; its C source reads horizontal first), so the
    # rounding between passes differs: a few percent of the pixels by 1 (tests/test_resample.py).
    with torch.autocast(images.device.type, enabled=False), _ieee_float32():
        h = torch.matmul(images, wx.transpose(1, 2).unsqueeze(1)).add_(0.5).floor_().clamp_(0, 255)
        return torch.matmul(wy.unsqueeze(1), h).add_(0.5).floor_().clamp_(0, 255)


@contextlib.contextmanager
def _ieee_float32():
    """Full float32 matmuls inside: TF32 (the training's "high" precision on CUDA, train.dist)
    keeps 10 bits of mantissa, too few to round sums of 0-255 values to the right integer."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)
