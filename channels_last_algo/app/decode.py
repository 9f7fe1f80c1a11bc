"""Image files to uint8 pixels with the least decoding work: the header first, then a decode
scaled to what the crop will keep.

:class:`EncodedImage` holds a file's bytes and its parsed header, so a crop can be planned
from the image size before any pixel is decoded. :meth:`EncodedImage.decode` then decodes
the way measured fastest (``benchmarks/loader.py``, the decoder table in ``docs/data.md``):

- ``shrink`` 2, 4 or 8 (a JPEG whose crop keeps at most 1/2, 1/4, 1/8 of its resolution):
  Pillow's ``draft``, which lets libjpeg-turbo's inverse DCT produce the smaller image directly;
- a full-size JPEG: ``torchvision.io.decode_jpeg`` (libjpeg-turbo, straight into a tensor,
  no copy through Pillow's ``tobytes``), where torchvision still has it;
- anything else (PNG, BMP, ...) and any JPEG ``decode_jpeg`` refuses: Pillow with
  ``convert('RGB')``, as torchvision's ``ImageFolder`` loads it.

Pixels equal Pillow's: both decoders are libjpeg-turbo with the same settings (grayscale and
CMYK JPEGs included). A file Pillow cannot decode raises Pillow's own error, so a corrupt or
truncated file is reported exactly as ``ImageFolder`` reports it.

:class:`ArrayImage` gives an in-memory ``(H, W, 3)`` array the same interface (the synthetic
set, a PIL image), and :func:`as_image` takes any of the three.

Example:
    >>> import io
    >>> buffer = io.BytesIO()
    >>> Image.new('RGB', (640, 480), 'red').save(buffer, 'JPEG')
    >>> image = EncodedImage(buffer.getvalue())
    >>> image.size, image.max_shrink((480, 640), (200, 200))
    ((480, 640), 2)
    >>> tuple(image.decode(shrink=2).shape)
    (3, 240, 320)
"""

from __future__ import annotations

import io
import os
import warnings
from typing import Any, Optional, Union

import numpy as np
import torch
from PIL import Image

try:  # torchvision >= 0.29 deprecates its image decoders in favour of TorchCodec
    from torchvision.io import ImageReadMode, decode_jpeg
except ImportError:  # pragma: no cover - a torchvision that has removed them
    decode_jpeg = None

__all__ = ['ArrayImage', 'EncodedImage', 'as_image']

SHRINKS = (8, 4, 2, 1)  # the scales libjpeg-turbo decodes at through Pillow's draft
# start-of-frame markers (baseline, extended, progressive, lossless; Huffman and arithmetic)
_SOF_MARKERS = frozenset((0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF))
_STANDALONE_MARKERS = frozenset((0x01, *range(0xD0, 0xD9)))  # TEM, RSTn, SOI: no length field


def _jpeg_size(data: bytes) -> Optional[tuple[int, int]]:
    """``(height, width)`` from a JPEG's start-of-frame segment, walking the marker segments
    before it (a few microseconds, a tenth of Pillow's ``open``); None when ``data`` is not a
    JPEG this walk can read, which then goes to Pillow."""
    if data[:2] != b'\xff\xd8':
        return None
    position, end = 2, len(data) - 9
    while position < end:
        if data[position] != 0xFF:
            return None
        marker = data[position + 1]
        if marker == 0xFF:  # fill byte
            position += 1
        elif marker in _STANDALONE_MARKERS:
            position += 2
        elif marker in _SOF_MARKERS:
            height, width = (
                int.from_bytes(data[position + 5 : position + 7], 'big'),
                int.from_bytes(data[position + 7 : position + 9], 'big'),
            )
            return (height, width) if height and width else None  # height 0: defined later by a DNL segment
        else:
            position += 2 + int.from_bytes(data[position + 2 : position + 4], 'big')
    return None


def _hwc_to_chw(pixels: np.ndarray) -> torch.Tensor:
    """An ``(H, W, 3)`` uint8 array as a ``(3, H, W)`` tensor over the same memory."""
    return torch.from_numpy(pixels).permute(2, 0, 1)


