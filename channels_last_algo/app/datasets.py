"""The NHWC data path's sources: the embedded synthetic ImageNet and checked ImageNet folders.

:class:`SyntheticImageNet` makes learnable ImageNet-shaped images on the fly (no files).
:class:`CheckedImageFolder` is torchvision's ``ImageFolder`` that says what is wrong with a
folder (missing, empty, an empty class, a directory symlink that would count a folder twice or
loop forever) and does with a corrupt image what ``on_corrupt`` says, in training and
evaluation alike. :func:`imagenet_dataset` picks one with the NHWC transforms, and
:func:`scan_images` is the optional pre-flight check that decodes every image once.

Example:
    >>> data = imagenet_dataset('val', crop_size=64, synthetic_samples=10, num_classes=5)
    >>> image, label = data[3]
    >>> image.shape, image.dtype, label
    ((64, 64, 3), dtype('uint8'), 3)
"""

from __future__ import annotations

import concurrent.futures
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch
import torch.utils.data
from PIL import Image
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension

from channels_last_algo.app.batch import WritesBatches
from channels_last_algo.app.decode import EncodedImage
from channels_last_algo.app.transforms import NHWCCrop, check_size, eval_transform, train_transform

__all__ = [
    'CheckedImageFolder',
    'CorruptImageError',
    'CorruptImageWarning',
    'DataPathError',
    'SyntheticImageNet',
    'imagenet_dataset',
    'scan_images',
]

IMAGENET_SAMPLES = {'train': 1_281_167, 'val': 50_000}
SPLITS = ('train', 'val')
ON_CORRUPT = ('raise', 'skip')
SKIP_HINT = "or pass on_corrupt='skip' to skip corrupt files"

PathLike = Union[str, os.PathLike]


class DataPathError(FileNotFoundError):
    """A data path that is missing, empty, or not laid out as ``ROOT/<class>/<image>``."""


class CorruptImageError(OSError):
    """An image file that cannot be decoded (with ``on_corrupt='raise'``)."""


class CorruptImageWarning(UserWarning):
    """An image file that cannot be decoded and was skipped (with ``on_corrupt='skip'``)."""


def _link_in(*paths: str) -> Optional[Path]:
    """The innermost directory link on any of ``paths``, or None."""
    return next((p for path in paths for p in (Path(path), *Path(path).parents) if p.is_symlink()), None)


def _walk_once(top: str, seen: dict[tuple[int, int], str]) -> Iterator[tuple[str, list[str]]]:
    """``(folder, file names)`` under ``top``, following directory links, each real folder once:
    DataPathError naming the link when a folder is reached again (``seen`` spans the calls)."""
    for folder, _, files in os.walk(top, followlinks=True):
        info = os.stat(folder)
        first = seen.setdefault((info.st_dev, info.st_ino), folder)
        if first != folder:
            link = _link_in(folder, first)
            through = f' through the directory link {link} -> {os.readlink(link)}' if link else ''
            kind = 'a loop' if Path(folder).is_relative_to(first) else 'its images would be counted twice'
            raise DataPathError(
                f'{folder} is the folder {first} again{through} ({kind}, under another label); '
                'remove the link, or copy the files instead'
            )
        yield folder, files


