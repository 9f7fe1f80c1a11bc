"""A converted model put in either layout, as auto mode times it and keeps it.

Channels last is the model as :func:`~channels_last_algo.core.convert.apply_channels_last` left it: NHWC
weights and its repaired layers swapped in. Channels first is the model as it was before: NCHW weights and
each repaired layer run as its original class. A replacement keeps NHWC whatever its input (ShuffleNetV2's
interleave returns NHWC from NCHW blocks), so a channels-first model that kept it would run partly channels
last: slower than NCHW, and timed as a tie against channels last. Safe paths stay, since they act on NHWC
inputs only. The parameters, buffers and optimizer state are the same objects in either layout.

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
from channels_last_algo.core.layers import repaired_layers
from channels_last_algo.core.swap import swap_back, swap_in, unswapped_class

__all__ = ['LayoutSwitch']


class LayoutSwitch:
    """Puts a converted ``model`` in either layout; the state of ``optimizers`` follows the weights.
    ``outside_ddp``: the caller made sure no DDP wraps the model (:func:`~channels_last_algo.core.convert.restride`).
    The repaired layers are those the model holds when the switch is made."""

    def __init__(self, model: torch.nn.Module, optimizers: Optimizers = None, outside_ddp: bool = False) -> None:
        self.model, self.optimizers, self.outside_ddp = model, optimizers, outside_ddp
        self._repaired = [(module, type(module)) for module in repaired_layers(model)]

    def put(self, channels_last: bool) -> None:
        """The weights restrided, and the repaired layers swapped in or taken back, for ``channels_last``."""
        restride(self.model, channels_last, self.optimizers, outside_ddp=self.outside_ddp)
        self.swap_repairs(channels_last)

    def swap_repairs(self, swapped_in: bool) -> None:
        """The repaired layers as their replacements (``swapped_in``), or as their original classes."""
        for module, swapped in self._repaired:
            if swapped_in:
                swap_in(module, swapped)
            else:
                swap_back(module, unswapped_class(swapped))