def _largest_shrink(region: tuple[int, int], target: tuple[int, int]) -> int:
    """The largest of 8, 4, 2, 1 that keeps ``region`` (height, width) at least ``target`` in both sides."""
    return next(s for s in SHRINKS if region[0] // s >= target[0] and region[1] // s >= target[1] or s == 1)


class EncodedImage:
    """An image file's bytes with its header parsed (size, format, mode); nothing decoded yet.

    Example:
        >>> buffer = io.BytesIO()
        >>> Image.new('L', (30, 20)).save(buffer, 'PNG')
        >>> EncodedImage(buffer.getvalue()).decode().shape
        torch.Size([3, 20, 30])
    """

    def __init__(self, data: bytes) -> None:
        self.data = data
        size = _jpeg_size(data)
        self.is_jpeg = size is not None
        if size is None:  # Pillow reads the header only; it raises on a file it cannot identify
            with Image.open(io.BytesIO(data)) as header:
                size = header.size[::-1]
                self.is_jpeg = header.format == 'JPEG'
        self.size = size

    @classmethod
    def read(cls, path: Union[str, os.PathLike]) -> EncodedImage:
        """The file at ``path``, read in one call."""
        with open(path, 'rb') as file:
            return cls(file.read())

    def max_shrink(self, region: tuple[int, int], target: tuple[int, int]) -> int:
        """The largest decode scale divisor (8, 4, 2 or 1) at which a ``region`` (height, width)
        of this image still has at least ``target`` pixels a side: a JPEG is decoded that much
        smaller at no loss to a crop of ``region`` resized down to ``target``; other formats 1."""
        return _largest_shrink(region, target) if self.is_jpeg else 1

    def decode(self, shrink: int = 1) -> torch.Tensor:
        """The pixels, ``(3, ceil(H / shrink), ceil(W / shrink))`` uint8 over HWC memory."""
        if shrink not in SHRINKS:
            raise ValueError(f'shrink must be one of {SHRINKS}, got {shrink!r}')
        if shrink == 1 and self.is_jpeg and decode_jpeg is not None:
            with warnings.catch_warnings():
                warnings.simplefilter('ignore', DeprecationWarning)
                try:
                    return decode_jpeg(
                        torch.frombuffer(bytearray(self.data), dtype=torch.uint8), mode=ImageReadMode.RGB
                    )
                except RuntimeError:
                    pass  # Pillow decides: it decodes what it can and raises its own error otherwise
        image = Image.open(io.BytesIO(self.data))
        if shrink > 1:
            width, height = image.size
            image.draft('RGB', (width // shrink, height // shrink))
        return _hwc_to_chw(np.array(image if image.mode == 'RGB' else image.convert('RGB')))


class ArrayImage:
    """An ``(H, W, 3)`` uint8 array with :class:`EncodedImage`'s interface (never shrinks).

    Example:
        >>> ArrayImage(np.zeros((4, 6, 3), np.uint8)).decode().shape
        torch.Size([3, 4, 6])
    """

    def __init__(self, pixels: np.ndarray) -> None:
        if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.dtype != np.uint8:
            raise TypeError(f'expected an (H, W, 3) uint8 array, got {pixels.dtype} of shape {pixels.shape}')
        self.pixels = pixels if pixels.flags.writeable else pixels.copy()  # torch wraps writable memory only
        self.size = pixels.shape[:2]

    def max_shrink(self, region: tuple[int, int], target: tuple[int, int]) -> int:
        return 1

    def decode(self, shrink: int = 1) -> torch.Tensor:
        if shrink != 1:
            raise ValueError(f'an array image is decoded at full size only, got shrink={shrink}')
        return _hwc_to_chw(self.pixels)


def as_image(image: Any) -> Union[EncodedImage, ArrayImage]:
    """An :class:`EncodedImage` or :class:`ArrayImage` as it is; a PIL image or an ``(H, W, 3)``
    uint8 array as an :class:`ArrayImage` (PIL images converted to RGB first)."""
    if isinstance(image, (EncodedImage, ArrayImage)):
        return image
    if isinstance(image, Image.Image):
        return ArrayImage(np.asarray(image if image.mode == 'RGB' else image.convert('RGB')))
    if isinstance(image, np.ndarray):
        return ArrayImage(image)
    raise TypeError(f'expected an EncodedImage, a PIL image or an (H, W, 3) uint8 array, got {type(image).__name__}')
