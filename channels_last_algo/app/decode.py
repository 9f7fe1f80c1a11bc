"""Image files to uint8 pixels with the least decoding work: the header first, then a decode
scaled to what the crop will keep.

:class:`EncodedImage` holds a file's bytes and its parsed header, so a crop can be planned
from the image size before any pixel is decoded. :meth:`EncodedImage.decode` then decodes
the way measured fastest (``benchmarks/decode.py``, the table in ``docs/data.md``):

- ``shrink`` 2, 4 or 8 (a JPEG whose crop keeps at most 1/2, 1/4, 1/8 of its resolution):
  Pillow's ``draft``, which lets libjpeg-turbo's inverse DCT produce the smaller image directly;
- a full-size JPEG: the first of :data:`FULL_SIZE_DECODERS` that is installed and takes its
  colour components: ``simplejpeg`` (the ``jpeg`` extra) for grey and YCbCr, then
  ``torchvision.io.decode_jpeg`` (where torchvision still has it), both libjpeg-turbo straight
  into an array, without Pillow's ``tobytes`` copy: 15% faster than Pillow, and within noise of
  each other; simplejpeg first because torchvision 0.29 deprecates its decoders;
- anything else (PNG, BMP, ...) and any JPEG those decoders refuse: Pillow with
  ``convert('RGB')``, as torchvision's ``ImageFolder`` loads it.

Pixels equal Pillow's: every decoder is libjpeg-turbo with the same settings, and each is used
only for the colour spaces where its output equals Pillow's (simplejpeg's CMYK conversion
differs by a grey level, so CMYK goes to the next). A file a fast decoder refuses goes to
Pillow, which decodes it or raises its own error, so a corrupt or truncated file is reported
exactly as ``ImageFolder`` reports it.

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
from typing import Any, BinaryIO, Optional, Union

import numpy as np
import torch
from PIL import Image

try:  # the optional ``jpeg`` extra
    import simplejpeg
except ImportError:
    simplejpeg = None
try:  # torchvision >= 0.29 deprecates its image decoders in favour of TorchCodec
    from torchvision.io import ImageReadMode, decode_jpeg
except ImportError:  # a torchvision that has removed them
    decode_jpeg = None

__all__ = ['FULL_SIZE_DECODERS', 'ArrayImage', 'EncodedImage', 'as_image', 'rgb_pixels']

SHRINKS = (8, 4, 2, 1)  # the scales libjpeg-turbo decodes at through Pillow's draft
# start-of-frame markers (baseline, extended, progressive, lossless; Huffman and arithmetic)
_SOF_MARKERS = frozenset((0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF))
_STANDALONE_MARKERS = frozenset((0x01, *range(0xD0, 0xD9)))  # TEM, RSTn, SOI: no length field


def _jpeg_frame(data: bytes) -> Optional[tuple[int, int, int]]:
    """``(height, width, components)`` from a JPEG's start-of-frame segment, walking the marker segments
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
            height = int.from_bytes(data[position + 5 : position + 7], 'big')
            width = int.from_bytes(data[position + 7 : position + 9], 'big')
            return (height, width, data[position + 9]) if height and width else None  # height 0: set by a DNL
        else:
            position += 2 + int.from_bytes(data[position + 2 : position + 4], 'big')
    return None


def rgb_pixels(image: Image.Image) -> np.ndarray:
    """A PIL image of any mode as an ``(H, W, 3)`` uint8 array, converted as ``ImageFolder``'s
    loader converts it (``convert('RGB')``)."""
    return np.asarray(image if image.mode == 'RGB' else image.convert('RGB'))


def _hwc_to_chw(pixels: np.ndarray) -> torch.Tensor:
    """An ``(H, W, 3)`` uint8 array as a ``(3, H, W)`` tensor over the same memory (over a copy
    when the array is read-only: torch wraps writable memory only)."""
    return torch.from_numpy(pixels if pixels.flags.writeable else pixels.copy()).permute(2, 0, 1)


