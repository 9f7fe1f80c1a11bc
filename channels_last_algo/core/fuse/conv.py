"""The fused convolution: a ``Conv2d`` (BatchNorm folded in) with its activation and residual
add in one oneDNN (CPU) or cuDNN (CUDA) kernel, and the plain NHWC ops wherever that kernel
does not apply or refuses the shape.

Example:
    >>> conv = torch.nn.Conv2d(8, 8, 3, padding=1)
    >>> fused = FusedConv2d(conv, PostOp('relu'), add=True)
    >>> x, other = torch.randn(2, 8, 8, 8), torch.randn(2, 8, 8, 8)
    >>> with torch.no_grad():
    ...     torch.testing.assert_close(fused(x, other), torch.relu(conv(x) + other))
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from channels_last_algo.core.fuse.postops import RELU, PostOp
from channels_last_algo.core.layout import to_channels_last

__all__ = ['FusedConv2d']

log = logging.getLogger(__name__)


def _onednn_dtypes() -> frozenset[torch.dtype]:
    """The dtypes oneDNN's fused convolutions run in on this CPU (read once, at import, so that
    ``forward`` asks nothing that ``torch.compile`` would have to break its graph for)."""
    if not torch.backends.mkldnn.is_available():
        return frozenset()
    supported = {
        torch.float32: True,
        torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported(),
    }
    return frozenset(dtype for dtype, ok in supported.items() if ok)


_ONEDNN_DTYPES = _onednn_dtypes()
_CUDNN_DTYPES = (torch.float32, torch.float16)

# (device type, compute dtype, input shape without the batch) at which a fused kernel refused
RefusedShape = tuple[str, torch.dtype, tuple[int, ...]]


def _scalars(post_op: Optional[PostOp]) -> list:
    # A one-element [None] for post-ops without parameters: oneDNN ignores it, and
    # torch.export's serializer cannot write an empty Scalar?[] list.
    return list(post_op.scalars) if post_op is not None and post_op.scalars else [None]


class FusedConv2d(nn.Module):
    """A ``Conv2d`` (BatchNorm folded) with its activation and residual add in one kernel.

    ``forward(x)`` computes ``post_op(conv(x))``; with ``add=True``, ``forward(x, other)``
    computes ``post_op(conv(x) + other)`` (``post_op`` is then None or ReLU). Weight and bias
    are buffers, the weight channels last.

    Kernels, chosen per call from the input's device and dtype (the autocast dtype when
    autocast is on):

    * CPU, float32 / bfloat16 / float16 where oneDNN supports it: one oneDNN convolution with
      the activation (or the add and ReLU) as post-ops; with ``add_in_place`` (set by
      :func:`~channels_last_algo.core.fuse.fuse_for_inference` where nothing reads ``other``
      afterwards) the result is written into ``other``. With ``prepack`` the weight is
      reordered once per dtype into oneDNN's blocked format for the first input's shape, and
      reused (:meth:`torch.nn.Module.to` and friends drop the packed copies).
    * CUDA, float32 / float16, ReLU after the conv or the add: cuDNN's fused
      convolution + bias (+ add) + ReLU.
    * otherwise the plain NHWC ops (``conv2d``, add, activation), with the same math: other
      devices and dtypes, ``other`` not of the output's shape and dtype, ``x`` needing a
      gradient, and under dynamo (``torch.compile``; ``torch.export``'s default non-strict
      tracing keeps the fused kernels), whose inductor fuses those ops itself (with freezing:
      fused oneDNN kernels on prepacked weights).

    Where the fused kernel refuses an input shape (oneDNN 3.7 in torch 2.7 cannot create the
    conv + add kernel when the output is 1 x 1), that call and every later one at that shape
    (device, dtype and input shape without the batch, kept in :attr:`refused`) run the plain
    ops instead, and it is logged once. ``torch.export`` traces the plain ops at the shapes
    refused before, so export the module after one call at the shape to serve.

    Args:
        conv: an ``nn.Conv2d`` that :meth:`accepts` allows; its weight and bias are copied.
        post_op: the activation after the conv (or after the add), or None.
        add: whether ``forward`` takes a residual ``other`` to add before the activation.
        prepack: reorder the weight once into oneDNN's format on CPU. Off for
            ``torch.export``, which needs plain tensors.
    """

    def __init__(
        self, conv: nn.Conv2d, post_op: Optional[PostOp] = None, add: bool = False, prepack: bool = True
    ) -> None:
        super().__init__()
        if not self.accepts(conv):
            raise ValueError(f'FusedConv2d needs a plain nn.Conv2d with zero padding given as integers, got {conv}')
        if add and post_op not in (None, RELU):
            raise ValueError(f'a residual add can only be followed by ReLU in one kernel, got {post_op}')
        self.register_buffer('weight', to_channels_last(conv.weight.detach().clone()))
        self.register_buffer('bias', None if conv.bias is None else conv.bias.detach().clone())
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.kernel_size = tuple(conv.kernel_size)
        self.stride, self.padding, self.dilation = list(conv.stride), list(conv.padding), list(conv.dilation)
        self.groups = conv.groups
        self.post_op = post_op
        self.add = add
        self.add_in_place = False
        self.prepack = prepack
        self.refused: set[RefusedShape] = set()
        self._packed: dict[torch.dtype, tuple[torch.Tensor, Optional[torch.Tensor]]] = {}

    @staticmethod
    def accepts(module: Any) -> bool:
        """Whether ``module`` is a convolution this class can take: exactly ``nn.Conv2d`` (a
        subclass may change the math), zero padding given as integers."""
        return type(module) is nn.Conv2d and module.padding_mode == 'zeros' and not isinstance(module.padding, str)

    def extra_repr(self) -> str:
        parts = [
            f'{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}',
            f'stride={tuple(self.stride)}',
        ]
        if any(self.padding):
            parts.append(f'padding={tuple(self.padding)}')
        if any(d != 1 for d in self.dilation):
            parts.append(f'dilation={tuple(self.dilation)}')
        if self.groups != 1:
            parts.append(f'groups={self.groups}')
        parts.append(f'bias={self.bias is not None}')
        if self.add:
            parts.append('add')
        if self.post_op is not None:
            parts.append(f'post_op={self.post_op}')
        return ', '.join(parts)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state['_packed'] = {}  # oneDNN's opaque tensors neither copy nor pickle
        return state

    def _apply(self, fn, recurse=True):
        self._packed = {}
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor, other: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.add != (other is not None):
            expected, given = ('(x, other)' if add else '(x)' for add in (self.add, other is not None))
            raise TypeError(f'{type(self).__name__}(add={self.add}) takes {expected}, got {given}')
        device = x.device.type
        autocast = torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
        kernel = self._kernel(x, other, dtype, autocast)
        if kernel is None:
            return self._eager(x, other)
        shape: RefusedShape = (device, dtype, tuple(x.shape[1:]))
        if self.refused and shape in self.refused:
            return self._eager(x, other)
        if torch.compiler.is_compiling():  # torch.export: trace the kernel (fake tensors raise nothing to catch)
            return kernel(x.to(dtype), other, dtype)
        try:
            return kernel(x.to(dtype), other, dtype)
        except RuntimeError as error:
            self.refused.add(shape)
            log.info(
                '%s: the fused kernel refused input %s in %s (%s); running the plain ops at this shape',
                self.extra_repr(),
                tuple(x.shape),
                dtype,
                str(error).splitlines()[0] if str(error) else error,
            )
            return self._eager(x, other)

    def _kernel(
        self, x: torch.Tensor, other: Optional[torch.Tensor], dtype: torch.dtype, autocast: bool
    ) -> Optional[Callable[[torch.Tensor, Optional[torch.Tensor], torch.dtype], Any]]:
        """The fused kernel for this call, or None where the plain ops are to run."""
        device = x.device.type
        needs_grad = x.requires_grad and torch.is_grad_enabled()
        if (
            x.dim() != 4
            or not (autocast or self.weight.dtype == dtype)
            or needs_grad
            or (other is not None and not self._fits(x, other, dtype))
            or torch.compiler.is_dynamo_compiling()
        ):
            return None
        if device == 'cpu' and dtype in _ONEDNN_DTYPES:
            return self._onednn
        if device == 'cuda' and dtype in _CUDNN_DTYPES and self.post_op == RELU:
            return self._cudnn
        return None

    def _fits(self, x: torch.Tensor, other: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether ``other`` has exactly the conv output's shape and the compute dtype."""
        spatial = [
            (size + 2 * pad - dil * (k - 1) - 1) // stride + 1
            for size, pad, dil, k, stride in zip(
                x.shape[2:], self.padding, self.dilation, self.kernel_size, self.stride
            )
        ]
        return other.dtype == dtype and tuple(other.shape) == (x.shape[0], self.out_channels, *spatial)

    def _weights(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Weight and bias in ``dtype``; on CPU with ``prepack``, the weight reordered for
        oneDNN, once per dtype."""
        cached = self._packed.get(dtype)
        if cached is not None:
            return cached
        weight = self.weight.to(dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        if not (self.prepack and x.device.type == 'cpu'):
            return weight, bias
        weight = torch.ops.mkldnn._reorder_convolution_weight(
            weight, self.padding, self.stride, self.dilation, self.groups, list(x.shape)
        )
        self._packed[dtype] = (weight, bias)
        return weight, bias

    def _onednn(self, x: torch.Tensor, other: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        weight, bias = self._weights(x, dtype)
        post_op = self.post_op
        if other is None:
            return torch.ops.mkldnn._convolution_pointwise(
                x,
                weight,
                bias,
                self.padding,
                self.stride,
                self.dilation,
                self.groups,
                'none' if post_op is None else post_op.attr,
                _scalars(post_op),
                '' if post_op is None else post_op.algorithm,
            )
        other = to_channels_last(other)
        args = (
            weight,
            bias,
            self.padding,
            self.stride,
            self.dilation,
            self.groups,
            'add',
            1.0,
            None if post_op is None else post_op.attr,
            _scalars(post_op),
            '',
        )
        if self.add_in_place:
            return torch.ops.mkldnn._convolution_pointwise_.binary(other, x, *args)
        return torch.ops.mkldnn._convolution_pointwise.binary(x, other, *args)

    def _cudnn(self, x: torch.Tensor, other: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        weight, bias = self._weights(x, dtype)
        if other is None:
            return torch.cudnn_convolution_relu(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)
        return torch.cudnn_convolution_add_relu(
            x, weight, to_channels_last(other), 1.0, bias, self.stride, self.padding, self.dilation, self.groups
        )

    def _eager(self, x: torch.Tensor, other: Optional[torch.Tensor]) -> torch.Tensor:
        y = F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
        if other is not None:
            y = y + other
        return y if self.post_op is None else self.post_op.eager(y)
