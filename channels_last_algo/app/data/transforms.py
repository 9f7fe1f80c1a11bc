"""The NHWC data path's transforms: an image in, its ImageNet-recipe crop out as ``uint8`` HWC,
decoded and resized with the least work, written straight into a batch slot when given one.

:class:`RandomResizedCropFlip` (training) and :class:`ResizeCenterCrop` (evaluation) do what
torchvision's ``RandomResizedCrop`` + ``RandomHorizontalFlip`` and ``Resize`` + ``CenterCrop``
do, in this order:

1. plan the crop from the image *size* alone (the header of a file): the same box and flip
   torchvision draws, from the same torch random calls (``RandomResizedCrop.get_params``);
   a plan whose resize would exceed ``MAX_IMAGE_PIXELS`` (an evaluation resize of an image
   hundreds of times longer than high) is refused before anything is decoded
   (:meth:`NHWCCrop.checked_plan`);
2. decode only as much resolution as the crop keeps (:meth:`EncodedImage.max_shrink`: a JPEG
   crop resized down by 2x or more is decoded at 1/2, 1/4 or 1/8 scale);
3. resize the crop on uint8 NHWC with torch's antialiased bilinear kernel (within one grey
   level of Pillow's, which torchvision uses on PIL images), straight into ``out``.

Each takes an :class:`EncodedImage` (a file's bytes), a PIL image or an ``(H, W, 3)`` uint8
array. :class:`ToHWCUint8` is the stand-in for ``ToTensor`` when composing torchvision's own
PIL transforms instead. The equivalence tests (``tests/app/test_transforms.py``) and
``docs/data.md`` state the tolerances.

Example:
    >>> eval_transform(32)(Image.new('RGB', (50, 40))).shape
    (32, 32, 3)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision import transforms

from channels_last_algo.app.data.decode import as_image, check_pixel_count, rgb_pixels

__all__ = [
    'CropPlan',
    'NHWCCrop',
    'RandomResizedCropFlip',
    'ResizeCenterCrop',
    'ToHWCUint8',
    'check_size',
    'default_resize_size',
    'eval_transform',
    'train_transform',
]


class ToHWCUint8:
    """PIL image -> ``(H, W, 3)`` ``uint8`` numpy array: the NHWC path's stand-in for ``ToTensor``.

    No float conversion, no transpose: the bytes stay as decoded until the device normalises.

    Example:
        >>> ToHWCUint8()(Image.new('L', (5, 4))).shape
        (4, 5, 3)
    """

    def __call__(self, image: Image.Image) -> np.ndarray:
        return rgb_pixels(image)

    def __repr__(self) -> str:
        return f'{type(self).__name__}()'


def check_size(name: str, value: Any) -> int:
    """``value`` if it is an int >= 1 (a size, a count); ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'{name} must be a positive int, got {value!r}')
    return value


def _check_range(name: str, value: Sequence[float], upper: Optional[float] = None) -> tuple[float, float]:
    """``(low, high)`` with ``0 < low <= high`` (and ``high <= upper``); ValueError naming ``name`` otherwise."""
    values = tuple(value)
    if len(values) != 2:
        raise ValueError(f'{name} must be (low, high), two numbers, got {values!r}')
    low, high = (float(v) for v in values)
    if not 0 < low <= high or (upper is not None and high > upper):
        bound = f' <= {upper}' if upper is not None else ''
        raise ValueError(f'{name} must be (low, high) with 0 < low <= high{bound}, got {tuple(value)!r}')
    return low, high


def default_resize_size(crop_size: int) -> int:
    """The eval resize for ``crop_size``, in the ratio 232/224 of torchvision's ResNet-50 recipe."""
    return round(crop_size * 232 / 224)


class CropPlan(NamedTuple):
    """Where a crop comes from: ``box`` (top, left, height, width) of the source, resized to
    ``resize`` (height, width), of which ``window`` (top, left, height, width) is kept,
    mirrored left to right when ``flip``."""

    box: tuple[int, int, int, int]
    resize: tuple[int, int]
    window: tuple[int, int, int, int]
    flip: bool


