"""The embedded synthetic ImageNet: learnable ImageNet-shaped images made on the fly, without files.

Example:
    >>> data = SyntheticImageNet(8, num_classes=4, image_size=32)
    >>> image, label = data[5]
    >>> image.size, label
    ((32, 32), 1)
"""

from __future__ import annotations

from typing import Any, Optional, Union

import numpy as np
import torch
import torch.utils.data
from PIL import Image

from channels_last_algo.app.data.batch import WritesBatches
from channels_last_algo.app.data.transforms import NHWCCrop, check_size

__all__ = ['SPLITS', 'SyntheticImageNet']

SPLITS = ('train', 'val')


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