class SyntheticImageNet(WritesBatches, torch.utils.data.Dataset):
    """ImageNet-shaped RGB images made on the fly: no files, deterministic, and learnable.

    Every class has its own base colour, stripe frequencies and per-channel stripe weights
    (drawn from ``seed``); every sample shifts the stripes by a random phase and adds uniform
    noise of up to ``noise`` grey levels (drawn from ``seed``, ``split`` and its index).
    Sample ``i`` has label ``i % num_classes``; the same arguments always give the same
    images. Like torchvision's folders it yields ``(transform(pil_image), label)``; an
    :class:`NHWCCrop` transform gets the pixel array instead, and fills whole batches in place
    (:class:`WritesBatches`).

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
        check_size('num_samples', num_samples)
        check_size('num_classes', num_classes)
        height, width = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        self.image_size = (check_size('image_size', height), check_size('image_size', width))
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

    def sample(self, index: int, out: Optional[np.ndarray] = None) -> tuple[Any, int]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f'sample {index} is out of range for a synthetic set of {self.num_samples}')
        label = index % len(self.classes)
        if isinstance(self.transform, NHWCCrop):
            return self.transform(self.image(index), out=out), label
        image = Image.fromarray(self.image(index))
        return (image if self.transform is None else self.transform(image)), label


class CheckedImageFolder(WritesBatches, ImageFolder):
    """torchvision's ``ImageFolder`` (``root/<class>/<image>``) that checks its folder and says
    what is wrong, and handles a file that cannot be decoded as asked:

    - ``on_corrupt='raise'``: :class:`CorruptImageError` naming the file and, last,
      ``corrupt_hint`` (how to skip such files: the recipe layer names its key);
    - ``on_corrupt='skip'``: a :class:`CorruptImageWarning` naming the file, and the next
      decodable image takes its place (with its own label), so batches keep their size.

    An :class:`NHWCCrop` transform reads each file's bytes and decodes only what its crop needs
    (:class:`EncodedImage`), and fills whole batches in place (:class:`WritesBatches`); any
    other transform gets the PIL image, as in ``ImageFolder``.

    A missing or empty root, a root without class folders, a class folder without images (it
    would shift the label of every class after it), or a directory link that loops or reaches
    a folder a second time (its images would be repeated under another label) raise
    :class:`DataPathError` naming the path.

    Example::

        data = CheckedImageFolder('/data/imagenet/train', train_transform(224), on_corrupt='skip')
    """

    def __init__(
        self,
        root: PathLike,
        transform: Optional[Any] = None,
        *,
        on_corrupt: str = 'raise',
        corrupt_hint: str = SKIP_HINT,
    ) -> None:
        if on_corrupt not in ON_CORRUPT:
            raise ValueError(f"on_corrupt must be 'raise' or 'skip', got {on_corrupt!r}")
        root = Path(root)
        _check_has_class_folders(root)
        super().__init__(str(root), transform=transform, allow_empty=True)
        self.on_corrupt = on_corrupt
        self.corrupt_hint = corrupt_hint
        extensions = ' '.join(IMG_EXTENSIONS)
        if not self.samples:
            raise DataPathError(
                f'image folder {root} has class folders but no images in them (extensions: '
                f'{extensions}); expected {root}/<class>/<image>'
            )
        counts = np.bincount(self.targets, minlength=len(self.classes))
        empty = [name for name, count in zip(self.classes, counts) if count == 0]
        if empty:
            shown = ', '.join(str(root / name) for name in empty[:5]) + (' ...' if len(empty) > 5 else '')
            raise DataPathError(
                f'{len(empty)} class folder(s) under {root} hold no images (extensions: '
                f'{extensions}): {shown}. Add images or remove the folders; an empty class '
                'would shift the label of every class after it.'
            )

    @staticmethod
    def make_dataset(
        directory: PathLike,
        class_to_idx: dict[str, int],
        extensions: Optional[tuple[str, ...]] = None,
        is_valid_file: Optional[Callable[[str], bool]] = None,
        allow_empty: bool = False,
    ) -> list[tuple[str, int]]:
        """torchvision's ``(path, class index)`` list in its order, each real folder walked once:
        a directory link that loops or reaches a folder twice raises :class:`DataPathError`."""
        del allow_empty  # empty classes are reported by __init__
        valid = is_valid_file or (lambda path: has_file_allowed_extension(path, extensions or IMG_EXTENSIONS))
        seen: dict[tuple[int, int], str] = {}
        samples = []
        for name in sorted(class_to_idx):
            for folder, files in sorted(_walk_once(os.path.join(directory, name), seen)):
                paths = (os.path.join(folder, file) for file in sorted(files))
                samples.extend((path, class_to_idx[name]) for path in paths if valid(path))
        return samples

    def sample(self, index: int, out: Optional[np.ndarray] = None) -> tuple[Any, int]:
        for offset in range(len(self.samples)):
            path, label = self.samples[(index + offset) % len(self.samples)]
            try:
                if isinstance(self.transform, NHWCCrop):  # decoding happens in the crop: inside the try
                    return self.transform(EncodedImage.read(path), out=out), label
                image = self.loader(path)
            except (OSError, SyntaxError) as error:  # what PIL raises for unreadable or truncated files
                if self.on_corrupt == 'raise':
                    raise CorruptImageError(
                        f'cannot decode image {path}: {error}. Replace or delete the file, {self.corrupt_hint}.'
                    ) from error
                warnings.warn(f'skipping corrupt image {path}: {error}', CorruptImageWarning, stacklevel=2)
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
    corrupt_hint: str = SKIP_HINT,
) -> torch.utils.data.Dataset:
    """The ``'train'`` or ``'val'`` split of ImageNet with the NHWC transforms
    (:func:`train_transform` or :func:`eval_transform`).

    With ``data_path``: a :class:`CheckedImageFolder` over ``data_path/split`` (the usual
    ``train/<wnid>/*.JPEG``, ``val/<wnid>/*.JPEG`` layout); when both split folders exist they
    must hold the same class folders, and ``num_classes``, if given, must match them;
    ``corrupt_hint`` ends the error of a corrupt image (say how to skip such files).
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
    data_path = Path(data_path)
    if not data_path.is_dir():
        state = 'is a file, not a folder' if data_path.exists() else 'does not exist'
        raise DataPathError(
            f'ImageNet data path {data_path} {state}; pass the folder that holds train/ and val/ '
            'class folders, or no path for the synthetic set'
        )
    folder = data_path / split
    if not folder.is_dir():
        raise DataPathError(
            f'ImageNet data path {data_path} has no {split}/ folder; expected '
            f'{data_path}/train/<class>/<image> and {data_path}/val/<class>/<image>'
        )
    dataset = CheckedImageFolder(folder, transform, on_corrupt=on_corrupt, corrupt_hint=corrupt_hint)
    other = data_path / SPLITS[1 - SPLITS.index(split)]
    if other.is_dir():
        other_classes = _class_folder_names(other)
        if other_classes != dataset.classes:
            only_here = sorted(set(dataset.classes) - set(other_classes))[:5]
            only_there = sorted(set(other_classes) - set(dataset.classes))[:5]
            raise DataPathError(
                f'{folder} and {other} hold different class folders (only in {folder.name}/: '
                f'{only_here}; only in {other.name}/: {only_there}), so the same label would '
                'name different classes. Give both splits the same class folders.'
            )
    if num_classes is not None and num_classes != len(dataset.classes):
        raise DataPathError(
            f'{folder} holds {len(dataset.classes)} class folders but num_classes is {num_classes}; '
            'set num_classes to the folder count'
        )
    return dataset


def _decode_problem(path: str) -> Optional[str]:
    """Why the image at ``path`` cannot be decoded, or None. A JPEG is decoded at 1/8 scale (all
    of its data is still read, so truncation shows), other formats in full."""
    try:
        with Image.open(path) as image:
            image.draft('RGB', (max(1, image.width // 8), max(1, image.height // 8)))
            image.load()
    except (OSError, SyntaxError, ValueError) as error:  # what PIL raises for unreadable or truncated files
        return str(error) or type(error).__name__
    return None


def scan_images(dataset: torch.utils.data.Dataset, workers: int = 0) -> list[tuple[str, str]]:
    """Decode every image file of ``dataset`` once (the pre-flight check) and return ``(path,
    problem)`` for each that cannot be decoded; ``[]`` for a set without files (the synthetic one).
    ``workers`` threads decode side by side (0: one).

    Example:
        >>> scan_images(imagenet_dataset('val', crop_size=32, synthetic_samples=2, num_classes=2))
        []
    """
    paths = [path for path, _ in getattr(dataset, 'samples', [])]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        problems = list(pool.map(_decode_problem, paths))
    return [(path, problem) for path, problem in zip(paths, problems) if problem is not None]