class NHWCCrop(ABC):
    """An image -> its crop as an ``(H, W, 3)`` uint8 array; subclasses say where the crop is
    (:meth:`plan`). ``out``, an ``(H, W, 3)`` uint8 array or tensor (a batch slot), receives the
    crop and is returned; without it a new array is."""

    def __init__(self, size: int) -> None:
        self.size = check_size('size', size)

    @abstractmethod
    def plan(self, height: int, width: int) -> CropPlan:
        """Where the crop of an image of ``height`` x ``width`` comes from (random crops draw here)."""

    def checked_plan(self, height: int, width: int) -> CropPlan:
        """:meth:`plan`, refused with CorruptDataError when the resize it asks for is over
        MAX_IMAGE_PIXELS (an image hundreds of times longer than high, whose short side an
        evaluation resize scales up), before any pixel is decoded or resized."""
        plan = self.plan(height, width)
        check_pixel_count(*plan.resize, f'its crop would resize its {width} x {height} pixels to')
        return plan

    def __call__(
        self, image: Any, out: Union[np.ndarray, torch.Tensor, None] = None
    ) -> Union[np.ndarray, torch.Tensor]:
        image = as_image(image)
        plan = self.checked_plan(*image.size)
        out, target = self._slot(out)
        region, (height, width) = _planned_region(image, plan)
        window_top, window_left, window_height, window_width = plan.window
        if plan.flip:  # the window of the mirrored image
            window_left = plan.resize[1] - window_left - window_width
        if (height, width) == plan.resize:
            resized = region
        elif plan.window == (0, 0, *plan.resize):
            torch.ops.aten._upsample_bilinear2d_aa.out(region, list(plan.resize), False, None, None, out=target)
            return out
        else:
            resized = F.interpolate(region, size=plan.resize, mode='bilinear', antialias=True, align_corners=False)
        target.copy_(resized[..., window_top : window_top + window_height, window_left : window_left + window_width])
        return out

    def _slot(self, out: Union[np.ndarray, torch.Tensor, None]) -> tuple[Union[np.ndarray, torch.Tensor], torch.Tensor]:
        """``out`` (a new array when None), checked to be an ``(H, W, 3)`` uint8 slot of this crop's size, and
        the ``(1, 3, H, W)`` channels-last view over its memory that the resize writes."""
        if out is None:
            out = np.empty((self.size, self.size, 3), dtype=np.uint8)
        slot = torch.as_tensor(out)
        if slot.shape != (self.size, self.size, 3) or slot.dtype != torch.uint8:
            raise ValueError(
                f'out must be a ({self.size}, {self.size}, 3) uint8 slot, got {slot.dtype} {tuple(slot.shape)}'
            )
        return out, slot.permute(2, 0, 1)[None]


def _planned_region(image: Any, plan: CropPlan) -> tuple[torch.Tensor, tuple[int, int]]:
    """The box of ``plan`` decoded at the least resolution the resize needs, as a dense ``(1, 3, h, w)`` NHWC block
    (mirrored when the plan flips), and its ``(h, w)``."""
    top, left, height, width = plan.box
    shrink = image.max_shrink((height, width), plan.resize)
    pixels = image.decode(shrink)
    if shrink > 1:  # the box on the decoded grid; the decoded sides are ceil(side / shrink)
        bottom, right = (
            min(round((top + height) / shrink), pixels.shape[1]),
            min(round((left + width) / shrink), pixels.shape[2]),
        )
        top, left = round(top / shrink), round(left / shrink)
        height, width = bottom - top, right - left
    # the crop copied to a dense NHWC block first, mirrored on the way when the plan flips:
    # torch's uint8 antialiased kernel is faster on a dense block than on a strided view by
    # more than the copy costs, and it is mirror-symmetric, so mirroring before the resize
    # gives the same pixels as after (benchmarks/decode.py, tests/app/test_transforms.py)
    region = pixels[None, :, top : top + height, left : left + width]
    region = region.flip(3) if plan.flip else region.contiguous(memory_format=torch.channels_last)
    return region, (height, width)


