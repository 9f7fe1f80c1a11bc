"""The batch side of the NHWC data path: collate into one NHWC ``uint8`` batch, the loaders, and the
normalisation on the device.

:func:`collate_nhwc` passes on the batch the crops filled in place (or builds it from ``uint8`` HWC
samples, e.g. torchvision transforms ending in :class:`~channels_last_algo.app.data.transforms.ToHWCUint8`),
and :class:`NormalizeBatch` turns it into normalised floats on the device in a single pass, still NHWC.
:func:`build_loader` and :func:`build_data_spec` wrap a data set for a plain loop or for Composer's Trainer.

Example:
    >>> import torch
    >>> from channels_last_algo.app.data.imagenet import imagenet_dataset
    >>> data = imagenet_dataset('train', crop_size=32, synthetic_samples=64, num_classes=10)
    >>> loader = build_loader(data, batch_size=16, train=True)
    >>> normalize = NormalizeBatch()
    >>> images, labels = normalize(next(iter(loader)))      # after images.to(device) on a GPU
    >>> images.shape, images.dtype, labels.dtype
    (torch.Size([16, 3, 32, 32]), torch.float32, torch.int64)
    >>> images.is_contiguous(memory_format=torch.channels_last)
    True

With Composer, ``Trainer(train_dataloader=build_data_spec(data, batch_size=256, train=True))``
runs the normalisation after the Trainer has moved each microbatch to the device.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import torch
import torch.utils.data

from channels_last_algo.app.data.batch import FilledBatch, empty_nhwc
from channels_last_algo.app.data.transforms import check_size

__all__ = ['IMAGENET_MEAN', 'IMAGENET_STD', 'NormalizeBatch', 'build_data_spec', 'build_loader', 'collate_nhwc']

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


# --- collate: uint8 HWC samples -> one NHWC uint8 batch -------------------------------------


def collate_nhwc(samples: Sequence[tuple[Any, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(image, label)`` samples with ``(H, W, C)`` uint8 images -> ``(images, labels)``:
    images ``(N, C, H, W)`` uint8 with channels-last strides, labels int64.

    Each image is copied once, straight into its slot of the batch; no NCHW tensor exists at
    any point. Images may be numpy arrays or CPU tensors. A :class:`FilledBatch` (what the
    data sets' ``__getitems__`` returns for an :class:`NHWCCrop` transform) is already that
    batch: its images are returned as they are, with no copy.

    Example:
        >>> samples = [(np.full((4, 6, 3), i, dtype=np.uint8), i) for i in range(2)]
        >>> images, labels = collate_nhwc(samples)
        >>> images.shape, images.stride(), labels.tolist()
        (torch.Size([2, 3, 4, 6]), (72, 1, 18, 3), [0, 1])
    """
    if len(samples) == 0:
        raise ValueError('collate_nhwc got no samples; a batch needs at least one (image, label) pair')
    labels = torch.tensor([label for _, label in samples], dtype=torch.int64)
    if isinstance(samples, FilledBatch):
        return samples.images, labels
    first = np.asarray(samples[0][0])
    if first.ndim != 3 or first.dtype != np.uint8:
        raise TypeError(
            f'collate_nhwc expects (H, W, C) uint8 images, got {first.dtype} of shape {first.shape} '
            'in sample 0; end the transform with ToHWCUint8() instead of ToTensor()'
        )
    height, width, channels = first.shape
    images = empty_nhwc(len(samples), channels, height, width)
    slots = images.permute(0, 2, 3, 1).numpy()  # (N, H, W, C): the same bytes, in their order
    for index, (image, _) in enumerate(samples):
        image = np.asarray(image)
        if image.shape != first.shape or image.dtype != np.uint8:
            raise ValueError(
                f'sample {index} is {image.dtype} of shape {image.shape}, but sample 0 is uint8 of '
                f'shape {first.shape}; a batch needs one size: crop every image to it in the transform'
            )
        slots[index] = image
    return images, labels


