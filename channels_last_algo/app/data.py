"""The NHWC data path: uint8 HWC images -> one NHWC uint8 batch -> device -> normalise in NHWC.

A usual ImageNet loader turns every image into a float32 CHW tensor on the CPU (``ToTensor``,
``Normalize``), stacks them NCHW, copies four bytes per pixel to the device, and leaves the
first convolution to transpose the batch to NHWC. Here the samples stay ``uint8`` HWC arrays
(:class:`ToHWCUint8` ends the transforms), :func:`collate_nhwc` copies each one straight into
its slot of one channels-last ``uint8`` batch, and :class:`NormalizeBatch` turns that batch
into normalised floats on the device in a single pass, still NHWC.

Sources: :class:`CheckedImageFolder` (an ImageNet-style folder, checked, with a choice of what
to do with corrupt files) and :class:`SyntheticImageNet` (the embedded default: learnable
ImageNet-shaped images made on the fly). :func:`imagenet_dataset` picks one and its
transforms; :func:`build_loader` and :func:`build_data_spec` wrap it for a plain loop or for
Composer's Trainer.

Example:
    >>> import torch
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
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch
import torch.utils.data
from PIL import Image
from torchvision import transforms
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS

__all__ = [
    'CorruptImageError',
    'CorruptImageWarning',
    'CheckedImageFolder',
    'DataPathError',
    'IMAGENET_MEAN',
    'IMAGENET_STD',
    'NormalizeBatch',
    'SyntheticImageNet',
    'ToHWCUint8',
    'build_data_spec',
    'build_loader',
    'collate_nhwc',
    'default_resize_size',
    'eval_transform',
    'imagenet_dataset',
    'train_transform',
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGENET_SAMPLES = {'train': 1_281_167, 'val': 50_000}
SPLITS = ('train', 'val')
ON_CORRUPT = ('raise', 'skip')

PathLike = Union[str, os.PathLike]


class DataPathError(FileNotFoundError):
    """A data path that is missing, empty, or not laid out as ``ROOT/<class>/<image>``."""


class CorruptImageError(OSError):
    """An image file that cannot be decoded (with ``on_corrupt='raise'``)."""


class CorruptImageWarning(UserWarning):
    """An image file that cannot be decoded and was skipped (with ``on_corrupt='skip'``)."""


# --- transforms: PIL image -> uint8 HWC array ----------------------------------------------


class ToHWCUint8:
    """PIL image -> ``(H, W, 3)`` ``uint8`` numpy array: the NHWC path's stand-in for ``ToTensor``.

    No float conversion, no transpose: the bytes stay as decoded until the device normalises.

    Example:
        >>> ToHWCUint8()(Image.new('L', (5, 4))).shape
        (4, 5, 3)
    """

    def __call__(self, image: Image.Image) -> np.ndarray:
        return np.asarray(image if image.mode == 'RGB' else image.convert('RGB'))

    def __repr__(self) -> str:
        return f'{type(self).__name__}()'


def _check_size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'{name} must be a positive int of pixels, got {value!r}')
    return value


def default_resize_size(crop_size: int) -> int:
    """The eval resize for ``crop_size``, in the ratio 232/224 of torchvision's ResNet-50 recipe."""
    return round(crop_size * 232 / 224)


def train_transform(crop_size: int) -> transforms.Compose:
    """Training augmentation: ``RandomResizedCrop(crop_size)``, horizontal flip, uint8 HWC.

    Example:
        >>> train_transform(176)(Image.new('RGB', (300, 200))).shape
        (176, 176, 3)
    """
    _check_size('crop_size', crop_size)
    return transforms.Compose([
        transforms.RandomResizedCrop(crop_size),
        transforms.RandomHorizontalFlip(),
        ToHWCUint8(),
    ])


