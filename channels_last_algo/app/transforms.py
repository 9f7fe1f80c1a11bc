"""The NHWC data path's transforms: a PIL image in, a ``uint8`` HWC array out, as torchvision's recipes crop.

:class:`ToHWCUint8` ends the transforms where ``ToTensor`` would: no float conversion, no
transpose, so :func:`~channels_last_algo.app.data.collate_nhwc` can copy each sample straight
into its slot of an NHWC batch. :func:`train_transform` and :func:`eval_transform` are the
usual ImageNet augmentation and evaluation crops ending in it.

Example:
    >>> eval_transform(32)(Image.new('RGB', (50, 40))).shape
    (32, 32, 3)
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
from PIL import Image
from torchvision import transforms

__all__ = ['ToHWCUint8', 'check_size', 'default_resize_size', 'eval_transform', 'train_transform']


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


def check_size(name: str, value: Any) -> int:
    """``value`` if it is an int >= 1 (a size, a count); ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'{name} must be a positive int, got {value!r}')
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
    check_size('crop_size', crop_size)
    return transforms.Compose(
        [
            transforms.RandomResizedCrop(crop_size),
            transforms.RandomHorizontalFlip(),
            ToHWCUint8(),
        ]
    )


def eval_transform(crop_size: int, resize_size: Optional[int] = None) -> transforms.Compose:
    """Evaluation: resize the short side to ``resize_size`` (default :func:`default_resize_size`),
    centre crop ``crop_size``, uint8 HWC.

    Example:
        >>> eval_transform(224, resize_size=232)(Image.new('RGB', (300, 250))).shape
        (224, 224, 3)
    """
    check_size('crop_size', crop_size)
    resize_size = default_resize_size(crop_size) if resize_size is None else check_size('resize_size', resize_size)
    if resize_size < crop_size:
        raise ValueError(
            f'resize_size {resize_size} is smaller than crop_size {crop_size}; the centre crop would '
            f'pad the image. Use resize_size >= crop_size (e.g. {default_resize_size(crop_size)}).'
        )
    return transforms.Compose(
        [
            transforms.Resize(resize_size),
            transforms.CenterCrop(crop_size),
            ToHWCUint8(),
        ]
    )
