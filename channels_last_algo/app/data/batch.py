"""The NHWC uint8 batch: one channels-last allocation whose per-sample slots the crops write into.

:func:`empty_nhwc` allocates the batch (in shared memory inside a DataLoader worker, so that
handing it to the main process copies nothing). :class:`WritesBatches` gives a data set the
``__getitems__`` that a ``DataLoader`` calls with a whole batch of indices: when the data set's
transform is an :class:`~channels_last_algo.app.data.transforms.NHWCCrop`, each sample is cropped
straight into its slot and the result is a :class:`FilledBatch`, which
:func:`~channels_last_algo.app.data.loaders.collate_nhwc` returns as it is. Its samples are ordinary
``(HWC array, label)`` pairs, views of the batch, so any other collate function still works.

Example:
    >>> images = empty_nhwc(2, 3, 4, 4)
    >>> images.shape, images.is_contiguous(memory_format=torch.channels_last)
    (torch.Size([2, 3, 4, 4]), True)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import torch
import torch.utils.data

from channels_last_algo.app.data.transforms import NHWCCrop

__all__ = ['FilledBatch', 'WritesBatches', 'empty_nhwc']


def empty_nhwc(n: int, c: int, h: int, w: int) -> torch.Tensor:
    """An uninitialised (n, c, h, w) uint8 tensor with channels-last strides; in shared memory
    inside a DataLoader worker, so that handing it to the main process copies nothing."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty((n, c, h, w), dtype=torch.uint8, memory_format=torch.channels_last)
    storage = torch.UntypedStorage._new_shared(n * c * h * w)
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(n, h, w, c).permute(0, 3, 1, 2)


class FilledBatch(list):
    """``(image, label)`` samples whose images are ``slots``, the ``(H, W, C)`` views of
    ``images[0]``, ``images[1]``, ... of one NHWC uint8 batch, already written: a collate
    function can take ``images`` as it is."""

    def __init__(self, images: torch.Tensor, slots: np.ndarray, labels: Sequence[int]) -> None:
        super().__init__(zip(slots, labels))
        self.images = images


class WritesBatches(ABC):
    """Mixin for a map-style data set with ``transform`` and ``sample(index, out)``, where
    ``sample`` returns ``(image, label)`` and, given ``out``, writes the image into it.

    ``__getitems__`` (what a ``DataLoader`` calls for a batch) writes an :class:`NHWCCrop`'s
    crops into one :func:`empty_nhwc` batch and returns a :class:`FilledBatch`; with any other
    transform it returns ``[data[i] for i in indices]``, as a ``DataLoader`` would fetch them.
    """

    transform: Optional[Any]

    @abstractmethod
    def sample(self, index: int, out: Optional[np.ndarray] = None) -> tuple[Any, int]:
        """Sample ``index`` as ``(image, label)``; an :class:`NHWCCrop`'s image written into ``out`` when given."""

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return self.sample(index)

    def __getitems__(self, indices: Sequence[int]) -> list:
        if not isinstance(self.transform, NHWCCrop):
            return [self[index] for index in indices]
        size = self.transform.size
        images = empty_nhwc(len(indices), 3, size, size)
        slots = images.permute(0, 2, 3, 1).numpy()  # (N, H, W, C) views of the batch's memory
        labels = [self.sample(index, out=slot)[1] for index, slot in zip(indices, slots)]
        return FilledBatch(images, slots, labels)
