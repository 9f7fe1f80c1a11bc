"""Reflection and replication padding as index gathers in NHWC order, for CUDA.

The CUDA kernels of ``reflection_pad2d`` and ``replication_pad2d`` (and their backward)
allocate contiguous NCHW tensors and call ``.contiguous()`` on their input; the CPU kernels
keep NHWC. Both paddings pick, along H and then W, the source row or column for each output
position (reflect: mirror without repeating the edge; replicate: clamp to the edge), so they
are two ``index_select`` calls on the (N, H, W, C) view, which write NHWC; their backward is
``index_add`` into an NHWC zero tensor. Negative padding crops, as in the native layers.
Like the native layers, the result is always a new tensor. The function checks the
padding against the input's size, so it is a ``torch.fx.wrap`` leaf; under
``torch.jit.script`` the layers run the native kernels (the same numbers).

Example:
    >>> import torch
    >>> x = torch.arange(3.).view(1, 1, 1, 3)
    >>> pad_nhwc(x, (2, 1, 0, 0), 'reflect').flatten().tolist()
    [2.0, 1.0, 0.0, 1.0, 2.0, 1.0]
    >>> pad_nhwc(x, (2, 1, 0, 0), 'replicate').flatten().tolist()
    [0.0, 0.0, 0.0, 1.0, 2.0, 2.0]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from channels_last_algo.core.swap import Replacement

__all__ = ['ChannelsLastReflectionPad2d', 'ChannelsLastReplicationPad2d', 'pad_nhwc']


def _source_index(size: int, before: int, after: int, mode: str, device: torch.device) -> torch.Tensor:
    position = torch.arange(-before, size + after, device=device)
    if mode == 'replicate':
        return position.clamp(0, size - 1)
    if before >= size or after >= size:
        raise ValueError(f'reflection padding ({before}, {after}) must be smaller than the padded dimension ({size})')
    position = position.abs()
    return torch.where(position >= size, 2 * (size - 1) - position, position)


def pad_nhwc(x: torch.Tensor, padding: Sequence[int], mode: str) -> torch.Tensor:
    """``F.pad(x, padding, mode)`` of a 4D tensor for ``mode`` 'reflect' or 'replicate'; NHWC out.

    ``padding`` is (left, right, top, bottom), as for ``F.pad``.
    """
    if mode not in ('reflect', 'replicate'):
        raise ValueError(f"pad_nhwc pads with mode 'reflect' or 'replicate', not {mode!r}")
    left, right, top, bottom = padding
    rows = _source_index(x.shape[2], top, bottom, mode, x.device)
    columns = _source_index(x.shape[3], left, right, mode, x.device)
    out = x.permute(0, 2, 3, 1).index_select(1, rows).index_select(2, columns)
    return out.permute(0, 3, 1, 2)


def pad(x: torch.Tensor, padding: Sequence[int], mode: str) -> torch.Tensor:
    """``F.pad(x, padding, mode)``: :func:`pad_nhwc` for 4D inputs, the native op otherwise."""
    return pad_nhwc(x, padding, mode) if x.dim() == 4 else F.pad(x, padding, mode)


torch.fx.wrap('pad')


class ChannelsLastReflectionPad2d(Replacement, nn.ReflectionPad2d):
    """``nn.ReflectionPad2d`` that returns NHWC on every device."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():
            return F.pad(input, self.padding, 'reflect')
        return pad(input, self.padding, 'reflect')


class ChannelsLastReplicationPad2d(Replacement, nn.ReplicationPad2d):
    """``nn.ReplicationPad2d`` that returns NHWC on every device."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():
            return F.pad(input, self.padding, 'replicate')
        return pad(input, self.padding, 'replicate')
