"""CIFAR augmentation and normalisation on whole batches, on whatever device the batch is on.

The paper's training augmentation (random 32×32 crop of the image zero-padded by 4 pixels, random horizontal flip)
and per-channel normalisation, vectorised over the batch: no per-sample Python loop, so on a GPU the loader only
moves uint8 tensors and the augmentation costs a few small kernels. The data module calls :func:`transform_batch`
from ``on_after_batch_transfer``; the throughput benchmark calls it from its plain PyTorch loop.

Both augmentations can be turned off on their own: ``padding=0`` (no crop) and ``flip=False`` (no flip, for data where
a mirror image is another class, such as digits or text). The output dtype is the caller's ``dtype``: the dtype the
model trains in (float64 under ``64-true``, float16/bfloat16 under ``16-true``/``bf16-true``, float32 otherwise).
Lightning's precision plugins convert floating-point batches before ``on_after_batch_transfer``, so a uint8 batch
that is normalised there must be given the model's dtype here.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

__all__ = ["CIFAR10_MEAN", "CIFAR10_STD", "normalize", "random_crop", "random_hflip", "transform_batch"]

# Per-channel statistics of the CIFAR-10 training set in [0, 1] units, as used by the official PyramidNet code
# ((125.3, 123.0, 113.9) / 255 and (63.0, 62.1, 66.7) / 255).
CIFAR10_MEAN: tuple[float, float, float] = (125.3 / 255, 123.0 / 255, 113.9 / 255)
CIFAR10_STD: tuple[float, float, float] = (63.0 / 255, 62.1 / 255, 66.7 / 255)


def random_crop(images: torch.Tensor, padding: int = 4, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random ``H×W`` crops of ``images`` (N, C, H, W) zero-padded by ``padding`` on every side, one offset per image.

    Equivalent to torchvision's ``RandomCrop(size, padding=padding)`` per image (zero fill, so black pixels for uint8
    input); done with one ``gather`` on the padded batch. ``generator`` must live on the images' device.
    """
    if padding <= 0:
        return images
    offsets = torch.randint(0, 2 * padding + 1, (2, images.shape[0]), device=images.device, generator=generator)
    return _crop(images, padding, offsets)


def _crop(images: torch.Tensor, padding: int, offsets: torch.Tensor, flip: torch.Tensor | None = None) -> torch.Tensor:
    """Crop at ``offsets`` (2, N) (rows, columns) of the zero-padded batch, mirrored where ``flip`` (N,) is true.

    A single ``gather`` over the flattened padded images: the flip only reverses the column indices, so cropping and
    flipping cost one pass and no intermediate batch.
    """
    n, c, h, w = images.shape
    padded = F.pad(images, (padding, padding, padding, padding))
    device = images.device
    cols = torch.arange(w, device=device)
    if flip is not None:
        cols = torch.where(flip[:, None], cols.flip(0), cols)  # (N, W)
    rows = offsets[0, :, None] + torch.arange(h, device=device)  # (N, H)
    cols = offsets[1, :, None] + cols  # (N, W)
    index = rows[:, :, None] * (w + 2 * padding) + cols[:, None, :]  # (N, H, W) into the flattened padded image
    return padded.flatten(2).gather(2, index.view(n, 1, h * w).expand(n, c, h * w)).view(n, c, h, w)


def random_hflip(images: torch.Tensor, p: float = 0.5, generator: torch.Generator | None = None) -> torch.Tensor:
    """Flip each image of ``images`` (N, C, H, W) left-right with probability ``p``."""
    flip = torch.rand(images.shape[0], device=images.device, generator=generator) < p
    return torch.where(flip[:, None, None, None], images.flip(3), images)


@lru_cache(maxsize=16)
def _stats(
    device: torch.device, dtype: torch.dtype, mean: tuple[float, ...], std: tuple[float, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    # Cached per device: building them every batch would copy from host memory and stall the CUDA stream.
    scale = torch.tensor([1.0 / (255.0 * s) for s in std], dtype=dtype, device=device).view(1, -1, 1, 1)
    shift = torch.tensor([m / s for m, s in zip(mean, std, strict=True)], dtype=dtype, device=device).view(1, -1, 1, 1)
    return scale, shift


def normalize(
    images: torch.Tensor,
    mean: tuple[float, ...] = CIFAR10_MEAN,
    std: tuple[float, ...] = CIFAR10_STD,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """uint8 images in [0, 255] → ``(x / 255 - mean) / std`` per channel, as a ``dtype`` tensor.

    Computed in float32 (float64 for ``dtype=torch.float64``) and then cast, so half-precision outputs are the
    float32 values rounded once.
    """
    if not dtype.is_floating_point:
        raise TypeError(f"normalised images need a floating-point dtype, got {dtype}")
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    scale, shift = _stats(images.device, compute, tuple(mean), tuple(std))
    # One new tensor, scaled and shifted in place (``copy=True``: never write into a float input).
    return images.to(compute, copy=True).mul_(scale).sub_(shift).to(dtype)


def transform_batch(
    images: torch.Tensor,
    train: bool,
    padding: int = 4,
    flip: bool = True,
    channels_last: bool = False,
    mean: tuple[float, ...] = CIFAR10_MEAN,
    std: tuple[float, ...] = CIFAR10_STD,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The recipe's whole input pipeline for a uint8 batch (N, 3, H, W): augment if ``train``, then normalise.

    Training augmentation: a random crop of the batch zero-padded by ``padding`` (none for 0) and, if ``flip``, a
    random horizontal flip of half the images; the two are independent switches. Evaluation batches (``train=False``)
    are only normalised. Returns ``dtype`` (the model's training dtype), in ``channels_last`` memory format if asked
    (the layout convolutions prefer under mixed precision on GPUs).
    """
    if images.dtype != torch.uint8:
        raise TypeError(f"expected a uint8 image batch, got {images.dtype}")
    if images.ndim != 4:
        raise ValueError(f"expected images of shape (N, C, H, W), got {tuple(images.shape)}")
    if train:
        if padding > 0:
            # Same random draws, in the same order, as random_crop then random_hflip, fused into one gather.
            device = images.device
            offsets = torch.randint(0, 2 * padding + 1, (2, images.shape[0]), device=device)
            flips = torch.rand(images.shape[0], device=device) < 0.5 if flip else None
            images = _crop(images, padding, offsets, flips)
        elif flip:
            images = random_hflip(images)
    if channels_last:
        # Reformat the uint8 batch (a quarter of the float bytes); the elementwise normalisation keeps the layout.
        images = images.contiguous(memory_format=torch.channels_last)
    out = normalize(images, mean, std, dtype)
    if channels_last:
        out = out.contiguous(memory_format=torch.channels_last)  # no-op unless the layout was ambiguous
    return out
