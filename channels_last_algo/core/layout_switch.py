"""A converted model put in either layout, as auto mode times it and keeps it.

Channels last is the model as :func:`~channels_last_algo.core.convert.apply_channels_last` left it: NHWC
weights, its swapped layers (repairs and kernel safe paths) in. Channels first is the model as it was
before: NCHW weights, each swapped layer run as its original class, so it runs as ``mode='off'`` runs it.
Swaps serve channels last only, and some keep NHWC whatever their input (ShuffleNetV2's interleave returns
NHWC from an NCHW block; the CUDA average-pool safe path returns NHWC): a channels-first model that kept
them would run partly channels last, slower than NCHW, and timed as a tie against channels last. The
parameters, buffers and optimizer state are the same objects in either layout.

Example:
    >>> import torch
    >>> from channels_last_algo.core.convert import apply_channels_last
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.AdaptiveAvgPool2d(1))
    >>> _ = apply_channels_last(model)
    >>> switch = LayoutSwitch(model)
    >>> switch.put(False)
    >>> type(model[1]).__name__, model[0].weight.is_contiguous()
    ('AdaptiveAvgPool2d', True)
    >>> switch.put(True)
    >>> type(model[1]).__name__, model[0].weight.is_contiguous()
    ('ChannelsLastAdaptiveAvgPool2d', False)
"""

from __future__ import annotations

import torch

from channels_last_algo.core.convert import Optimizers, restride
from channels_last_algo.core.swap import Replacement, swap_back, swap_in, unswapped_class

__all__ = ['LayoutSwitch']


class LayoutSwitch:
    """Puts a converted ``model`` in either layout; the state of ``optimizers`` follows the weights.
    ``outside_ddp``: the caller made sure no DDP wraps the model (:func:`~channels_last_algo.core.convert.restride`).
    The swapped layers are those the model holds when the switch is made."""

    def __init__(self, model: torch.nn.Module, optimizers: Optimizers = None, outside_ddp: bool = False) -> None:
        self.model, self.optimizers, self.outside_ddp = model, optimizers, outside_ddp
        self._swapped = [(module, type(module)) for module in model.modules() if isinstance(module, Replacement)]

    def put(self, channels_last: bool) -> None:
        """The weights restrided, and the swapped layers swapped in or taken back, for ``channels_last``."""
        restride(self.model, channels_last, self.optimizers, outside_ddp=self.outside_ddp)
        self.swap(channels_last)

    def swap(self, swapped_in: bool) -> None:
        """The swapped layers as their replacements (``swapped_in``), or as their original classes."""
        for module, swapped in self._swapped:
            if swapped_in:
                swap_in(module, swapped)
            else:
                swap_back(module, unswapped_class(swapped))
