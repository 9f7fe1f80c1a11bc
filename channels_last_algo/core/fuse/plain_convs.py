"""Convolutions in other forms as the plain ``nn.Conv2d`` / ``nn.Conv3d`` the fusion patterns take:
subclasses that keep the base class's forward (a parametrized weight, torchvision's ``Conv3DSimple``,
transformers' ``EfficientNetDepthwiseConv2d``), ``padding='same'`` / ``'valid'``, and functional calls
on given tensors.

Example:
    >>> as_plain_conv2d(torch.nn.Conv2d(3, 8, 3, padding='same')).padding
    (1, 1)
    >>> integer_padding('same', (3, 5), 1, 1), integer_padding('valid', 3, 1, 2), integer_padding('same', 2, 1, 1)
    ((1, 2), (0, 0), None)
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import nn
from torch.nn.modules.utils import _ntuple

from channels_last_algo.core.fuse.conv import FusedConv2d

__all__ = ['as_plain_conv2d', 'integer_padding', 'keeps_conv_forward', 'plain_conv']

_CONVS = {2: nn.Conv2d, 3: nn.Conv3d}


def keeps_conv_forward(module: Any) -> bool:
    """Whether ``module`` is an ``nn.Conv2d`` or ``nn.Conv3d`` computing what its base class does (its
    forward not overridden), zero padded."""
    base = next((conv for conv in _CONVS.values() if isinstance(module, conv)), None)
    return (
        base is not None
        and type(module).forward is base.forward
        and type(module)._conv_forward is base._conv_forward
        and module.padding_mode == 'zeros'
    )


def integer_padding(
    padding: Any, kernel_size: Any, dilation: Any, stride: Any, dims: int = 2
) -> Optional[tuple[int, ...]]:
    """A convolution's ``padding`` as ``dims`` integers; None where it pads asymmetrically (``'same'``
    with an even extent) or is not a constant."""
    as_tuple = _ntuple(dims)
    kernel_size, dilation, stride = as_tuple(kernel_size), as_tuple(dilation), as_tuple(stride)
    if padding == 'valid':
        return (0,) * dims
    if padding == 'same':
        extents = [d * (k - 1) for d, k in zip(dilation, kernel_size)]
        if any(s != 1 for s in stride) or any(extent % 2 for extent in extents):
            return None
        return tuple(extent // 2 for extent in extents)
    padding = as_tuple(padding)
    return tuple(padding) if all(type(side) is int for side in padding) else None


def plain_conv(
    weight: torch.Tensor, bias: Optional[torch.Tensor], stride: Any, padding: Any, dilation: Any, groups: int
) -> Union[nn.Conv2d, nn.Conv3d]:
    """An ``nn.Conv2d`` (4D ``weight``) or ``nn.Conv3d`` (5D) holding ``weight`` and ``bias`` (not copied,
    not requiring grad) that computes ``F.conv2d`` / ``F.conv3d`` of them with these settings."""
    out_channels, group_channels, *kernel_size = weight.shape
    conv = _CONVS[len(kernel_size)](
        group_channels * groups,
        out_channels,
        tuple(kernel_size),
        stride,
        padding,
        dilation,
        groups,
        bias=bias is not None,
        device='meta',
    )
    conv.weight = nn.Parameter(weight.detach(), requires_grad=False)
    conv.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
    return conv


def as_plain_conv2d(module: Any) -> Optional[nn.Conv2d]:
    """``module`` as a convolution :class:`~.conv.FusedConv2d` takes: itself when it is one; a plain copy
    of a 2D convolution that keeps ``nn.Conv2d``'s forward (:func:`keeps_conv_forward`) or pads ``'same'``
    / ``'valid'``; None where the math may differ (an own forward, a padding mode other than zeros,
    asymmetric padding)."""
    if not isinstance(module, nn.Conv2d) or not keeps_conv_forward(module):
        return None
    if FusedConv2d.accepts(module):
        return module
    padding = integer_padding(module.padding, module.kernel_size, module.dilation, module.stride)
    if padding is None:
        return None
    return plain_conv(module.weight, module.bias, module.stride, padding, module.dilation, module.groups)