def eval_transform(crop_size: int, resize_size: Optional[int] = None) -> transforms.Compose:
    """Evaluation: resize the short side to ``resize_size`` (default :func:`default_resize_size`),
    centre crop ``crop_size``, uint8 HWC.

    Example:
        >>> eval_transform(224, resize_size=232)(Image.new('RGB', (300, 250))).shape
        (224, 224, 3)
    """
    _check_size('crop_size', crop_size)
    resize_size = default_resize_size(crop_size) if resize_size is None else _check_size('resize_size', resize_size)
    if resize_size < crop_size:
        raise ValueError(f'resize_size {resize_size} is smaller than crop_size {crop_size}; the centre crop would '
                         f'pad the image. Use resize_size >= crop_size (e.g. {default_resize_size(crop_size)}).')
    return transforms.Compose([
        transforms.Resize(resize_size),
        transforms.CenterCrop(crop_size),
        ToHWCUint8(),
    ])


# --- collate: uint8 HWC samples -> one NHWC uint8 batch -------------------------------------


def _empty_nhwc(n: int, c: int, h: int, w: int) -> torch.Tensor:
    """An uninitialised (n, c, h, w) uint8 tensor with channels-last strides; in shared memory
    inside a DataLoader worker, so that handing it to the main process copies nothing."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty((n, c, h, w), dtype=torch.uint8, memory_format=torch.channels_last)
    storage = torch.UntypedStorage._new_shared(n * c * h * w)
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(n, h, w, c).permute(0, 3, 1, 2)


def collate_nhwc(samples: Sequence[tuple[Any, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(image, label)`` samples with ``(H, W, C)`` uint8 images -> ``(images, labels)``:
    images ``(N, C, H, W)`` uint8 with channels-last strides, labels int64.

    Each image is copied once, straight into its slot of the batch; no NCHW tensor exists at
    any point. Images may be numpy arrays or CPU tensors.

    Example:
        >>> samples = [(np.full((4, 6, 3), i, dtype=np.uint8), i) for i in range(2)]
        >>> images, labels = collate_nhwc(samples)
        >>> images.shape, images.stride(), labels.tolist()
        (torch.Size([2, 3, 4, 6]), (72, 1, 18, 3), [0, 1])
    """
    if len(samples) == 0:
        raise ValueError('collate_nhwc got no samples; a batch needs at least one (image, label) pair')
    first = np.asarray(samples[0][0])
    if first.ndim != 3 or first.dtype != np.uint8:
        raise TypeError(f'collate_nhwc expects (H, W, C) uint8 images, got {first.dtype} of shape {first.shape} '
                        'in sample 0; end the transform with ToHWCUint8() instead of ToTensor()')
    height, width, channels = first.shape
    images = _empty_nhwc(len(samples), channels, height, width)
    slots = images.permute(0, 2, 3, 1).numpy()  # (N, H, W, C): the same bytes, in their order
    for index, (image, _) in enumerate(samples):
        image = np.asarray(image)
        if image.shape != first.shape or image.dtype != np.uint8:
            raise ValueError(f'sample {index} is {image.dtype} of shape {image.shape}, but sample 0 is uint8 of '
                             f'shape {first.shape}; a batch needs one size: crop every image to it in the transform')
        slots[index] = image
    labels = torch.tensor([label for _, label in samples], dtype=torch.int64)
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
            raise TypeError(f'NormalizeBatch expects a uint8 (N, {len(self.mean)}, H, W) image batch as made by '
                            f'collate_nhwc, got {images.dtype} of shape {tuple(images.shape)}')
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
        raise TypeError(f'NormalizeBatch expects an (images, labels) tuple or list, or an images tensor; '
                        f'got {type(batch).__name__}')

    def __repr__(self) -> str:
        return f'{type(self).__name__}(mean={self.mean}, std={self.std}, dtype={self.dtype})'


# --- sources ---------------------------------------------------------------------------------------


