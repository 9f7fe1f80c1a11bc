"""Image files to uint8 pixels with the least decoding work: the header first, then a decode
scaled to what the crop will keep; a file whose data is corrupt is refused, never guessed at.

:class:`EncodedImage` holds a file's bytes and its parsed header, so a crop can be planned
from the image size before any pixel is decoded. :meth:`EncodedImage.decode` then decodes
the way measured fastest (``benchmarks/decode.py``, the table in ``docs/data.md``):

- a JPEG of grey or YCbCr components, at full size or at 1/2, 1/4, 1/8 scale (a crop that
  keeps at most that much of its resolution): ``simplejpeg`` (the ``jpeg`` extra),
  libjpeg-turbo straight into an array; scaled, its inverse DCT gives the smaller image
  directly, the pixels of Pillow's ``draft`` (the measured scaled decode), from a decoder
  that reports corrupt data;
- other full-size JPEGs (CMYK), and all of them without simplejpeg:
  ``torchvision.io.decode_jpeg`` where torchvision still has it (0.29 deprecates it);
- anything else (PNG, BMP, ...) and any JPEG those decoders do not take: Pillow with
  ``convert('RGB')``, as torchvision's ``ImageFolder`` loads it (``draft`` for a scaled JPEG).

Pixels equal Pillow's: every decoder is libjpeg-turbo with the same settings, and each is used
only for the colour spaces where its output equals Pillow's (simplejpeg's CMYK conversion
differs by a grey level, so CMYK goes to the next).

What is refused, as :class:`CorruptDataError` (an ``OSError``, as Pillow's own errors are):

- data a decoder reports corrupt: simplejpeg decodes strictly, and libjpeg's "Corrupt JPEG
  data" and "Premature end of JPEG file" reports stop the decode; Pillow and torchvision
  ignore them and return guessed pixels, so no decoder after the report is tried (Pillow's own
  error is raised instead when Pillow refuses the file too). A decoder that does not take a
  file (a colour transform, a JPEG process it lacks) hands it to the next one, as before;
- a header that declares more than :data:`MAX_IMAGE_PIXELS` pixels (a decompression bomb),
  before any pixel is decoded; pixels that do not have the size the header declares;
- a file that is empty, not a regular file (a pipe, a device) or over :data:`MAX_FILE_BYTES`.

:class:`ArrayImage` gives an in-memory ``(H, W, 3)`` array the same interface (the synthetic
set, a PIL image), and :func:`as_image` takes any of the three.

Example:
    >>> buffer = io.BytesIO()
    >>> Image.new('RGB', (640, 480), 'red').save(buffer, 'JPEG')
    >>> image = EncodedImage(buffer.getvalue())
    >>> image.size, image.max_shrink((480, 640), (200, 200))
    ((480, 640), 2)
    >>> tuple(image.decode(shrink=2).shape)
    (3, 240, 320)
    >>> EncodedImage(b'')
    Traceback (most recent call last):
    ...
    channels_last_algo.app.data.decode.CorruptDataError: the file is empty (0 bytes)
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import stat
import warnings
from collections.abc import Callable, Iterator
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

__all__ = [
    'FULL_SIZE_DECODERS',
    'MAX_FILE_BYTES',
    'MAX_IMAGE_PIXELS',
    'ArrayImage',
    'CorruptDataError',
    'EncodedImage',
    'as_image',
    'check_pixel_count',
    'check_regular_file',
    'pillow_errors',
    'rgb_pixels',
]

SHRINKS = (8, 4, 2, 1)  # the scales libjpeg-turbo decodes at (Pillow's draft, simplejpeg's scaling)
# Pillow refuses to open an image of more than twice its Image.MAX_IMAGE_PIXELS (89,478,485 by
# default, a quarter GiB of 3-byte pixels) as a possible decompression bomb: the same count here,
# fixed rather than read from Pillow, so that ImageFolder and this path refuse the same images
# and a JPEG (whose header Pillow never reads here) is refused too. One image of this size is
# 512 MiB as RGB, already more than a loader worker should hold; photographs are far smaller.
MAX_IMAGE_PIXELS = 2 * 89_478_485
# A file is read into memory whole: more than this is no training image (an uncompressed RGB
# image of MAX_IMAGE_PIXELS is 512 MiB) but a misplaced archive, disk image or video.
MAX_FILE_BYTES = 1 << 30
# start-of-frame markers (baseline, extended, progressive, lossless; Huffman and arithmetic)
_SOF_MARKERS = frozenset((0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF))
_STANDALONE_MARKERS = frozenset((0x01, *range(0xD0, 0xD9)))  # TEM, RSTn, SOI: no length field
# libjpeg's warnings about the data itself (jerror.h: JWRN_HIT_MARKER, JWRN_EXTRANEOUS_DATA,
# JWRN_HUFF_BAD_CODE, JWRN_MUST_RESYNC, JWRN_ARITH_BAD_CODE, JWRN_JPEG_EOF): the pixels decoded
# past them are guesses. Its other warnings (an unknown JFIF revision or Adobe transform) are not.
_LIBJPEG_CORRUPT_DATA = ('Corrupt JPEG data', 'Premature end of JPEG file')
# what Pillow raises for bytes it cannot decode besides OSError: SyntaxError, ValueError and
# EOFError from a malformed header in some plugins (a PPM's size, a GIF's), and its
# DecompressionBombError for an image over its size limit
_PILLOW_FAILURES = (SyntaxError, ValueError, EOFError, Image.DecompressionBombError)


class CorruptDataError(OSError):
    """Image bytes that do not give the pixels they claim (see the module docstring)."""


@contextlib.contextmanager
def pillow_errors() -> Iterator[None]:
    """Inside, Pillow's failures on a bad file are all ``OSError``: its own ``OSError`` as it is
    (the message ``ImageFolder`` gives), the others as :class:`CorruptDataError`.

    Example:
        >>> with pillow_errors():
        ...     raise SyntaxError('broken PNG file')
        Traceback (most recent call last):
        ...
        channels_last_algo.app.data.decode.CorruptDataError: broken PNG file
    """
    try:
        yield
    except _PILLOW_FAILURES as error:
        raise CorruptDataError(str(error) or type(error).__name__) from error


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


def _pillow_frame(data: bytes, file: Optional[BinaryIO]) -> tuple[int, int, int]:
    """``(height, width, components)`` from Pillow's header read (components 0 but for a JPEG);
    Pillow's error for a file it cannot identify, naming ``file`` when given."""
    if file is not None:
        file.seek(0)
    with pillow_errors(), Image.open(io.BytesIO(data) if file is None else file) as header:
        return (*header.size[::-1], len(header.getbands()) if header.format == 'JPEG' else 0)


