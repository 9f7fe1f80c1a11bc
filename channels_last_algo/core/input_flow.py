"""Where a first batch's 4D/5D tensors flow in the forward: into a convolution (an image), into a ``.view()``
NHWC strides cannot take, or through a reordering that puts another dimension second.

:class:`InputFlow` is the ``TorchFunctionMode`` that :class:`~channels_last_algo.core.inputs.InputSelection`
runs inside the module calls of the first batch of each batch structure, in ``inputs='auto'`` mode. It notes
which batch tensors each tensor derives from until a convolution takes it; a convolution's outputs start a new
flow, so only the tensors a convolution takes directly, or derives from the batch without one, count.

Example:
    >>> import torch
    >>> image, frames = torch.randn(2, 3, 4, 4), torch.randn(2, 5, 4, 4)
    >>> flow = InputFlow([(('image',), image), (('frames',), frames)], guessed=frozenset())
    >>> with flow:
    ...     _ = torch.nn.functional.conv2d(image * 2, torch.randn(4, 3, 1, 1))
    ...     _ = frames.view(2, 80)
    >>> flow.fed, flow.convolutions
    ({('image',)}, 1)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from channels_last_algo.core.aliased_copies import AliasedCopies
from channels_last_algo.core.batch_tree import Path
from channels_last_algo.core.layout import channels_last_format
from channels_last_algo.core.view_watch import GRADIENT_OPS

__all__ = ['InputFlow']

_VIEWS = {torch.Tensor.view}
_REORDERINGS = frozenset(
    getattr(owner, name)
    for owner in (torch, torch.Tensor)
    for name in ('permute', 'transpose', 'movedim', 'moveaxis', 'swapaxes', 'swapdims')
)


def _is_convolution(func: Any) -> bool:
    """A forward convolution (``torch.conv2d``, ``aten.convolution``, ...), not its backward."""
    name = getattr(func, '__name__', '')
    forward = name.startswith(('conv2d', 'conv3d', 'conv_transpose')) or 'convolution' in name
    return forward and 'backward' not in name


def _view_fails_in_channels_last(tensor: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """True when ``tensor.view(*args)`` would raise had ``tensor`` NHWC strides (asked of torch itself:
    a mode below this one, such as a view watch's, would run a failing view on a copy)."""
    fmt = channels_last_format(tensor)
    if fmt is None:
        return False
    with torch._C.DisableTorchFunction():
        probe = torch.empty(tensor.shape, dtype=tensor.dtype, device='meta').to(memory_format=fmt)
        try:
            probe.view(*args, **kwargs)
        except RuntimeError:
            return True
    return False


def _moves_channels(source: Any, result: Any) -> bool:
    """Whether ``result``, ``source`` with its dimensions reordered, holds another of them second: converting
    ``source`` to NHWC would then lay ``result`` out in neither layout."""
    return not (
        isinstance(source, torch.Tensor)
        and isinstance(result, torch.Tensor)
        and result.dim() == source.dim() >= 2
        and result.size(1) == source.size(1)
        and result.stride(1) == source.stride(1)
    )


class InputFlow(TorchFunctionMode):
    """Follows which batch tensors flow into convolutions (and into incompatible views) before
    any convolution: outputs of a convolution start a new flow, so only the tensors a
    convolution takes directly, or derives from the batch without one, count."""

    def __init__(self, tensors: list[tuple[Path, torch.Tensor]], guessed: frozenset[Path]) -> None:
        super().__init__()
        self.guessed = guessed
        self.origins = WeakIdKeyDictionary()
        self.reorders = WeakIdKeyDictionary()  # tensor -> its origins whose channels a reordering moved on the way
        self.channels = {path: tensor.shape[1] for path, tensor in tensors}  # each batch tensor's second size
        for path, tensor in tensors:
            self.origins[tensor] = self.origins.get(tensor, frozenset()) | {path}
        self.fed: set[Path] = set()
        self.viewed: set[Path] = set()
        self.reordered: set[Path] = set()  # left as they came: a reordering put the channels second (N, H, W, C)
        self.convolutions = 0
        self.copies = AliasedCopies()  # the copies failing views ran on, kept in step with the batch tensors

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling() or func in GRADIENT_OPS:  # a compiled forward; gradients
            return func(*args, **kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        origins = frozenset().union(*(self.origins.get(t, frozenset()) for t in tensors))
        if not origins:
            return func(*args, **kwargs)
        reordered = frozenset().union(*(self.reorders.get(t, frozenset()) for t in tensors))
        if _is_convolution(func):
            self.convolutions += 1
            if args and isinstance(args[0], torch.Tensor):
                self._fed(args[0])
            return func(*args, **kwargs)
        if func in _VIEWS and _view_fails_in_channels_last(args[0], args[1:], kwargs):
            self.viewed |= self.origins.get(args[0], frozenset())
            if not args[0].is_contiguous():  # NHWC by the first batch's guess: view a contiguous copy
                return self._noted(self.copies.view(func, args[0], args[1:], kwargs), origins, reordered)
        result = func(*args, **kwargs)
        self.copies.written(func, args, kwargs)
        if func in _REORDERINGS and _moves_channels(args[0], result):
            reordered |= origins
        return self._noted(result, origins, reordered)

    def _fed(self, image: torch.Tensor) -> None:
        """``image`` goes into a convolution: its origins are images, but one a reordering moved another dimension
        second on the way only where the convolution still takes its second one as the channels (a clip
        ``(N, C, T, H, W)`` transposed and folded into frames); a ``(N, H, W, C)`` batch permuted is NHWC as it came."""
        origins = self.origins.get(image, frozenset())
        moved = self.reorders.get(image, frozenset()) & origins
        kept = {path for path in moved if self.channels[path] == image.shape[1]}
        self.fed |= (origins - moved) | kept
        self.reordered |= moved - kept

    def _noted(self, result: Any, origins: frozenset[Path], reordered: frozenset[Path]) -> Any:
        """``result``, its tensors noted as flowing from ``origins`` (those of ``reordered`` through a reordering)."""
        for tensor in tree_leaves(result):
            if isinstance(tensor, torch.Tensor):
                self.origins[tensor] = self.origins.get(tensor, frozenset()) | origins
                if reordered:
                    self.reorders[tensor] = self.reorders.get(tensor, frozenset()) | reordered
        return result