class SyntheticImageNet(torch.utils.data.Dataset):
    """ImageNet-shaped RGB images made on the fly: no files, deterministic, and learnable.

    Every class has its own base colour, stripe frequencies and per-channel stripe weights
    (drawn from ``seed``); every sample shifts the stripes by a random phase and adds uniform
    noise of up to ``noise`` grey levels (drawn from ``seed``, ``split`` and its index).
    Sample ``i`` has label ``i % num_classes``; the same arguments always give the same
    images. Like torchvision's folders it yields ``(transform(pil_image), label)``.

    Example:
        >>> data = SyntheticImageNet(8, num_classes=4, image_size=32)
        >>> image, label = data[5]
        >>> image.size, label
        ((32, 32), 1)
        >>> np.array_equal(np.asarray(image), np.asarray(SyntheticImageNet(8, num_classes=4, image_size=32)[5][0]))
        True
    """

    def __init__(
        self,
        num_samples: int,
        *,
        num_classes: int = 1000,
        image_size: Union[int, tuple[int, int]] = 256,
        split: str = 'train',
        seed: int = 0,
        transform: Optional[Any] = None,
        noise: int = 24,
    ) -> None:
        _check_size('num_samples', num_samples)
        _check_size('num_classes', num_classes)
        height, width = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        self.image_size = (_check_size('image_size', height), _check_size('image_size', width))
        if split not in SPLITS:
            raise ValueError(f'split must be one of {SPLITS}, got {split!r}')
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f'seed must be a non-negative int, got {seed!r}')
        self.num_samples = num_samples
        self.classes = [f'class_{index}' for index in range(num_classes)]
        self.split = split
        self.seed = seed
        self.transform = transform
        if isinstance(noise, bool) or not isinstance(noise, int) or not 0 <= noise <= 127:
            raise ValueError(f'noise must be an int from 0 to 127 (grey levels), got {noise!r}')
        self.noise = noise
        rng = np.random.default_rng(seed)
        self._colours = rng.uniform(48, 208, size=(num_classes, 3)).astype(np.float32)
        self._stripe_weights = rng.uniform(-40, 40, size=(num_classes, 3)).astype(np.float32)
        self._frequencies = rng.uniform(1, 6, size=(num_classes, 2))  # cycles per image: (rows, columns)

    def __len__(self) -> int:
        return self.num_samples

    def image(self, index: int) -> np.ndarray:
        """Sample ``index`` before the transform, as an ``(H, W, 3)`` uint8 array."""
        label = index % len(self.classes)
        rng = np.random.default_rng((self.seed, SPLITS.index(self.split), index))
        phase_rows, phase_columns = rng.uniform(0, 1, size=2)
        height, width = self.image_size
        weights = self._stripe_weights[label]
        rows = np.cos(2 * np.pi * (self._frequencies[label, 0] * np.arange(height) / height + phase_rows))
        columns = np.cos(2 * np.pi * (self._frequencies[label, 1] * np.arange(width) / width + phase_columns))
        # int16 sums of separable terms and uniform byte noise: a few ms for a 256 px image
        row_terms = (rows[:, None] * weights + self._colours[label] - self.noise).astype(np.int16)
        column_terms = (columns[:, None] * weights).astype(np.int16)
        pixels = row_terms[:, None, :] + column_terms[None, :, :]
        noise = np.frombuffer(rng.bytes(height * width * 3), dtype=np.uint8).reshape(height, width, 3)
        pixels += noise % np.uint8(2 * self.noise + 1)
        return np.clip(pixels, 0, 255, out=pixels).astype(np.uint8)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f'sample {index} is out of range for a synthetic set of {self.num_samples}')
        image = Image.fromarray(self.image(index))
        return (image if self.transform is None else self.transform(image)), index % len(self.classes)