def rgb_pixels(image: Image.Image) -> np.ndarray:
    """A PIL image of any mode as an ``(H, W, 3)`` uint8 array, converted as ``ImageFolder``'s
    loader converts it (``convert('RGB')``)."""
    return np.asarray(image if image.mode == 'RGB' else image.convert('RGB'))


def _hwc_to_chw(pixels: np.ndarray) -> torch.Tensor:
    """An ``(H, W, 3)`` uint8 array as a ``(3, H, W)`` tensor over the same memory (over a copy
    when the array is read-only: torch wraps writable memory only)."""
    return torch.from_numpy(pixels if pixels.flags.writeable else pixels.copy()).permute(2, 0, 1)


def _decode_simplejpeg(data: bytes, shrink: int = 1, size: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """Strictly, at 1/``shrink`` scale of an image of ``size`` (height, width): libjpeg-turbo's
    DCT scaling, which is Pillow's ``draft``; CorruptDataError for libjpeg's corrupt-data reports."""
    scale = dict(min_factor=shrink, min_height=-(-size[0] // shrink), min_width=-(-size[1] // shrink))
    try:
        pixels = simplejpeg.decode_jpeg(data, colorspace='RGB', **scale)
    except ValueError as error:
        if str(error).startswith(_LIBJPEG_CORRUPT_DATA):
            raise CorruptDataError(f'{error} (libjpeg-turbo, through simplejpeg)') from error
        raise
    return _hwc_to_chw(pixels)


def _decode_torchvision(data: bytes) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', DeprecationWarning)
        return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)


_SIMPLEJPEG_COMPONENTS = (1, 3)
# (name, decode(bytes) -> (3, H, W) uint8, the component counts it decodes exactly as Pillow),
# in the order tried (both beat Pillow in benchmarks/decode.py and tie with each other; the
# one that is not deprecated first); only those installed here
FULL_SIZE_DECODERS = tuple(
    entry
    for entry, installed in (
        (('simplejpeg', _decode_simplejpeg, _SIMPLEJPEG_COMPONENTS), simplejpeg is not None),
        (('torchvision', _decode_torchvision, (1, 3, 4)), decode_jpeg is not None),
    )
    if installed
)


def _largest_shrink(region: tuple[int, int], target: tuple[int, int]) -> int:
    """The largest of 8, 4, 2, 1 that keeps ``region`` (height, width) at least ``target`` in both sides."""
    return next(s for s in SHRINKS if region[0] // s >= target[0] and region[1] // s >= target[1] or s == 1)


def check_pixel_count(height: int, width: int, what: str) -> None:
    """CorruptDataError when ``height`` x ``width`` is over :data:`MAX_IMAGE_PIXELS`; ``what``
    says whose size it is.

    Example:
        >>> check_pixel_count(100_000, 100_000, 'its header declares')  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        channels_last_algo.app.data.decode.CorruptDataError: its header declares 100000 x 100000 pixels ...
    """
    if height * width > MAX_IMAGE_PIXELS:
        raise CorruptDataError(
            f'{what} {width} x {height} pixels (width x height), more than MAX_IMAGE_PIXELS '
            f"({MAX_IMAGE_PIXELS:,} pixels, Pillow's decompression-bomb limit)"
        )


def check_regular_file(path: Union[str, os.PathLike]) -> None:
    """CorruptDataError unless ``path`` is a regular file of at most :data:`MAX_FILE_BYTES`: check
    it before opening it, which would wait forever on a pipe or read a device without end."""
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        kind = 'a folder' if stat.S_ISDIR(info.st_mode) else 'a pipe, socket or device'
        raise CorruptDataError(f'it is {kind}, not a regular file')
    if info.st_size > MAX_FILE_BYTES:
        raise CorruptDataError(f'the file has {info.st_size:,} bytes, more than MAX_FILE_BYTES ({MAX_FILE_BYTES:,})')


class EncodedImage:
    """An image file's bytes with its header parsed (size, format, mode); nothing decoded yet.
    CorruptDataError for an empty file or a size over :data:`MAX_IMAGE_PIXELS`; Pillow's error
    for a file it cannot identify.

    Example:
        >>> buffer = io.BytesIO()
        >>> Image.new('L', (30, 20)).save(buffer, 'PNG')
        >>> EncodedImage(buffer.getvalue()).decode().shape
        torch.Size([3, 20, 30])
    """

    def __init__(self, data: bytes, file: Optional[BinaryIO] = None) -> None:
        """``data``: the file's bytes; ``file``: the open file they came from, if any (Pillow
        names it in the error for a file it cannot identify, as ``ImageFolder``'s loader does)."""
        if not data:
            raise CorruptDataError('the file is empty (0 bytes)')
        self.data = data
        height, width, components = _jpeg_frame(data) or _pillow_frame(data, file)
        check_pixel_count(height, width, 'its header declares')
        self.size = (height, width)
        self.components = components  # of a JPEG (1 grey, 3 YCbCr or RGB, 4 CMYK or YCCK); 0 for other formats

    @classmethod
    def read(cls, path: Union[str, os.PathLike]) -> EncodedImage:
        """The regular file at ``path``, read in one call."""
        check_regular_file(path)
        with open(path, 'rb') as file:
            return cls(file.read(), file)

    def max_shrink(self, region: tuple[int, int], target: tuple[int, int]) -> int:
        """The largest decode scale divisor (8, 4, 2 or 1) at which a ``region`` (height, width)
        of this image still has at least ``target`` pixels a side: a JPEG is decoded that much
        smaller at no loss to a crop of ``region`` resized down to ``target``; other formats 1."""
        return _largest_shrink(region, target) if self.components else 1

    def decode(self, shrink: int = 1) -> torch.Tensor:
        """The pixels, ``(3, ceil(H / shrink), ceil(W / shrink))`` uint8 over HWC memory.
        ``shrink`` above 1: a JPEG at least ``shrink`` pixels a side. CorruptDataError for
        corrupt data (see the module docstring) or pixels of another size than the header's."""
        if shrink not in SHRINKS or (shrink > 1 and (not self.components or shrink > min(self.size))):
            raise ValueError(
                f'shrink must be one of {SHRINKS} and at most the shorter side for a JPEG, and 1 for other formats, '
                f'got {shrink!r}'
            )
        pixels = self._decode(shrink)
        decoded, expected = tuple(pixels.shape[1:]), tuple(-(-side // shrink) for side in self.size)
        if decoded != expected:
            raise CorruptDataError(
                f'its header declares {expected[1]} x {expected[0]} pixels at 1/{shrink} scale, but its data '
                f'decodes to {decoded[1]} x {decoded[0]}'
            )
        return pixels

    def _decode(self, shrink: int) -> torch.Tensor:
        for decode in self._fast_decoders(shrink):
            try:
                return decode()
            except CorruptDataError:
                self._decode_pillow(shrink)  # Pillow's own error where Pillow refuses the file too
                raise
            except (RuntimeError, ValueError):
                continue  # a decoder that does not take this file (a colour transform, a JPEG process): the next
        return self._decode_pillow(shrink)

    def _fast_decoders(self, shrink: int) -> list[Callable[[], torch.Tensor]]:
        """The fast decoders that take this file at this scale, in the order tried."""
        if shrink == 1:
            return [
                functools.partial(decode, self.data)
                for _, decode, taken in FULL_SIZE_DECODERS
                if self.components in taken
            ]
        if simplejpeg is not None and self.components in _SIMPLEJPEG_COMPONENTS:
            return [functools.partial(_decode_simplejpeg, self.data, shrink, self.size)]
        return []

    def _decode_pillow(self, shrink: int) -> torch.Tensor:
        with pillow_errors():
            image = Image.open(io.BytesIO(self.data))
            if shrink > 1:
                image.draft('RGB', (image.width // shrink, image.height // shrink))
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
