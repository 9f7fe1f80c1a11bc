"""Kernel safe paths: layers that compute what the original computes without the kernel that fails.

The known layout kernel bugs (:data:`~channels_last_algo.core.safety.bugs.KNOWN_BUGS`) name these
classes; :func:`~channels_last_algo.core.safety.bugs.make_safe` swaps a matching layer for one.

Each subclasses the layer it replaces (and :class:`~channels_last_algo.core.swap.Replacement`, so
it pickles as that layer) and overrides ``forward`` only, so a module whose class is swapped
keeps its ``Parameter`` objects, buffers, hooks and ``state_dict`` keys. No ``forward`` branches
on its input (the rank and device checks are ``torch.fx.wrap`` leaves), calls ``super()`` or holds a helper
module, so a model keeps working with ``torch.fx.symbolic_trace``, ``torch.jit.script``,
``torch.export`` and ONNX export.

- :class:`SubsampledConv2d`: a 1x1 convolution with stride s, padding 0, is the unit-stride
  1x1 convolution of ``x[..., ::s, ::s]``. oneDNN's 1x1 kernels compute the strided case by
  first gathering exactly that subsample into a workspace; the unit-stride kernel needs no
  workspace, so its backward cannot overrun one. The slice is a view, which the convolution
  copies to NHWC (channels-last weights decide its layout): the layer stays NHWC in forward and
  moves a quarter of the bytes a stride-2 round trip through NCHW would.
- :class:`NCHWAvgPool2d`: average pooling computed on an NCHW copy, the output restrided to
  channels last (an unbatched 3D one left as the native layer gives it): the NHWC backward kernel is
  never called.
- :class:`NCHWMaskDropout`: dropout whose mask is drawn in NCHW order whatever the input's layout
  (:func:`dropout_drawn_as_nchw`: laid out as ``empty_like`` lays out NCHW's input, contiguous unless a
  view watch told it otherwise); the output keeps the input's layout, and the same seed drops the same
  elements as NCHW.

Example:
    >>> import torch
    >>> conv = torch.nn.Conv2d(3, 8, 1, stride=2, bias=False).double().to(memory_format=torch.channels_last)
    >>> x = torch.randn(2, 3, 8, 8, dtype=torch.float64).to(memory_format=torch.channels_last)
    >>> expected = conv(x)
    >>> conv.__class__ = SubsampledConv2d
    >>> torch.equal(conv(x), expected), conv(x).is_contiguous(memory_format=torch.channels_last)
    (True, True)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from channels_last_algo.core.random_draws import draw_order, drawn_in, memory_order, same_order
from channels_last_algo.core.swap import Replacement

__all__ = ['NCHWAvgPool2d', 'NCHWMaskDropout', 'SubsampledConv2d', 'channels_last_if_batched', 'dropout_drawn_as_nchw']


class SubsampledConv2d(Replacement, nn.Conv2d):
    """A 1x1 ``nn.Conv2d`` with stride > 1 and padding 0 computed as a unit-stride 1x1
    convolution of the strided subsample of its input (the same numbers)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        subsample = input[..., :: self.stride[0], :: self.stride[1]]
        return F.conv2d(subsample, self.weight, self.bias, 1, 0, self.dilation, self.groups)


class NCHWAvgPool2d(Replacement, nn.AvgPool2d):
    """``nn.AvgPool2d`` computed on an NCHW copy of a 4D input, its output restrided to channels
    last; the NCHW gradient it returns is what the audit then reports as this path's cost."""

    layout_break_cause = (
        'a kernel safe path (cuda_avg_pool2d_nhwc_backward_padding): pooling on an NCHW copy, since the NHWC '
        'backward kernel gives wrong input gradients on this torch'
    )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output = F.avg_pool2d(
            input.to(memory_format=torch.contiguous_format),
            self.kernel_size,
            self.stride,
            self.padding,
            self.ceil_mode,
            self.count_include_pad,
            self.divisor_override,
        )
        return channels_last_if_batched(output)


def channels_last_if_batched(output: torch.Tensor) -> torch.Tensor:
    """A 4D ``output`` restrided to channels last; an unbatched (C, H, W) one, which has no such form, as it is.
    A ``torch.fx.wrap`` leaf, since it looks at the rank."""
    if output.dim() != 4:
        return output
    return output.contiguous(memory_format=torch.channels_last)