class CheckedImageFolder(ImageFolder):
    """torchvision's ``ImageFolder`` (``root/<class>/<image>``) that checks its folder and says
    what is wrong, and handles a file that cannot be decoded as asked:

    - ``on_corrupt='raise'``: :class:`CorruptImageError` naming the file;
    - ``on_corrupt='skip'``: a :class:`CorruptImageWarning` naming the file, and the next
      decodable image takes its place (with its own label), so batches keep their size.

    A missing or empty root, a root without class folders, or a class folder without images
    raise :class:`DataPathError` naming the path (an empty class folder would shift the label
    of every class after it).

    Example::

        data = CheckedImageFolder('/data/imagenet/train', train_transform(224), on_corrupt='skip')
    """

    def __init__(self, root: PathLike, transform: Optional[Any] = None, *, on_corrupt: str = 'raise') -> None:
        if on_corrupt not in ON_CORRUPT:
            raise ValueError(f"on_corrupt must be 'raise' or 'skip', got {on_corrupt!r}")
        root = Path(root)
        _check_has_class_folders(root)
        super().__init__(str(root), transform=transform, allow_empty=True)
        self.on_corrupt = on_corrupt
        extensions = ' '.join(IMG_EXTENSIONS)
        if not self.samples:
            raise DataPathError(f'image folder {root} has class folders but no images in them (extensions: '
                                f'{extensions}); expected {root}/<class>/<image>')
        counts = np.bincount(self.targets, minlength=len(self.classes))
        empty = [name for name, count in zip(self.classes, counts) if count == 0]
        if empty:
            shown = ', '.join(str(root / name) for name in empty[:5]) + (' ...' if len(empty) > 5 else '')
            raise DataPathError(f'{len(empty)} class folder(s) under {root} hold no images (extensions: '
                                f'{extensions}): {shown}. Add images or remove the folders; an empty class '
                                'would shift the label of every class after it.')

    def __getitem__(self, index: int) -> tuple[Any, int]:
        for offset in range(len(self.samples)):
            path, label = self.samples[(index + offset) % len(self.samples)]
            try:
                image = self.loader(path)
            except (OSError, SyntaxError) as error:  # what PIL raises for unreadable or truncated files
                if self.on_corrupt == 'raise':
                    raise CorruptImageError(f'cannot decode image {path}: {error}. Replace or delete the file, '
                                            "or pass on_corrupt='skip' to skip corrupt files.") from error
                warnings.warn(f'skipping corrupt image {path}: {error}', CorruptImageWarning)
                continue
            return (image if self.transform is None else self.transform(image)), label
        raise CorruptImageError(f'no image under {self.root} can be decoded')


def _check_has_class_folders(root: Path) -> None:
    if not root.exists():
        raise DataPathError(f'image folder {root} does not exist')
    if not root.is_dir():
        raise DataPathError(f'image folder {root} is a file, not a folder of class folders')
    entries = list(os.scandir(root))
    if not any(entry.is_dir() for entry in entries):
        found = 'holds files but no class folders' if entries else 'is empty'
        raise DataPathError(f'image folder {root} {found}; expected {root}/<class>/<image>')


def _class_folder_names(root: Path) -> list[str]:
    return sorted(entry.name for entry in os.scandir(root) if entry.is_dir())


