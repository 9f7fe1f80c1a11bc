"""TensorFlow's ``'SAME'`` padding computed from the input's shape, in a module of its own (as timm's
``timm.layers.padding``): tracing fails in :func:`padding_for`, which only this module calls."""

import math

import torch.nn.functional as F


def padding_for(size, kernel_size, stride):
    return max((math.ceil(size / stride) - 1) * stride + kernel_size - size, 0)


def pad_same(x, kernel_size, stride):
    """``x`` padded so that a convolution of ``kernel_size`` and ``stride`` gives ceil(size / stride)."""
    height, width = x.shape[-2:]
    pad_h, pad_w = padding_for(height, kernel_size, stride), padding_for(width, kernel_size, stride)
    if pad_h > 0 or pad_w > 0:
        x = F.pad(x, [pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2])
    return x