class RandomResizedCropFlip(NHWCCrop):
    """Training: torchvision's ``RandomResizedCrop(size, scale, ratio)`` then
    ``RandomHorizontalFlip(flip_probability)``, with their random draws in their order.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> RandomResizedCropFlip(64).plan(375, 500)
        CropPlan(box=(17, 80, 294, 343), resize=(64, 64), window=(0, 0, 64, 64), flip=True)
    """

    def __init__(
        self,
        size: int,
        scale: Sequence[float] = (0.08, 1.0),
        ratio: Sequence[float] = (3 / 4, 4 / 3),
        flip_probability: float = 0.5,
    ) -> None:
        super().__init__(size)
        self.scale = _check_range('scale', scale, upper=1.0)
        self.ratio = _check_range('ratio', ratio)
        if not 0 <= flip_probability <= 1:
            raise ValueError(f'flip_probability must be from 0 to 1, got {flip_probability!r}')
        self.flip_probability = flip_probability

    def plan(self, height: int, width: int) -> CropPlan:
        shape_only = torch.empty((0, height, width))  # get_params reads the size only
        box = transforms.RandomResizedCrop.get_params(shape_only, list(self.scale), list(self.ratio))
        flip = bool(torch.rand(1) < self.flip_probability)
        return CropPlan(tuple(box), (self.size, self.size), (0, 0, self.size, self.size), flip)

    def __repr__(self) -> str:
        options = f'scale={self.scale}, ratio={self.ratio}, flip_probability={self.flip_probability}'
        return f'{type(self).__name__}({self.size}, {options})'


class ResizeCenterCrop(NHWCCrop):
    """Evaluation: torchvision's ``Resize(resize_size)`` (short side, antialiased bilinear) then
    ``CenterCrop(size)``; ``resize_size`` defaults to :func:`default_resize_size`.

    Example:
        >>> ResizeCenterCrop(224, 232).plan(375, 500)
        CropPlan(box=(0, 0, 375, 500), resize=(232, 309), window=(4, 42, 224, 224), flip=False)
    """

    def __init__(self, size: int, resize_size: Optional[int] = None) -> None:
        super().__init__(size)
        self.resize_size = default_resize_size(size) if resize_size is None else check_size('resize_size', resize_size)
        if self.resize_size < size:
            raise ValueError(
                f'resize_size {self.resize_size} is smaller than crop_size {size}; the centre crop would '
                f'pad the image. Use resize_size >= crop_size (e.g. {default_resize_size(size)}).'
            )

    def plan(self, height: int, width: int) -> CropPlan:
        # torchvision's Resize([short]): the long side scaled and truncated; CenterCrop: offsets rounded
        if width <= height:
            resized = (int(self.resize_size * height / width), self.resize_size)
        else:
            resized = (self.resize_size, int(self.resize_size * width / height))
        top, left = (int(round((side - self.size) / 2.0)) for side in resized)
        return CropPlan((0, 0, height, width), resized, (top, left, self.size, self.size), False)

    def __repr__(self) -> str:
        return f'{type(self).__name__}({self.size}, resize_size={self.resize_size})'


def train_transform(crop_size: int) -> RandomResizedCropFlip:
    """Training augmentation: :class:`RandomResizedCropFlip` at ``crop_size``.

    Example:
        >>> train_transform(176)(Image.new('RGB', (300, 200))).shape
        (176, 176, 3)
    """
    return RandomResizedCropFlip(check_size('crop_size', crop_size))


def eval_transform(crop_size: int, resize_size: Optional[int] = None) -> ResizeCenterCrop:
    """Evaluation: :class:`ResizeCenterCrop` of ``crop_size`` after resizing the short side to
    ``resize_size`` (default :func:`default_resize_size`).

    Example:
        >>> eval_transform(224, resize_size=232)(Image.new('RGB', (300, 250))).shape
        (224, 224, 3)
    """
    return ResizeCenterCrop(check_size('crop_size', crop_size), resize_size)
