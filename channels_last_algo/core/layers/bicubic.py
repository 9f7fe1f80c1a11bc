"""Bicubic upsampling as two matrix products over the (N, H, W, C) view.

``upsample_bicubic2d_backward`` always returns an NCHW gradient (its kernel has no
channels-last path), and on CPU it is also slow on NHWC input. Bicubic interpolation is
separable: out = A_h @ x @ A_w^T for each image and channel, where A_h (H_out x H_in) and A_w
hold the cubic-convolution weights, border clamping included. Applied as batched matrix
products over the (N, H, W, C) view, forward and backward both read and write NHWC. The
weight matrices are obtained from ``F.interpolate`` itself (it interpolates an identity), so
they follow PyTorch's coordinate rules for ``size``, ``scale_factor`` and ``align_corners``.
The products run with autocast off, half and bfloat16 inputs in float32, as the native kernel
computes them (:mod:`.native_precision`): under autocast a float32 input stays float32.

The products cost O(H_in) multiply-adds per output pixel and axis instead of 4, yet on CPU
they beat the native kernels (whose channels-last backward is slow) up to about 512 x 512
inputs: forward + backward of a 2x upsampling on 2 AMD EPYC cores took 599 ms natively and
127 ms here for 4 x 32 x 128 x 128, 986 ms and 842 ms for 1 x 16 x 512 x 512. Above
:data:`MATMUL_MAX_SIZE` the native kernel is used.

That choice depends on the input's size, so :func:`bicubic_upsample` makes it and is an
``torch.fx.wrap`` leaf: ``symbolic_trace`` records one call instead of tracing the branch.
``torch.export`` and ONNX export trace through it; under ``torch.jit.script`` the layer runs
the native kernel (the same numbers).

Example:
    >>> import torch
    >>> up = ChannelsLastBicubicUpsample(scale_factor=2, mode='bicubic')
    >>> x = torch.randn(1, 3, 4, 4).to(memory_format=torch.channels_last)
    >>> up(x).is_contiguous(memory_format=torch.channels_last)
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from channels_last_algo.core.layers.native_precision import autocast_off, compute_dtype, output_dtype
from channels_last_algo.core.swap import Replacement

__all__ = ['ChannelsLastBicubicUpsample', 'MATMUL_MAX_SIZE', 'bicubic_upsample', 'bicubic_upsample_nhwc', 'is_bicubic']

MATMUL_MAX_SIZE = 512
"""Largest input height or width that the matrix-product path handles."""

_PerAxis = Optional[Union[int, float, Sequence[Union[int, float]]]]


def is_bicubic(module: nn.Upsample) -> bool:
    """True when ``module`` upsamples bicubically."""
    return module.mode == 'bicubic'


def _per_axis(value: _PerAxis) -> tuple:
    if value is None or isinstance(value, (int, float)):
        return (value, value)
    return tuple(value)


def _axis_weights(
    in_size: int,
    out_size: Optional[int],
    scale: Optional[float],
    align_corners: Optional[bool],
    recompute_scale_factor: Optional[bool],
    like: torch.Tensor,
) -> torch.Tensor:
    """The (out, in) bicubic weight matrix along one axis, as ``F.interpolate`` computes it."""
    eye = torch.eye(in_size, dtype=like.dtype, device=like.device).view(in_size, 1, in_size, 1)
    columns = F.interpolate(
        eye,
        size=None if out_size is None else (out_size, 1),
        scale_factor=None if scale is None else (scale, 1.0),
        mode='bicubic',
        align_corners=align_corners,
        recompute_scale_factor=recompute_scale_factor,
    )
    return columns[:, 0, :, 0].t()


def bicubic_upsample_nhwc(
    x: torch.Tensor,
    size: _PerAxis = None,
    scale_factor: _PerAxis = None,
    align_corners: Optional[bool] = None,
    recompute_scale_factor: Optional[bool] = None,
) -> torch.Tensor:
    """``F.interpolate(x, ..., mode='bicubic')`` of a 4D tensor, NHWC in and out, forward and backward."""
    n, c, h, w = x.shape
    sizes, scales = _per_axis(size), _per_axis(scale_factor)
    with autocast_off(x):  # the native kernel's precision (native_precision)
        computed = x.to(compute_dtype(x))
        a_h = _axis_weights(h, sizes[0], scales[0], align_corners, recompute_scale_factor, computed)
        a_w = _axis_weights(w, sizes[1], scales[1], align_corners, recompute_scale_factor, computed)
        out_h, out_w = a_h.shape[0], a_w.shape[0]
        rows = torch.matmul(a_w, computed.permute(0, 2, 3, 1).reshape(n * h, w, c))  # (N*H, W_out, C)
        out = torch.matmul(a_h, rows.view(n, h, out_w * c))  # (N, H_out, W_out*C)
    return out.view(n, out_h, out_w, c).permute(0, 3, 1, 2).to(output_dtype(x))


def bicubic_upsample(
    x: torch.Tensor,
    size: _PerAxis = None,
    scale_factor: _PerAxis = None,
    align_corners: Optional[bool] = None,
    recompute_scale_factor: Optional[bool] = None,
) -> torch.Tensor:
    """``F.interpolate(x, ..., mode='bicubic')``: :func:`bicubic_upsample_nhwc` for 4D inputs up to
    :data:`MATMUL_MAX_SIZE`, the native kernel otherwise."""
    if x.dim() != 4 or max(x.shape[-2:]) > MATMUL_MAX_SIZE:
        return F.interpolate(x, size, scale_factor, 'bicubic', align_corners, recompute_scale_factor)
    return bicubic_upsample_nhwc(x, size, scale_factor, align_corners, recompute_scale_factor)


torch.fx.wrap('bicubic_upsample')


class ChannelsLastBicubicUpsample(Replacement, nn.Upsample):
    """``nn.Upsample(mode='bicubic')`` (the only mode the rule swaps) whose forward and backward keep NHWC."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():
            return F.interpolate(
                input,
                self.size,
                self.scale_factor,
                self.mode,
                self.align_corners,
                recompute_scale_factor=self.recompute_scale_factor,
            )
        return bicubic_upsample(input, self.size, self.scale_factor, self.align_corners, self.recompute_scale_factor)