def imagenet_dataset(
    split: str,
    *,
    data_path: Optional[PathLike] = None,
    crop_size: int = 224,
    resize_size: Optional[int] = None,
    num_classes: Optional[int] = None,
    synthetic_samples: Optional[int] = None,
    synthetic_image_size: Optional[int] = None,
    seed: int = 0,
    on_corrupt: str = 'raise',
) -> torch.utils.data.Dataset:
    """The ``'train'`` or ``'val'`` split of ImageNet with the NHWC transforms
    (:func:`train_transform` or :func:`eval_transform`).

    With ``data_path``: a :class:`CheckedImageFolder` over ``data_path/split`` (the usual
    ``train/<wnid>/*.JPEG``, ``val/<wnid>/*.JPEG`` layout); when both split folders exist they
    must hold the same class folders, and ``num_classes``, if given, must match them.
    Without: a :class:`SyntheticImageNet` of ``num_classes`` (default 1000) classes and
    ``synthetic_samples`` images (default ImageNet's count for the split) of
    ``synthetic_image_size`` pixels (default ``crop_size * 256 / 224``, ImageNet's usual ratio).

    Example:
        >>> data = imagenet_dataset('val', crop_size=64, synthetic_samples=10, num_classes=5)
        >>> image, label = data[3]
        >>> image.shape, image.dtype, label
        ((64, 64, 3), dtype('uint8'), 3)
    """
    if split not in SPLITS:
        raise ValueError(f'split must be one of {SPLITS}, got {split!r}')
    transform = train_transform(crop_size) if split == 'train' else eval_transform(crop_size, resize_size)
    if data_path is None:
        return SyntheticImageNet(
            IMAGENET_SAMPLES[split] if synthetic_samples is None else synthetic_samples,
            num_classes=1000 if num_classes is None else num_classes,
            image_size=round(crop_size * 256 / 224) if synthetic_image_size is None else synthetic_image_size,
            split=split,
            seed=seed,
            transform=transform,
        )
    data_path = Path(data_path)
    if not data_path.is_dir():
        state = 'is a file, not a folder' if data_path.exists() else 'does not exist'
        raise DataPathError(f'ImageNet data path {data_path} {state}; pass the folder that holds train/ and val/ '
                            'class folders, or no path for the synthetic set')
    folder = data_path / split
    if not folder.is_dir():
        raise DataPathError(f'ImageNet data path {data_path} has no {split}/ folder; expected '
                            f'{data_path}/train/<class>/<image> and {data_path}/val/<class>/<image>')
    dataset = CheckedImageFolder(folder, transform, on_corrupt=on_corrupt)
    other = data_path / SPLITS[1 - SPLITS.index(split)]
    if other.is_dir():
        other_classes = _class_folder_names(other)
        if other_classes != dataset.classes:
            only_here = sorted(set(dataset.classes) - set(other_classes))[:5]
            only_there = sorted(set(other_classes) - set(dataset.classes))[:5]
            raise DataPathError(f'{folder} and {other} hold different class folders (only in {folder.name}/: '
                                f'{only_here}; only in {other.name}/: {only_there}), so the same label would '
                                'name different classes. Give both splits the same class folders.')
    if num_classes is not None and num_classes != len(dataset.classes):
        raise DataPathError(f'{folder} holds {len(dataset.classes)} class folders but num_classes is {num_classes}; '
                            'set num_classes to the folder count')
    return dataset


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

    Shuffles and drops the last partial batch when ``train`` (``drop_last`` overrides the
    latter). The sampler is a ``DistributedSampler`` (as Composer's ``dist.get_sampler``) that
    shards across ranks when the world size is above 1 and, at any world size, gives an order
    fixed by ``seed`` and the epoch, so a resumed run sees the batches an uninterrupted one
    would; Composer's Trainer calls ``set_epoch``, a plain loop calls
    ``loader.sampler.set_epoch(epoch)`` at the start of each epoch. ``pin_memory`` defaults to
    whether CUDA is available; ``persistent_workers`` applies only when ``workers > 0``.

    Example:
        >>> data = SyntheticImageNet(10, num_classes=2, image_size=8, transform=ToHWCUint8())
        >>> [images.shape[0] for images, _ in build_loader(data, batch_size=4, train=True)]
        [4, 4]
    """
    _check_size('batch_size', batch_size)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(f'workers must be a non-negative int, got {workers!r}')
    drop_last = train if drop_last is None else drop_last
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=_world_size(), rank=_global_rank(),
                                                  shuffle=train, drop_last=drop_last, seed=seed)
    if drop_last and len(sampler) < batch_size:
        raise ValueError(f'the data set gives {len(sampler)} samples per rank, fewer than batch_size {batch_size}, '
                         'and drop_last is on: no batch would be made. Lower batch_size or add samples.')
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        collate_fn=collate_nhwc,
        pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
        drop_last=drop_last,
        persistent_workers=persistent_workers and workers > 0,
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
        >>> data = imagenet_dataset('train', crop_size=32, synthetic_samples=64, num_classes=10)
        >>> spec = build_data_spec(data, batch_size=16, train=True, workers=2)
        >>> spec.microbatch_transforms
        NormalizeBatch(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), dtype=torch.float32)
    """
    from composer.core import DataSpec

    loader = build_loader(dataset, batch_size=batch_size, train=train, **loader_options)
    return DataSpec(loader, microbatch_transforms=NormalizeBatch() if normalize is None else normalize)
