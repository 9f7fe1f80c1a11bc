"""A checked image folder: torchvision's ``ImageFolder`` that says what is wrong with a folder, and the
pre-flight scan of its images.

:class:`CheckedImageFolder` (``root/<class>/<image>``) names what is wrong with a folder (missing,
unreadable, empty, an empty class, images outside the class folders, a broken link, class names that
differ only in Unicode normalisation, a directory symlink that would count a folder twice or loop
forever) and does with a corrupt image what ``on_corrupt`` says, in training and evaluation alike.
:func:`check_same_classes` compares two split folders, :func:`scan_images` is the optional pre-flight
check that reads, plans and decodes every image once, as training will, and :func:`printable` shows a
path on one line, whatever its name.

Example:
    >>> print(printable('train/cat/1.jpg'), printable('train/cat/a\\nb.jpg'))
    train/cat/1.jpg 'train/cat/a\\nb.jpg'
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import stat
import unicodedata
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn, Optional, Union

import numpy as np
import torch
import torch.utils.data
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension

from channels_last_algo.app.data.batch import WritesBatches
from channels_last_algo.app.data.decode import EncodedImage, check_regular_file, pillow_errors
from channels_last_algo.app.data.transforms import NHWCCrop

__all__ = [
    'CheckedImageFolder',
    'CorruptImageError',
    'CorruptImageWarning',
    'DataPathError',
    'check_same_classes',
    'check_split_root',
    'path_kind',
    'printable',
    'scan_images',
]

ON_CORRUPT = ('raise', 'skip')
SKIP_HINT = "or pass on_corrupt='skip' to skip corrupt files"

PathLike = Union[str, os.PathLike]


class DataPathError(FileNotFoundError):
    """A data path that is missing, empty, or not laid out as ``ROOT/<class>/<image>``."""


class CorruptImageError(OSError):
    """An image file that cannot be decoded or is refused (with ``on_corrupt='raise'``): unreadable,
    not an image, truncated, corrupt data, over the size limits (see :mod:`~channels_last_algo.app.data.decode`)."""


class CorruptImageWarning(UserWarning):
    """An image file that cannot be decoded and was skipped (with ``on_corrupt='skip'``)."""


def printable(path: PathLike) -> str:
    """``path`` as text for a one-line message: as it is, or in ``ascii()`` escapes when it holds
    a line break, another control character or bytes that are not UTF-8.

    Example:
        >>> print(printable('train/cat/1.jpg'), printable('train/cat/a\\nb.jpg'))
        train/cat/1.jpg 'train/cat/a\\nb.jpg'
    """
    text = os.fspath(path)
    return text if text.isprintable() else ascii(text)


def _raise_unlistable(error: OSError) -> NoReturn:
    """DataPathError for a folder that cannot be listed (``os.walk``'s ``onerror``: not a silent gap)."""
    raise DataPathError(
        f'cannot list the folder {printable(error.filename)}: {error.strerror}; make it readable, or remove it'
    ) from error


def path_kind(path: Path) -> Optional[str]:
    """``'folder'``, ``'file'`` (anything else) or None (nothing there) for ``path``, following
    links; DataPathError when it cannot be looked at (a link loop, a parent folder without permission)."""
    try:
        return 'folder' if stat.S_ISDIR(os.stat(path).st_mode) else 'file'
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as error:
        raise DataPathError(
            f'cannot look at {printable(path)}: {error.strerror}; fix the path or its permissions'
        ) from error


def _entries(root: Path) -> list[os.DirEntry]:
    """What the split folder ``root`` holds; DataPathError when it cannot be listed or holds a link
    that leads nowhere (a class folder on a drive that is not mounted would be missing)."""
    try:
        entries = list(os.scandir(root))
    except OSError as error:
        _raise_unlistable(error)
    for entry in entries:
        if entry.is_symlink() and not os.path.exists(entry.path):
            raise DataPathError(
                f'{printable(entry.path)} is a link to {printable(os.readlink(entry.path))}, which does not exist '
                'or loops; the class folder it stands for would be missing. Fix its target, or remove the link'
            )
    return entries


def _normalisation_twins(names: list[str]) -> list[list[str]]:
    """The groups of two or more different ``names`` that are one name in Unicode NFC form."""
    groups: dict[str, list[str]] = {}
    for name in dict.fromkeys(names):
        groups.setdefault(unicodedata.normalize('NFC', name), []).append(name)
    return [group for group in groups.values() if len(group) > 1]


def _link_in(*paths: str) -> Optional[Path]:
    """The innermost directory link on any of ``paths``, or None."""
    return next((p for path in paths for p in (Path(path), *Path(path).parents) if p.is_symlink()), None)


def _walk_once(top: str, seen: dict[tuple[int, int], str]) -> Iterator[tuple[str, list[str]]]:
    """``(folder, file names)`` under ``top``, following directory links, each real folder once:
    DataPathError naming the link when a folder is reached again (``seen`` spans the calls)."""
    for folder, _, files in os.walk(top, followlinks=True, onerror=_raise_unlistable):
        info = os.stat(folder)
        first = seen.setdefault((info.st_dev, info.st_ino), folder)
        if first != folder:
            link = _link_in(folder, first)
            through = f' through the directory link {printable(link)} -> {printable(os.readlink(link))}' if link else ''
            kind = 'a loop' if Path(folder).is_relative_to(first) else 'its images would be counted twice'
            raise DataPathError(
                f'{printable(folder)} is the folder {printable(first)} again{through} ({kind}, under another '
                'label); remove the link, or copy the files instead'
            )
        yield folder, files


class CheckedImageFolder(WritesBatches, ImageFolder):
    """torchvision's ``ImageFolder`` (``root/<class>/<image>``) that checks its folder and says
    what is wrong, and handles a file that cannot be decoded as asked:

    - ``on_corrupt='raise'``: :class:`CorruptImageError` naming the file and, last,
      ``corrupt_hint`` (how to skip such files: the recipe layer names its key);
    - ``on_corrupt='skip'``: a :class:`CorruptImageWarning` naming the file, and the next
      decodable image takes its place (with its own label), so batches keep their size.

    An :class:`NHWCCrop` transform reads each file's bytes and decodes only what its crop needs
    (:class:`EncodedImage`: corrupt JPEG data, decompression bombs and files that are no image
    are refused), and fills whole batches in place (:class:`WritesBatches`); any other
    transform gets the PIL image, as in ``ImageFolder``.

    Raise :class:`DataPathError` naming the path: a missing, unreadable or empty root, a root
    without class folders or with image files outside them, a link there that leads nowhere,
    class folders whose names differ only in Unicode normalisation (two classes that print the
    same), a class folder without images (it would shift the label of every class after it),
    a folder that cannot be listed, or a directory link that loops or reaches a folder a
    second time (its images would be repeated under another label). Files without an image
    extension are ignored, as ``ImageFolder`` ignores them.

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
        check_split_root(root)
        super().__init__(str(root), transform=transform, allow_empty=True)
        self.on_corrupt = on_corrupt
        self.corrupt_hint = corrupt_hint
        extensions = ' '.join(IMG_EXTENSIONS)
        if not self.samples:
            raise DataPathError(
                f'image folder {printable(root)} has class folders but no images in them (extensions: '
                f'{extensions}); expected {printable(root)}/<class>/<image>'
            )
        counts = np.bincount(self.targets, minlength=len(self.classes))
        empty = [name for name, count in zip(self.classes, counts) if count == 0]
        if empty:
            shown = ', '.join(printable(root / name) for name in empty[:5]) + (' ...' if len(empty) > 5 else '')
            raise DataPathError(
                f'{len(empty)} class folder(s) under {printable(root)} hold no images (extensions: '
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
        a directory link that loops or reaches a folder twice, or a folder that cannot be listed,
        raises :class:`DataPathError`."""
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
                check_regular_file(path)
                with pillow_errors():
                    image = self.loader(path)
            except OSError as error:  # unreadable, not an image, truncated, corrupt, too large
                if self.on_corrupt == 'raise':
                    raise CorruptImageError(
                        f'cannot decode image {printable(path)}: {error}. Replace or delete the file, '
                        f'{self.corrupt_hint}.'
                    ) from error
                warnings.warn(f'skipping corrupt image {printable(path)}: {error}', CorruptImageWarning, stacklevel=2)
                continue
            return (image if self.transform is None else self.transform(image)), label
        raise CorruptImageError(
            f'no image under {printable(self.root)} can be decoded; replace the files the warnings name'
        )


def _class_folder_names(entries: list[os.DirEntry]) -> list[str]:
    return sorted(entry.name for entry in entries if entry.is_dir())


def check_split_root(root: Path) -> None:
    """DataPathError naming ``root`` unless it is a folder of class folders: missing, a file,
    unreadable, empty, without class folders, with images outside them, with a link that leads
    nowhere, or with class names that differ only in Unicode normalisation."""
    kind = path_kind(root)
    if kind != 'folder':
        state = 'is a file, not a folder of class folders' if kind else 'does not exist'
        raise DataPathError(f'image folder {printable(root)} {state}')
    entries = _entries(root)
    classes = _class_folder_names(entries)
    entries = [entry for entry in entries if not entry.is_dir()]
    if not classes:
        found = 'holds files but no class folders' if entries else 'is empty'
        raise DataPathError(f'image folder {printable(root)} {found}; expected {printable(root)}/<class>/<image>')
    loose = sorted(entry.name for entry in entries if has_file_allowed_extension(entry.name, IMG_EXTENSIONS))
    if loose:
        shown = ', '.join(printable(name) for name in loose[:3]) + (' ...' if len(loose) > 3 else '')
        raise DataPathError(
            f'image folder {printable(root)} holds {len(loose)} image file(s) outside its class folders '
            f'({shown}), which would not be trained on; move each into its class folder '
            f'({printable(root)}/<class>/<image>) or delete it'
        )
    twins = _normalisation_twins(classes)
    if twins:
        raise DataPathError(
            f'image folder {printable(root)} holds class folders whose names differ only in Unicode '
            f'normalisation: {", ".join(map(ascii, twins[0]))}; they print the same but would be different '
            'classes. Merge them into one folder'
        )


def check_same_classes(folder: Path, other: Path) -> None:
    """DataPathError unless the split folders ``folder`` and ``other`` hold the same class folders
    (names that differ only in Unicode normalisation are named as such, in ``ascii()`` escapes)."""
    here, there = _class_folder_names(_entries(folder)), _class_folder_names(_entries(other))
    if here == there:
        return
    only_here, only_there = sorted(set(here) - set(there)), sorted(set(there) - set(here))
    twins = _normalisation_twins(only_here + only_there)
    if twins:
        spelled = '; '.join(f'{ascii(name)} in {(folder if name in only_here else other).name}/' for name in twins[0])
        raise DataPathError(
            f'{printable(folder)} and {printable(other)} spell a class folder name in different Unicode '
            f'normalisations ({spelled}): they print the same but are different names, so the same label would '
            'name different classes. Rename one to the other spelling (NFC: unicodedata.normalize("NFC", name))'
        )
    raise DataPathError(
        f'{printable(folder)} and {printable(other)} hold different class folders (only in {folder.name}/: '
        f'{only_here[:5]}; only in {other.name}/: {only_there[:5]}), so the same label would '
        'name different classes. Give both splits the same class folders.'
    )


def _decode_problem(path: str, plan: Optional[Callable[[int, int], Any]]) -> Optional[str]:
    """Why the image at ``path`` cannot be trained on, or None: it is read, sized, its crop planned
    (``plan``, the transform's :meth:`NHWCCrop.checked_plan`, if any) and decoded as training does
    it, a JPEG at the smallest scale (all of its data is still read, so corrupt data and truncation
    show), other formats in full."""
    try:
        image = EncodedImage.read(path)
        if plan is not None:
            plan(*image.size)
        image.decode(image.max_shrink(image.size, (1, 1)))
    except OSError as error:  # unreadable, not an image, truncated, corrupt, too large
        return str(error) or type(error).__name__
    return None


def scan_images(dataset: torch.utils.data.Dataset, workers: int = 0) -> list[tuple[str, str]]:
    """Read, plan and decode every image file of ``dataset`` once, as training will (the pre-flight
    check), and return ``(path, problem)`` for each that would be refused; ``[]`` for a set without
    files (the synthetic one). ``workers`` threads decode side by side (0: one). The random crops'
    draws leave torch's random state as it was. Show a path with :func:`printable`.

    Example:
        >>> from channels_last_algo.app.data.imagenet import imagenet_dataset
        >>> scan_images(imagenet_dataset('val', crop_size=32, synthetic_samples=2, num_classes=2))
        []
    """
    paths = [path for path, _ in getattr(dataset, 'samples', [])]
    transform = getattr(dataset, 'transform', None)
    check = functools.partial(_decode_problem, plan=transform.checked_plan if isinstance(transform, NHWCCrop) else None)
    with torch.random.fork_rng(devices=[]), concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        problems = list(pool.map(check, paths))
    return [(path, problem) for path, problem in zip(paths, problems) if problem is not None]
