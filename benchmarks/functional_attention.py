"""The functional-break nets whose break is an attention's tokens reshaped back to N x C x H x W: multi-head
attention added to or multiplied onto a conv branch (LeViT, EfficientFormerV2), and Swin's window and
MaxViT's grid attention. :mod:`functional_models` lists them in its zoo with the other families.

Example:
    >>> import torch
    >>> AttentionReshapeNet()(torch.randn(2, 3, 16, 16)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

try:  # imported as benchmarks.functional_attention (the tests)
    from .functional_blocks import BlocksNet, conv_bn
except ImportError:  # imported next to the benchmark scripts
    from functional_blocks import BlocksNet, conv_bn

__all__ = ['AttentionReshapeNet', 'AttentionViewNet', 'GridAttentionNet', 'WindowAttentionNet']


# 3. attention reshaped back to N x C x H x W


class _Attention(nn.Module):
    """Softmax attention over the H*W tokens with nn.Linear q, k, v, beside a conv, BatchNorm, GELU branch."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.scale = float(dim // heads) ** -0.5
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.conv = nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1, bias=False), nn.BatchNorm2d(dim), nn.GELU())

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        """Heads x (H*W) x (H*W) attention: B x heads x HW x C/heads."""
        b, c, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)
        shape = [b, h * w, self.heads, c // self.heads]
        q = self.q(t).view(shape).transpose(1, 2)
        k = self.k(t).view(shape).transpose(1, 2)
        v = self.v(t).view(shape).transpose(1, 2)
        return torch.softmax(q @ k.transpose(-2, -1) * self.scale, -1) @ v


class AttentionAdd(_Attention):
    """LeViT / EfficientFormerV2 style: ``(attn @ v).transpose(2, 3).reshape(B, C, H, W)`` added to the conv
    branch, then ReLU. With one head this is ``.transpose(1, 2).reshape(B, C, H, W)`` of the B x HW x C
    tokens, an NHWC view that keeps NHWC; with two heads the reshape copies, to NCHW."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        a = self.attend(x).transpose(2, 3).reshape(b, c, h, w)
        return F.relu(a + self.conv(x))


class AttentionReshapeNet(BlocksNet):
    """functional-attention: multi-head attention reshaped back with ``.transpose(2, 3).reshape(B, C, H, W)``,
    added to the GELU'd conv branch, then ReLU (``threshold_backward`` and ``gelu_backward`` meet its gradient)."""

    def __init__(self, num_classes: int = 10, width: int = 16, heads: int = 2) -> None:
        super().__init__([AttentionAdd(width, heads)], width, num_classes)


class AttentionMul(_Attention):
    """Single-head attention, back with ``.permute(0, 2, 1).contiguous().view(B, C, H, W)``, multiplied
    onto the conv branch, then ReLU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        a = self.attend(x).squeeze(1)
        a = a.permute(0, 2, 1).contiguous().view(b, c, h, w)
        return F.relu(a * self.conv(x))


class AttentionViewNet(BlocksNet):
    """functional-attention: attention viewed back with ``.permute(0, 2, 1).contiguous().view(B, C, H, W)``,
    multiplied onto the GELU'd conv branch, then ReLU."""

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__([AttentionMul(width, 1)], width, num_classes)


# 4. window and grid attention


class _Partitioned(nn.Module):
    """Attention inside groups of ``size * size`` tokens, with nn.Linear q, k, v and a 1x1 conv after."""

    def __init__(self, dim: int, size: int) -> None:
        super().__init__()
        self.size = size
        self.scale = float(dim) ** -0.5
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = conv_bn(dim, dim, 1)

    def attend(self, t: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.q(t) @ self.k(t).transpose(1, 2) * self.scale, -1) @ self.v(t)


class WindowAttention(_Partitioned):
    """Swin: ``permute`` to B x H x W x C, ``.view(B, H//w, w, W//w, w, C).permute(0, 1, 3, 2, 4, 5)
    .contiguous()`` into windows, attention, the reverse, ``.permute(0, 3, 1, 2).contiguous()``, a conv."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        s = self.size
        t = x.permute(0, 2, 3, 1).view(b, h // s, s, w // s, s, c).permute(0, 1, 3, 2, 4, 5).contiguous()
        t = self.attend(t.view(-1, s * s, c))
        t = t.view(b, h // s, w // s, s, s, c).permute(0, 1, 3, 2, 4, 5).contiguous().view(b, h, w, c)
        return x + self.proj(t.permute(0, 3, 1, 2).contiguous())


class WindowAttentionNet(BlocksNet):
    """functional-window: Swin window attention, back to N x C x H x W with ``.permute(0, 3, 1, 2).contiguous()``."""

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__([WindowAttention(width, 4)], width, num_classes)


class GridAttention(_Partitioned):
    """MaxViT's grid attention: tokens ``H // g`` apart attend to each other; the reverse permutes the
    6D grid straight to channels first and reshapes to B x C x H x W; the result is added to ``x``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        g = self.size
        t = x.permute(0, 2, 3, 1).view(b, g, h // g, g, w // g, c).permute(0, 2, 4, 1, 3, 5).contiguous()
        t = self.attend(t.view(-1, g * g, c))
        t = t.view(b, h // g, w // g, g, g, c).permute(0, 5, 3, 1, 4, 2).reshape(b, c, h, w)
        return self.proj(t + x)


class GridAttentionNet(BlocksNet):
    """functional-window: MaxViT grid attention reshaped back to N x C x H x W and added to its input."""

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__([WindowAttention(width, 4), GridAttention(width, 4)], width, num_classes)
