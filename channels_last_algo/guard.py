"""The framework-neutral event layer that keeps a training run channels last.

:class:`LayoutGuard` holds the work of each event: convert the model once (``on_init``), put
every batch in NHWC (``on_batch``). The Composer algorithm drives it from Trainer events;
a plain PyTorch loop calls it directly.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU())
    >>> guard = LayoutGuard()
    >>> _ = guard.on_init(model)
    >>> images, labels = guard.on_batch((torch.randn(4, 3, 16, 16), torch.zeros(4)))
    >>> images.is_contiguous(memory_format=torch.channels_last)
    True
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, TypeVar, Union

import torch
from torch.utils._pytree import tree_map_only

from channels_last_algo.convert import ConversionSummary, apply_channels_last
from channels_last_algo.layout import to_channels_last

__all__ = ['LayoutGuard', 'batch_to_channels_last']

Batch = TypeVar('Batch')


def batch_to_channels_last(batch: Batch) -> Batch:
    """Every 4D/5D tensor in ``batch`` (a tensor, or tuples, lists, dicts and namedtuples of
    them) restrided to channels last; tensors that already are, and all other values, are
    passed through untouched, without a copy.

    Example:
        >>> x = torch.randn(2, 3, 8, 8)
        >>> out = batch_to_channels_last({'image': x, 'label': torch.tensor([0, 1])})
        >>> out['image'].stride()
        (192, 1, 24, 3)
    """
    return tree_map_only(torch.Tensor, to_channels_last, batch)


class LayoutGuard:
    """The events of a channels-last run, usable from any training loop.

    Call :meth:`on_init` once with the model before the optimizer takes state (or pass the
    optimizers), and :meth:`on_batch` on every batch before the forward pass, in training,
    evaluation and prediction alike.
    """

    def __init__(self) -> None:
        self.summary: Optional[ConversionSummary] = None

    def on_init(
        self,
        model: torch.nn.Module,
        optimizers: Optional[Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]] = None,
    ) -> ConversionSummary:
        """Restride the model (and any optimizer state it already has) to channels last."""
        self.summary = apply_channels_last(model, optimizers=optimizers)
        return self.summary

    def on_batch(self, batch: Any) -> Any:
        """The batch with its image tensors in NHWC; no copy when they already are."""
        return batch_to_channels_last(batch)