# --- normalisation on the device ---------------------------------------------------------------


class NormalizeBatch:
    """An NHWC uint8 image batch -> ``(x / 255 - mean) / std`` as ``dtype``, on the batch's own
    device, in one fused pass, keeping NHWC.

    Matches torchvision's ``ToTensor()`` + ``Normalize(mean, std)`` within 5e-7 in float32.
    Takes an ``(images, labels)`` tuple or list (the labels pass through) or the images tensor.
    Give it to Composer as ``DataSpec(microbatch_transforms=...)``, which runs after the
    Trainer's device transfer, or call it in a plain loop after ``images.to(device)``.

    Example:
        >>> normalize = NormalizeBatch(dtype=torch.bfloat16)
        >>> batch = torch.full((2, 3, 4, 4), 255, dtype=torch.uint8).to(memory_format=torch.channels_last)
        >>> out = normalize(batch)
        >>> out.dtype, out.is_contiguous(memory_format=torch.channels_last)
        (torch.bfloat16, True)
    """

    def __init__(
        self,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if len(mean) != len(std) or len(mean) == 0:
            raise ValueError(f'mean {tuple(mean)} and std {tuple(std)} need one value per channel, the same count')
        if any(s <= 0 for s in std):
            raise ValueError(f'std {tuple(std)} must be positive in every channel')
        if not dtype.is_floating_point:
            raise ValueError(f'dtype must be a floating-point dtype such as torch.float32, got {dtype}')
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self.dtype = dtype
        # (x / 255 - mean) / std == x * scale + shift, the constants rounded once from float64
        std64 = torch.tensor(self.std, dtype=torch.float64)
        self._scale = (1 / (255 * std64)).to(torch.float32).view(1, -1, 1, 1)
        self._shift = (-torch.tensor(self.mean, dtype=torch.float64) / std64).to(torch.float32).view(1, -1, 1, 1)
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """The normalised ``images`` (N, C, H, W), channels-last, on ``images.device``."""
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != len(self.mean):
            raise TypeError(
                f'NormalizeBatch expects a uint8 (N, {len(self.mean)}, H, W) image batch as made by '
                f'collate_nhwc, got {images.dtype} of shape {tuple(images.shape)}'
            )
        if images.device not in self._on_device:
            self._on_device[images.device] = (self._scale.to(images.device), self._shift.to(images.device))
        scale, shift = self._on_device[images.device]
        out = torch.empty(images.shape, dtype=self.dtype, device=images.device, memory_format=torch.channels_last)
        return torch.addcmul(shift, images, scale, out=out)

    def __call__(self, batch: Any) -> Any:
        if isinstance(batch, torch.Tensor):
            return self.normalize(batch)
        if type(batch) in (tuple, list) and len(batch) > 0 and isinstance(batch[0], torch.Tensor):
            return type(batch)([self.normalize(batch[0]), *batch[1:]])
        raise TypeError(
            f'NormalizeBatch expects an (images, labels) tuple or list, or an images tensor; got {type(batch).__name__}'
        )

    def __repr__(self) -> str:
        return f'{type(self).__name__}(mean={self.mean}, std={self.std}, dtype={self.dtype})'


# --- loaders -------------------------------------------------------------------------------------------


def _world_size() -> int:
    """The number of ranks: torch.distributed's when it is set up, else the launcher's ``WORLD_SIZE``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get('WORLD_SIZE', 1))


def _global_rank() -> int:
    """This process's rank: torch.distributed's when it is set up, else the launcher's ``RANK``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get('RANK', 0))


def _check_loader_sizes(batch_size: int, workers: int) -> None:
    """ValueError naming ``batch_size`` unless it is an int >= 1, or ``workers`` unless it is an int >= 0."""
    check_size('batch_size', batch_size)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(f'workers must be a non-negative int, got {workers!r}')


def _evaluation_generator(train: bool, seed: int) -> Optional[torch.Generator]:
    """The generator an evaluation loader draws its workers' base seed from, so that evaluating leaves the
    global random state (and a checkpoint written before it) as training left it; None for training."""
    return None if train else torch.Generator().manual_seed(seed)


def _rank_sampler(
    dataset: torch.utils.data.Dataset, batch_size: int, train: bool, drop_last: bool, seed: int
) -> torch.utils.data.DistributedSampler:
    """This rank's share of ``dataset``, shuffled when ``train`` in an order fixed by ``seed`` and the epoch;
    ValueError when ``drop_last`` would leave no batch of ``batch_size``."""
    sampler = torch.utils.data.DistributedSampler(
        dataset, num_replicas=_world_size(), rank=_global_rank(), shuffle=train, drop_last=drop_last, seed=seed
    )
    if drop_last and len(sampler) < batch_size:
        raise ValueError(
            f'the data set gives {len(sampler)} samples per rank, fewer than batch_size {batch_size}, '
            'and drop_last is on: no batch would be made. Lower batch_size or add samples.'
        )
    return sampler


def build_loader(
    dataset: torch.utils.data.Dataset,
    *,
    batch_size: int,
    train: bool,
    workers: int = 0,
    pin_memory: Optional[bool] = None,
    persistent_workers: bool = True,
    drop_last: Optional[bool] = None,
    seed: int = 0,
) -> torch.utils.data.DataLoader:
    """A ``DataLoader`` of NHWC uint8 batches (:func:`collate_nhwc`) over ``dataset``.

    Shuffles and drops the last partial batch when ``train`` (``drop_last`` overrides the latter). Each
    rank gets its share (a ``DistributedSampler``, as Composer's ``dist.get_sampler``) in an order fixed
    by ``seed`` and the epoch, so a resumed run sees the batches an uninterrupted one would; Composer's
    Trainer calls ``set_epoch``, a plain loop calls ``loader.sampler.set_epoch(epoch)`` at the start of
    each epoch. ``pin_memory`` defaults to whether CUDA is available; ``persistent_workers`` applies
    only when ``workers > 0``.

    Example:
        >>> data = [(np.zeros((8, 8, 3), dtype=np.uint8), 0)] * 10
        >>> [images.shape[0] for images, _ in build_loader(data, batch_size=4, train=True)]
        [4, 4]
    """
    _check_loader_sizes(batch_size, workers)
    drop_last = train if drop_last is None else drop_last
    sampler = _rank_sampler(dataset, batch_size, train, drop_last, seed)
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        collate_fn=collate_nhwc,
        pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
        drop_last=drop_last,
        persistent_workers=persistent_workers and workers > 0,
        generator=_evaluation_generator(train, seed),
    )


def build_data_spec(
    dataset: torch.utils.data.Dataset,
    *,
    batch_size: int,
    train: bool,
    normalize: Optional[NormalizeBatch] = None,
    **loader_options: Any,
) -> Any:
    """A Composer ``DataSpec``: :func:`build_loader` (``loader_options`` go to it) with
    ``normalize`` (default ImageNet mean/std to float32) as its ``microbatch_transforms``, which
    the Trainer runs on each microbatch after moving it to the device.

    Example:
        >>> from channels_last_algo.app.data.imagenet import imagenet_dataset
        >>> data = imagenet_dataset('train', crop_size=32, synthetic_samples=64, num_classes=10)
        >>> spec = build_data_spec(data, batch_size=16, train=True, workers=2)
        >>> spec.microbatch_transforms
        NormalizeBatch(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), dtype=torch.float32)
    """
    from composer.core import DataSpec

    loader = build_loader(dataset, batch_size=batch_size, train=train, **loader_options)
    return DataSpec(loader, microbatch_transforms=NormalizeBatch() if normalize is None else normalize)