torch.fx.wrap('channels_last_if_batched')


class NCHWMaskDropout(Replacement, nn.Dropout):
    """``nn.Dropout`` with its mask drawn in NCHW order (:func:`dropout_drawn_as_nchw`), contiguous as
    torch draws it for an NCHW input, so the numbers and the random state after it are NCHW's; the
    output keeps the input's layout. Where NCHW's input is laid out otherwise (a map permuted back from
    tokens, tokens flattened from a map), :meth:`follow_nchw_input` has the noise drawn in its order, as
    torch draws it there."""

    noise_order = ()  # the dimensions in NCHW's memory order of the noise; none: contiguous
    layout_break_cause = (
        "a kernel safe path (dropout_mask_memory_order): the dropout kernel runs on a copy laid out as NCHW's "
        'input, so that it drops what NCHW drops'
    )
    __constants__ = [*nn.Dropout.__constants__, 'noise_order']  # for TorchScript, which sees instance attributes only

    def follow_nchw_input(self, input: torch.Tensor, twin: torch.Tensor) -> None:
        """Told by a view watch the input's NCHW twin (a meta tensor with the strides NCHW gives it): the noise
        takes the memory order NCHW's noise, ``empty_like`` of the twin, has."""
        with _disable_current_modes():  # meta tensors: no audit records them
            self.noise_order = draw_order(F.dropout, twin)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return input
        if torch.jit.is_scripting():  # the noise path on every device; a list, which TorchScript types
            order: list[int] = []
            for dim in self.noise_order:
                order.append(dim)
            return _noise_dropout(input, self.p, self.inplace, order)
        return dropout_drawn_as_nchw(input, self.p, self.inplace, self.noise_order)


_FUSED_DROPOUT_DEVICES = ('cuda', 'xpu')  # where F.dropout runs native_dropout, whose kernel draws over its input


def dropout_drawn_as_nchw(input: torch.Tensor, p: float, inplace: bool, order: tuple = ()) -> torch.Tensor:
    """``F.dropout(input, p, True, inplace)`` with its numbers drawn as for NCHW's input, laid out in ``order``
    (as ``torch.empty_permuted`` takes it; empty: contiguous); the output has the input's layout.

    Where torch's dropout makes its noise (``empty_like(input)``, ``bernoulli_``: on the CPU, and in place
    everywhere) the noise is made so laid out; where its fused kernel draws over the input's memory
    (``native_dropout`` on CUDA), that kernel runs on the input where it is so laid out (a classifier's 2D
    features), else on a copy so laid out. A ``torch.fx.wrap`` leaf.

    Example:
        >>> x = torch.randn(2, 3, 4, 4)
        >>> _ = torch.manual_seed(0); expected = F.dropout(x, 0.5)
        >>> _ = torch.manual_seed(0); nhwc = dropout_drawn_as_nchw(x.to(memory_format=torch.channels_last), 0.5, False)
        >>> torch.equal(nhwc, expected), nhwc.is_contiguous(memory_format=torch.channels_last)
        (True, True)
    """
    if input.device.type in _FUSED_DROPOUT_DEVICES and not inplace and 0.0 < p < 1.0 and input.numel() > 0:
        order = order or tuple(range(input.dim()))
        dropout = torch.ops.aten.dropout.default  # the op: a view watch re-draws F.dropout's numbers
        if same_order(tuple(input.shape), order, memory_order(input.stride())):  # laid out so already
            return dropout(input, p, True)
        return torch.empty_like(input).copy_(drawn_in(dropout, (input, p, True), {}, order))
    return _noise_dropout(input, p, inplace, list(order))


def _noise_dropout(input: torch.Tensor, p: float, inplace: bool, order: list[int]) -> torch.Tensor:
    """torch's own dropout (``_dropout_impl``) with its noise laid out in ``order`` (empty: contiguous)."""
    keep = 1.0 - p
    if len(order) > 0:
        noise = torch.empty_permuted(input.shape, order, dtype=input.dtype, device=input.device)
    else:
        noise = torch.empty(input.shape, dtype=input.dtype, device=input.device)
    noise = noise.bernoulli_(keep)
    noise = noise.div_(keep) if keep > 0.0 else noise
    return input.mul_(noise) if inplace else input * noise


torch.fx.wrap('dropout_drawn_as_nchw')