def _decode_simplejpeg(data: bytes) -> torch.Tensor:
    return _hwc_to_chw(simplejpeg.decode_jpeg(data, colorspace='RGB'))


def _decode_torchvision(data: bytes) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', DeprecationWarning)
        return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)


# (name, decode(bytes) -> (3, H, W) uint8, the component counts it decodes exactly as Pillow),
# in the order tried (both beat Pillow in benchmarks/decode.py and tie with each other; the
# one that is not deprecated first); only those installed here
FULL_SIZE_DECODERS = tuple(
    entry
    for entry, installed in (
        (('simplejpeg', _decode_simplejpeg, (1, 3)), simplejpeg is not None),
        (('torchvision', _decode_torchvision, (1, 3, 4)), decode_jpeg is not None),
    )
    if installed
)


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

    def __init__(self, data: bytes, file: Optional[BinaryIO] = None) -> None:
        """``data``: the file's bytes; ``file``: the open file they came from, if any (Pillow
        names it in the error for a file it cannot identify, as ``ImageFolder``'s loader does)."""
        self.data = data
        frame = _jpeg_frame(data)
        if frame is None:  # Pillow reads the header only; it raises on a file it cannot identify
            if file is not None:
                file.seek(0)
            with Image.open(io.BytesIO(data) if file is None else file) as header:
                frame = (*header.size[::-1], len(header.getbands()) if header.format == 'JPEG' else 0)
        self.size = frame[:2]
        self.components = frame[2]  # of a JPEG (1 grey, 3 YCbCr or RGB, 4 CMYK or YCCK); 0 for other formats

    @classmethod
    def read(cls, path: Union[str, os.PathLike]) -> EncodedImage:
        """The file at ``path``, read in one call."""
        with open(path, 'rb') as file:
            return cls(file.read(), file)

    def max_shrink(self, region: tuple[int, int], target: tuple[int, int]) -> int:
        """The largest decode scale divisor (8, 4, 2 or 1) at which a ``region`` (height, width)
        of this image still has at least ``target`` pixels a side: a JPEG is decoded that much
        smaller at no loss to a crop of ``region`` resized down to ``target``; other formats 1."""
        return _largest_shrink(region, target) if self.components else 1

    def decode(self, shrink: int = 1) -> torch.Tensor:
        """The pixels, ``(3, ceil(H / shrink), ceil(W / shrink))`` uint8 over HWC memory."""
        if shrink not in SHRINKS or (shrink > 1 and not self.components):
            raise ValueError(f'shrink must be one of {SHRINKS} for a JPEG and 1 for other formats, got {shrink!r}')
        for _, decoder, components in FULL_SIZE_DECODERS if shrink == 1 else ():
            if self.components in components:
                try:
                    return decoder(self.data)
                except (RuntimeError, ValueError):
                    continue  # the next one, then Pillow: it decodes what it can and raises its own error otherwise
        image = Image.open(io.BytesIO(self.data))
        if shrink > 1:
            width, height = image.size
            image.draft('RGB', (width // shrink, height // shrink))
        return _hwc_to_chw(rgb_pixels(image))


class ArrayImage:
    """An ``(H, W, 3)`` uint8 array with :class:`EncodedImage`'s interface (never shrinks).

    Example:
        >>> ArrayImage(np.zeros((4, 6, 3), np.uint8)).decode().shape
        torch.Size([3, 4, 6])
    """

    def __init__(self, pixels: np.ndarray) -> None:
        if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.dtype != np.uint8:
            raise TypeError(f'expected an (H, W, 3) uint8 array, got {pixels.dtype} of shape {pixels.shape}')
        self.pixels = pixels
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
        return ArrayImage(rgb_pixels(image))
    if isinstance(image, np.ndarray):
        return ArrayImage(image)
    raise TypeError(f'expected an EncodedImage, a PIL image or an (H, W, 3) uint8 array, got {type(image).__name__}')
