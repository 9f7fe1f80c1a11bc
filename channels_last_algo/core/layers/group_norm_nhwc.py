"""Group and instance norm computed over the channels-last view, so that they keep channels last.

``InstanceNorm2d`` reshapes its input to 1 x (N*C) x H x W for ``batch_norm``, and that
reshape of an NHWC tensor is an NCHW ``clone``, on every device. On CUDA, ``group_norm``
also calls ``input.contiguous()`` and returns NCHW (pytorch/pytorch#111824; the CPU kernel
keeps NHWC). Here the statistics come from the (N, H*W, G, C/G) view of the (N, H, W, C)
permutation, and the normalisation is one ``addcmul`` of the input with a per-sample,
per-channel scale and shift (the form the native CPU kernels use, x * scale + shift), so
every op reads and writes NHWC, forward and backward, and the result is a new tensor (not a
view, which an in-place activation after the norm would have to copy whole in backward).
Instance norm is the case of one channel per group.
Half and bfloat16 inputs are normalised in float32 with autocast off, as the native kernels do,
and the output has the dtype the native layer gives (:mod:`.native_precision`: float32 for group
norm under CUDA autocast, whose policy runs it in float32; the input's dtype for instance norm,
which has no policy).

The functions decide on the input's dtype and device, so they are ``torch.fx.wrap`` leaves:
``symbolic_trace`` records one call; ``torch.export`` and ONNX export trace through them;
under ``torch.jit.script`` the layers run the native kernels (the same numbers).

Example:
    >>> import torch
    >>> x = torch.randn(2, 8, 4, 4).to(memory_format=torch.channels_last)
    >>> y = group_norm_nhwc(x, 4, None, None, 1e-5)
    >>> torch.allclose(y, torch.nn.functional.group_norm(x, 4), atol=1e-5)
    True
    >>> y.is_contiguous(memory_format=torch.channels_last)
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from channels_last_algo.core.layers.native_precision import autocast_off, compute_dtype, output_dtype
from channels_last_algo.core.swap import Replacement

__all__ = [
    'ChannelsLastGroupNorm',
    'ChannelsLastInstanceNorm2d',
    'group_norm_nhwc',
    'grouped_statistics',
    'instance_norm_nhwc',
    'uses_input_statistics',
]


GroupStatistics = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def grouped_statistics(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Variance and mean of ``x`` per sample and group, shaped (N, 1, G, 1): over the (N, H*W, G, C/G) view of
    its channels-last permutation."""
    n, c = x.shape[0], x.shape[1]
    grouped = x.movedim(1, -1).reshape(n, -1, groups, c // groups)  # a view of NHWC
    return torch.var_mean(grouped, dim=(1, 3), keepdim=True, correction=0)


def group_norm_nhwc(
    x: torch.Tensor,
    groups: int,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
    statistics: GroupStatistics = grouped_statistics,
) -> torch.Tensor:
    """``F.group_norm`` of an (N, C, ...) tensor, computed over its channels-last view; channels last out.
    ``statistics`` computes the variance and mean per sample and group (:func:`grouped_statistics`)."""
    n, c = x.shape[0], x.shape[1]
    if c % groups:
        raise ValueError(f'group norm needs channels divisible by groups; got {c} channels and {groups} groups')
    _refuse_one_value([n * c // groups, groups, *x.shape[2:]], 'value per channel')  # as F.group_norm does
    normalized = _normalized(x, groups, weight, bias, eps, statistics)
    return normalized.to(output_dtype(x, float32_under_autocast=('cuda',)))


def _normalized(
    x: torch.Tensor,
    groups: int,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
    statistics: GroupStatistics = grouped_statistics,
) -> torch.Tensor:
    """``x`` normalised per sample and group, in :func:`compute_dtype` with autocast off; x's layout out."""
    n, c = x.shape[0], x.shape[1]
    dtype = compute_dtype(x)
    per_group = (groups, c // groups)
    per_channel = (n, c) + (1,) * (x.dim() - 2)
    with autocast_off(x):
        x = x.to(dtype)
        var, mean = statistics(x, groups)  # (N, 1, G, 1)
        scale = torch.rsqrt(var + eps)
        if weight is not None:
            scale = scale * weight.to(dtype).view(per_group)
        shift = -mean * scale
        if bias is not None:
            shift = shift + bias.to(dtype).view(per_group)
        scale, shift = (t.expand(n, 1, *per_group).reshape(per_channel) for t in (scale, shift))
        return torch.addcmul(shift, x, scale)  # elementwise on x: a new tensor in x's layout


def instance_norm_nhwc(
    x: torch.Tensor,
    num_features: int,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
) -> torch.Tensor:
    """``nn.InstanceNorm2d`` without running statistics of an (N, C, H, W) or unbatched (C, H, W)
    tensor, in channels-last order; like the native layer, an affine norm refuses a channel
    count other than ``num_features`` and a plain one normalises every channel it gets."""
    if x.dim() == 3:
        return instance_norm_nhwc(x.unsqueeze(0), num_features, weight, bias, eps).squeeze(0)
    _refuse_one_value([1, 1, *x.shape[2:]], 'spatial element', shown=x.size())  # as F.instance_norm does
    if x.shape[1] != num_features and weight is not None:
        raise ValueError(
            f"expected input's size at dim=1 to match num_features ({num_features}), but got: {x.shape[1]}."
        )
    return _normalized(x, x.shape[1], weight, bias, eps).to(output_dtype(x))


def _refuse_one_value(size: list[int], what: str, shown: object = None) -> None:
    """torch's refusal of a norm over a single value (``size[0]`` times the sizes after the second), word for word."""
    if size[0] * math.prod(size[2:]) == 1:
        raise ValueError(
            f'Expected more than 1 {what} when training, got input size {size if shown is None else shown}'
        )


torch.fx.wrap('group_norm_nhwc')
torch.fx.wrap('instance_norm_nhwc')


def uses_input_statistics(module: nn.InstanceNorm2d) -> bool:
    """True when ``module`` normalises by each input's own statistics in train and eval."""
    return not module.track_running_stats


class ChannelsLastGroupNorm(Replacement, nn.GroupNorm):
    """``nn.GroupNorm`` computed in channels-last order (same parameters and numbers)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():
            return F.group_norm(input, self.num_groups, self.weight, self.bias, self.eps)
        return group_norm_nhwc(input, self.num_groups, self.weight, self.bias, self.eps)


class ChannelsLastInstanceNorm2d(Replacement, nn.InstanceNorm2d):
    """``nn.InstanceNorm2d`` without running statistics (the only kind the rule swaps),
    computed in channels-last order."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():
            batched = input if input.dim() == 4 else input.unsqueeze(0)
            out = F.instance_norm(batched, None, None, self.weight, self.bias, True, 0.0, self.eps)
            return out if input.dim() == 4 else out.squeeze(0)
        return instance_norm_nhwc(input, self.num_features, self.weight, self.bias, self.eps)
