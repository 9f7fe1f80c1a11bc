"""ImageNet by split name: an ImageNet folder's ``train/`` or ``val/`` checked against the other, or the
synthetic set, with the NHWC transforms.

Example:
    >>> data = imagenet_dataset('val', crop_size=64, synthetic_samples=10, num_classes=5)
    >>> image, label = data[3]
    >>> image.shape, image.dtype, label
    ((64, 64, 3), dtype('uint8'), 3)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch
import torch.utils.data

from channels_last_algo.app.data.image_folder import (
    SKIP_HINT,
    CheckedImageFolder,
    DataPathError,
    PathLike,
    check_same_classes,
    check_split_root,
    path_kind,
    printable,
)
from channels_last_algo.app.data.synthetic import SPLITS, SyntheticImageNet
from channels_last_algo.app.data.transforms import eval_transform, train_transform

__all__ = ['IMAGENET_SAMPLES', 'imagenet_dataset']

IMAGENET_SAMPLES = {'train': 1_281_167, 'val': 50_000}


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
    corrupt_hint: str = SKIP_HINT,
) -> torch.utils.data.Dataset:
    """The ``'train'`` or ``'val'`` split of ImageNet with the NHWC transforms
    (:func:`train_transform` or :func:`eval_transform`).

    With ``data_path``: a :class:`CheckedImageFolder` over ``data_path/split`` (the usual
    ``train/<wnid>/*.JPEG``, ``val/<wnid>/*.JPEG`` layout); when both split folders exist they
    must be different folders that hold the same class folders (checked before the images are
    listed), and ``num_classes``, if given, must match them; ``corrupt_hint`` ends the error of
    a corrupt image (say how to skip such files).
    Without: a :class:`SyntheticImageNet` of ``num_classes`` (default 1000) classes and
    ``synthetic_samples`` images (default ImageNet's count for the split) of
    ``synthetic_image_size`` pixels (default ``crop_size * 256 / 224``, ImageNet's usual ratio).
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
    folder = _split_folder(Path(data_path), split)
    dataset = CheckedImageFolder(folder, transform, on_corrupt=on_corrupt, corrupt_hint=corrupt_hint)
    return _checked_classes(dataset, folder, num_classes)


def _checked_classes(dataset: CheckedImageFolder, folder: Path, num_classes: Optional[int]) -> CheckedImageFolder:
    """``dataset`` of the split ``folder``, once its class folders are known to be ``num_classes`` (if given)."""
    if num_classes is not None and num_classes != len(dataset.classes):
        raise DataPathError(
            f'{printable(folder)} holds {len(dataset.classes)} class folders but num_classes is {num_classes}; '
            'set num_classes to the folder count'
        )
    return dataset


def _split_folder(data_path: Path, split: str) -> Path:
    """``data_path/split``, checked against the other split's folder before its images are listed."""
    kind = path_kind(data_path)
    if kind != 'folder':
        state = 'is a file, not a folder' if kind else 'does not exist'
        raise DataPathError(
            f'ImageNet data path {printable(data_path)} {state}; pass the folder that holds train/ and val/ '
            'class folders, or no path for the synthetic set'
        )
    folder, other = data_path / split, data_path / SPLITS[1 - SPLITS.index(split)]
    kind = path_kind(folder)
    if kind != 'folder':
        found = f': {split}/ is a file, not a folder' if kind else f' has no {split}/ folder'
        raise DataPathError(
            f'ImageNet data path {printable(data_path)}{found}; expected '
            f'{printable(data_path)}/train/<class>/<image> and {printable(data_path)}/val/<class>/<image>'
        )
    if path_kind(other) == 'folder':
        if os.path.samefile(folder, other):
            raise DataPathError(
                f'{printable(folder)} and {printable(other)} are the same folder (through a link), so the model '
                'would be evaluated on its training images; give val/ images of its own'
            )
        check_split_root(folder)
        check_same_classes(folder, other)
    return folder
