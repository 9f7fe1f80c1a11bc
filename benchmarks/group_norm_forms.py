"""Group norm in a channels-last network on CUDA, three ways, timed side by side (the GPU suite's part
``group_norm``): which form a CUDA repair rule for ``nn.GroupNorm`` should take, if any.

On CUDA torch's group norm makes its input contiguous and returns NCHW (pytorch#111824). On an H200 a
ResNet-18 with GroupNorm trained at 0.85x of NCHW in plain channels last and at 0.68x with the repair's NHWC
group norm, which keeps the layout but is several kernels. The forms, each timed on one block of an NHWC
activation in AMP (group norm, ReLU, a 3x3 convolution; forward and backward):

    native        ``F.group_norm`` as torch runs it: its NCHW copy in, NCHW out, the convolution's copy back
    nhwc          the repair's :func:`~channels_last_algo.core.layers.group_norm_nhwc.group_norm_nhwc`:
                  statistics over the (N, H*W, G, C/G) view of the NHWC tensor
    per_channel   ``group_norm_nhwc`` with :func:`channel_statistics`: statistics per channel over H*W (a
                  reduction whose inner dimension is the contiguous channels), combined per group

Example:
    >>> x = torch.randn(2, 8, 5, 5, dtype=torch.float64).to(memory_format=torch.channels_last)
    >>> weight, bias = torch.rand(8, dtype=torch.float64), torch.rand(8, dtype=torch.float64)
    >>> y = FORMS['per_channel'](x, 4, weight, bias, 1e-5)
    >>> torch.allclose(y, F.group_norm(x, 4, weight, bias, 1e-5)), y.is_contiguous(memory_format=torch.channels_last)
    (True, True)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from gpu_report import timed_rows  # benchmarks/, next to this script
from torch import nn

from channels_last_algo.core.layers.group_norm_nhwc import group_norm_nhwc
from channels_last_algo.core.timing import synchronizer, time_interleaved

__all__ = ['FORMS', 'SHAPES', 'channel_statistics', 'time_forms']

SHAPES = ((64, 64, 56, 56), (64, 256, 28, 28), (64, 512, 7, 7))  # (N, C, H, W): ResNet stages at 224 px
GROUPS = 32


def channel_statistics(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Variance and mean of a 4D ``x`` per sample and group, shaped (N, 1, G, 1): each channel's over H*W (a
    reduction whose inner dimension is the contiguous channels of NHWC), combined per group by the law of total
    variance (the mean of the channels' variances plus the variance of their means)."""
    n, c = x.shape[0], x.shape[1]
    var, mean = torch.var_mean(x.movedim(1, -1).reshape(n, -1, c), dim=1, correction=0)  # (N, C)
    var, mean = var.view(n, 1, groups, -1), mean.view(n, 1, groups, -1)
    group_mean = mean.mean(-1, keepdim=True)
    return (var + (mean - group_mean).square()).mean(-1, keepdim=True), group_mean


FORMS: dict[str, Callable] = {
    'native': F.group_norm,
    'nhwc': group_norm_nhwc,
    'per_channel': functools.partial(group_norm_nhwc, statistics=channel_statistics),
}


def _block_step(form: Callable, shape: tuple, device: torch.device, dtype: torch.dtype) -> Callable[[], None]:
    """One forward and backward of group norm (``form``), ReLU and a 3x3 convolution on an NHWC activation."""
    channels = shape[1]
    norm = nn.GroupNorm(GROUPS, channels).to(device)
    conv = nn.Conv2d(channels, channels, 3, padding=1).to(device, memory_format=torch.channels_last)
    x = torch.randn(shape, device=device, dtype=dtype).to(memory_format=torch.channels_last).requires_grad_()

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype):
            y = conv(F.relu(form(x, GROUPS, norm.weight, norm.bias, norm.eps)))
        y.float().sum().backward()

    return step


def time_forms(
    device: torch.device, dtype: torch.dtype, shapes=SHAPES, rounds: int = 10, warmup: int = 3
) -> dict[str, dict]:
    """Per shape (``'NxCxHxW'``), each form's median and min ms, images/s and its median speedup over ``native``
    with the interval."""
    results = {}
    for shape in shapes:
        steps = {name: _block_step(form, shape, device, dtype) for name, form in FORMS.items()}
        timings = time_interleaved(steps, rounds=rounds, warmup=warmup, synchronize=synchronizer(device), catch=True)
        results['x'.join(map(str, shape))] = timed_rows(timings, shape[0], 'native')
    return results
