"""Group and instance norm computed over the NHWC view, so that they keep channels last.

``InstanceNorm2d`` reshapes its input to 1 x (N*C) x H x W for ``batch_norm``, and that
reshape of an NHWC tensor is an NCHW ``clone``, on every device. On CUDA, ``group_norm``
also calls ``input.contiguous()`` and returns NCHW (pytorch/pytorch#111824; the CPU kernel
keeps NHWC). Here the statistics come from the (N, H*W, G, C/G) view of the (N, H, W, C)
permutation, and the normalisation is one ``addcmul`` with a per-sample, per-channel scale
and shift (the form the native CPU kernels use, x * scale + shift), so every op reads and
writes NHWC, forward and backward. Instance norm is the case of one channel per group.
Half and bfloat16 inputs are normalised in float32, as the native kernels do, and the output
has the dtype the native layer gives (float32 under CUDA autocast, whose policy runs group
norm in float32).

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

from typing import Optional

import torch
from torch import nn

__all__ = ['ChannelsLastGroupNorm', 'ChannelsLastInstanceNorm2d', 'group_norm_nhwc', 'uses_input_statistics']

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def group_norm_nhwc(
    x: torch.Tensor,
    groups: int,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
) -> torch.Tensor:
    """``F.group_norm`` of a 4D tensor, computed over its NHWC view; NHWC out."""
    n, c, h, w = x.shape
    if c % groups:
        raise ValueError(f'group norm needs channels divisible by groups; got {c} channels and {groups} groups')
    cuda_autocast = x.device.type == 'cuda' and torch.is_autocast_enabled('cuda')
    out_dtype = torch.float32 if cuda_autocast else x.dtype
    compute_dtype = torch.float32 if x.dtype in _LOW_PRECISION else x.dtype
    per_group = (groups, c // groups)
    with torch.autocast(x.device.type, enabled=False):
        grouped = x.permute(0, 2, 3, 1).to(compute_dtype).reshape(n, h * w, *per_group)
        var, mean = torch.var_mean(grouped, dim=(1, 3), keepdim=True, correction=0)  # (N, 1, G, 1)
        scale = torch.rsqrt(var + eps)
        if weight is not None:
            scale = scale * weight.to(compute_dtype).view(per_group)
        shift = -mean * scale
        if bias is not None:
            shift = shift + bias.to(compute_dtype).view(per_group)
        out = torch.addcmul(shift, grouped, scale).view(n, h, w, c)
    return out.to(out_dtype).permute(0, 3, 1, 2)


def uses_input_statistics(module: nn.InstanceNorm2d) -> bool:
    """True when ``module`` normalises by each input's own statistics in train and eval."""
    return not module.track_running_stats


class ChannelsLastGroupNorm(nn.GroupNorm):
    """``nn.GroupNorm`` computed in NHWC order (same parameters and numbers)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dim() != 4:
            return super().forward(input)
        return group_norm_nhwc(input, self.num_groups, self.weight, self.bias, self.eps)


class ChannelsLastInstanceNorm2d(nn.InstanceNorm2d):
    """``nn.InstanceNorm2d`` without running statistics, computed in NHWC order.

    Other inputs (unbatched, a channel count other than ``num_features``) and instance norms
    with running statistics take the native path.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dim() != 4 or input.size(1) != self.num_features or self.track_running_stats:
            return super().forward(input)
        return group_norm_nhwc(input, self.num_features, self.weight, self.bias, self.eps)
