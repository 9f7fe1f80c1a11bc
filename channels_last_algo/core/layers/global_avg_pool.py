"""Global average pooling whose backward keeps NHWC.

``adaptive_avg_pool2d(x, 1)`` is ``x.mean((-2, -1))``, and the backward of that mean expands
the N x C x 1 x 1 gradient over H x W and divides it by H*W. The expanded gradient has stride 0
in H and W, so nothing tells the division which order to write: it writes NCHW. The layer
that produced ``x`` then gets an NCHW gradient next to its NHWC activation, and activations
whose backward follows the gradient's layout (``silu_backward``, ``hardswish_backward``,
``hardtanh_backward``, ConvNeXt's layer-scale ``mul``) turn NCHW, up to the last convolution.
Taking the mean over H and W of the (..., H, W, C) view instead makes the backward write
(..., H, W, C) in order, which is NHWC memory. The same ops serve any rank (an unbatched
C x H x W input too). An input that came channels first (a break before the layer) is pooled as
the original pools it, so its gradient keeps the input's layout: an NHWC gradient there would
meet the NCHW activations before it and add a break. That choice reads strides, so the function
is a ``torch.fx.wrap`` leaf; ``torch.jit.script``, ``torch.export`` and ONNX export see plain
tensor ops. The axes are
counted from the front (from ``x.dim()``): the TorchScript ONNX exporter writes a negative
``movedim`` axis into the ONNX ``Transpose`` as it is, which onnxruntime refuses.

Example:
    >>> import torch
    >>> x = torch.randn(2, 8, 5, 5).to(memory_format=torch.channels_last).requires_grad_()
    >>> global_avg_pool_nhwc(x).shape
    torch.Size([2, 8, 1, 1])
    >>> global_avg_pool_nhwc(x).sum().backward()
    >>> x.grad.is_contiguous(memory_format=torch.channels_last)
    True
"""

from __future__ import annotations

import torch
from torch import nn

from channels_last_algo.core.swap import Replacement

__all__ = ['ChannelsLastAdaptiveAvgPool2d', 'global_avg_pool_nhwc', 'is_global_pool']


def global_avg_pool_nhwc(x: torch.Tensor) -> torch.Tensor:
    """Mean over H and W of a (..., C, H, W) tensor, kept as (..., C, 1, 1), computed in NHWC order,
    or in NCHW order where ``x`` is channels first only."""
    # channels first only, from the sizes (TorchScript compiles it; vmap answers no channels-last query):
    # a contiguous map is channels-last contiguous too where C or H x W is 1
    if x.dim() == 4 and x.is_contiguous() and x.size(1) != 1 and x.size(2) * x.size(3) != 1:
        return x.mean(dim=(2, 3), keepdim=True)
    c = x.dim() - 3  # the channel axis
    return x.movedim(c, c + 2).mean(dim=(c, c + 1), keepdim=True).movedim(c + 2, c)


torch.fx.wrap('global_avg_pool_nhwc')


def is_global_pool(module: nn.AdaptiveAvgPool2d) -> bool:
    """True when ``module`` pools every map to 1 x 1 (``output_size`` 1 or (1, 1))."""
    size = module.output_size
    sizes = (size, size) if isinstance(size, int) else tuple(size)
    return sizes == (1, 1)


class ChannelsLastAdaptiveAvgPool2d(Replacement, nn.AdaptiveAvgPool2d):
    """``nn.AdaptiveAvgPool2d`` to 1 x 1 (the only setting the rule swaps) whose backward writes
    an NHWC gradient.

    Example:
        >>> pool = ChannelsLastAdaptiveAvgPool2d(1)
        >>> pool(torch.ones(2, 3, 4, 4)).flatten().tolist()
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return global_avg_pool_nhwc(input)
