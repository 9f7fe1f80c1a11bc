"""torchvision's MobileNetV2 with its classifier's global pool computed in NHWC order.

``MobileNetV2`` pools with the functional ``adaptive_avg_pool2d`` inside its forward, so there
is no pooling module to swap; its last ``ReLU6`` (``hardtanh_backward``, which follows the
gradient's layout) then turns NCHW in backward. This subclass overrides only the forward, with
:func:`~channels_last_algo.core.layers.global_avg_pool.global_avg_pool_nhwc` in place of the pool.

Example:
    >>> import torch
    >>> from torchvision.models import mobilenet_v2
    >>> model = mobilenet_v2(weights=None, num_classes=10)
    >>> model.__class__ = ChannelsLastMobileNetV2
    >>> model(torch.randn(2, 3, 32, 32)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

import torch
from torchvision.models.mobilenetv2 import MobileNetV2

from channels_last_algo.core.layers.global_avg_pool import global_avg_pool_nhwc
from channels_last_algo.core.swap import Replacement

torch.fx.wrap('global_avg_pool_nhwc')  # reads strides: a leaf of fx traces here too

__all__ = ['ChannelsLastMobileNetV2']


class ChannelsLastMobileNetV2(Replacement, MobileNetV2):
    """``MobileNetV2`` whose global pool keeps the gradient NHWC; same parameters and outputs."""

    def _forward_impl(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = global_avg_pool_nhwc(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)
