"""What memory layout a tensor has, and how to restride one, or a whole batch, to channels last.

PyTorch keeps a tensor's logical shape N x C x H x W (or N x C x D x H x W) whatever its
memory order; the strides say which order the bytes are in. This module names those orders
(:class:`Layout`, what one tensor's strides show; :class:`MemoryFormat`, the format a model is
given) and restrides tensors of both ranks, alone or every one in a batch.

A shape where C == 1, or where every spatial size is 1, is *ambiguous*: the same bytes are
both channels-first and channels-last contiguous. ``tensor.contiguous(memory_format=...)`` is
then a no-op and keeps channels-first strides, while ``tensor.to(memory_format=...)`` writes
the real channels-last strides that cuDNN, oneDNN and DDP's gradient buckets look at.
:func:`to_channels_last` always gives the latter.

Example:
    >>> import torch
    >>> w = torch.randn(8, 1, 3, 3)             # a depthwise kernel: ambiguous
    >>> layout_of(w)
    <Layout.AMBIGUOUS: 'ambiguous'>
    >>> has_channels_last_strides(w)
    False
    >>> has_channels_last_strides(to_channels_last(w))
    True
    >>> layout_of(to_channels_last(torch.randn(2, 3, 8, 8)))
    <Layout.NHWC: 'NHWC'>
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable
from typing import Any, Optional, TypeVar

import torch
from torch.utils._pytree import tree_leaves

from channels_last_algo.core.batch_tree import map_leaves

__all__ = [
    'Layout',
    'MemoryFormat',
    'batch_to_channels_first',
    'batch_to_channels_last',
    'channels_last_contiguous',
    'channels_last_format',
    'has_channels_last_strides',
    'is_4d_or_5d',
    'is_channels_last',
    'layout_of',
    'to_channels_first',
    'to_channels_last',
]


class Layout(str, enum.Enum):
    """The memory order of one tensor's bytes, as its strides show it (rank and ambiguity included).

    Example:
        >>> Layout.NDHWC.is_channels_last, Layout.AMBIGUOUS.is_channels_first
        (True, False)
    """

    NCHW = 'NCHW'
    NHWC = 'NHWC'
    NCDHW = 'NCDHW'
    NDHWC = 'NDHWC'
    AMBIGUOUS = 'ambiguous'  # 4D/5D, both channels-first and channels-last contiguous
    OTHER = 'other'  # another rank, or a 4D/5D tensor dense in neither order (a permuted view)

    @property
    def is_channels_last(self) -> bool:
        return self in (Layout.NHWC, Layout.NDHWC)

    @property
    def is_channels_first(self) -> bool:
        return self in (Layout.NCHW, Layout.NCDHW)


class MemoryFormat(str, enum.Enum):
    """The memory format a model is given: channels first or channels last, whatever the rank.
    The one word for it in summaries, decisions, weight plans and logs; :class:`Layout` is what
    one tensor's strides show.

    Example:
        >>> MemoryFormat.CHANNELS_FIRST == 'channels_first', str(MemoryFormat.CHANNELS_LAST)
        (True, 'channels last')
    """

    CHANNELS_FIRST = 'channels_first'  # NCHW / NCDHW, PyTorch's default contiguous strides
    CHANNELS_LAST = 'channels_last'  # NHWC / NDHWC

    def __str__(self) -> str:
        return self.value.replace('_', ' ')


Batch = TypeVar('Batch')

_FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}
_NAMES = {4: (Layout.NCHW, Layout.NHWC), 5: (Layout.NCDHW, Layout.NDHWC)}
_CHANNELS_LAST_ORDER = {4: (1, 3, 2, 0), 5: (1, 4, 3, 2, 0)}  # dimensions from the fastest moving in memory


def channels_last_contiguous(tensor: torch.Tensor) -> bool:
    """``tensor.is_contiguous(memory_format=...)`` for its rank's channels-last format, answered from the strides
    where torch does not answer: inside ``torch.func.vmap`` (a batched tensor). False for other ranks.

    Example:
        >>> x = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last)
        >>> inside = []
        >>> _ = torch.func.vmap(lambda t: inside.append(channels_last_contiguous(t)) or t)(x.expand(5, -1, -1, -1, -1))
        >>> channels_last_contiguous(x), inside
        (True, [True])
    """
    fmt = channels_last_format(tensor)
    if fmt is None:
        return False
    try:
        return tensor.is_contiguous(memory_format=fmt)
    except RuntimeError:  # "NYI: querying is_contiguous inside of vmap for memory_format other than ..."
        expected, shape, strides = 1, tensor.shape, tensor.stride()
        for dim in _CHANNELS_LAST_ORDER[tensor.dim()]:  # torch's own test: size-1 dimensions take any stride
            if shape[dim] != 1:
                if strides[dim] != expected:
                    return False
                expected *= shape[dim]
        return True


def channels_last_format(tensor: torch.Tensor) -> Optional[torch.memory_format]:
    """``torch.channels_last`` for a 4D tensor, ``torch.channels_last_3d`` for 5D, else None."""
    return _FORMATS.get(tensor.dim())


def is_4d_or_5d(value: Any) -> bool:
    """Whether ``value`` is a 4D or 5D tensor: one that could go NHWC (NDHWC).

    Example:
        >>> is_4d_or_5d(torch.empty(2, 3, 4, 4)), is_4d_or_5d(torch.empty(2, 3)), is_4d_or_5d(None)
        (True, False, False)
    """
    return isinstance(value, torch.Tensor) and channels_last_format(value) is not None


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_READABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tensor subclass -> whether it answers reads


def unreadable_among(types: Any, values: Any) -> bool:
    """Whether a ``__torch_function__``'s ``types`` hold a tensor subclass whose tensors among ``values`` (the op's
    arguments) are not :func:`readable`: a lazy module's parameter before its shape is known (the op is its module's
    own initialization), an ``ExpandedWeight``.

    Example:
        >>> lazy = torch.nn.UninitializedParameter()
        >>> unreadable_among((type(lazy),), (lazy,)), unreadable_among((torch.Tensor,), (torch.zeros(1),))
        (True, False)
    """
    if all(kind in _PLAIN for kind in types):  # every op of plain tensors and parameters: one pass over its types
        return False
    return any(type(t) in types and not readable(t) for t in tree_leaves(values))


def readable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s strides and autograd node can be read: its subclass's ``__torch_function__`` answers
    (the ``ExpandedWeight`` that per-sample gradients put in a layer's weights handles a few ops and raises on the
    rest). Each subclass is tried once.

    Example:
        >>> readable(torch.zeros(2)), readable(torch.nn.Parameter(torch.zeros(2)))
        (True, True)
    """
    kind = type(tensor)
    if kind in _PLAIN:
        return True
    if kind not in _READABLE:
        try:
            tensor.stride(), tensor.grad_fn
            _READABLE[kind] = True
        except Exception:  # the subclass's own refusal, whatever it raises
            _READABLE[kind] = False
    return _READABLE[kind]


def layout_of(tensor: torch.Tensor) -> Layout:
    """The memory order of ``tensor``'s bytes (strides of size-1 dimensions do not count).

    Example:
        >>> layout_of(torch.empty(2, 3, 4, 4))
        <Layout.NCHW: 'NCHW'>
        >>> layout_of(torch.empty(2, 3, 4, 4, 4).to(memory_format=torch.channels_last_3d))
        <Layout.NDHWC: 'NDHWC'>
    """
    fmt = channels_last_format(tensor)
    if fmt is None:
        return Layout.OTHER
    first = tensor.is_contiguous()
    last = channels_last_contiguous(tensor)
    if first and last:
        return Layout.AMBIGUOUS
    channels_first, channels_last = _NAMES[tensor.dim()]
    if first:
        return channels_first
    if last:
        return channels_last
    return Layout.OTHER


def has_channels_last_strides(tensor: torch.Tensor) -> bool:
    """True when ``tensor``'s strides are exactly the channels-last ones for its shape.

    Stricter than ``is_contiguous(memory_format=...)``: for ambiguous shapes it also asks
    that the size-1 dimensions carry channels-last strides, as ``.to(memory_format=...)``
    writes them. False for tensors that are not 4D or 5D.
    """
    fmt = channels_last_format(tensor)
    if fmt is None:
        return False
    expected = torch.empty(tensor.shape, memory_format=fmt, device='meta').stride()
    return tensor.stride() == expected


def is_channels_last(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` is channels-last dense: NHWC, NDHWC, or ambiguous with real
    channels-last strides. The test used to decide whether restriding is needed."""
    fmt = channels_last_format(tensor)
    if fmt is None or not channels_last_contiguous(tensor):
        return False
    return layout_of(tensor) is not Layout.AMBIGUOUS or has_channels_last_strides(tensor)


def _require_tensor(value: Any, caller: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f'{caller}: expected a torch.Tensor, got a {type(value).__name__}; make it one (torch.as_tensor)'
        )


def to_channels_last(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` restrided to channels last (4D) or channels last 3D (5D).

    Returns ``tensor`` itself, without a copy, when it already is channels last (see
    :func:`is_channels_last`) or is not 4D/5D. Ambiguous shapes get the real channels-last
    strides.
    """
    _require_tensor(tensor, 'to_channels_last')
    fmt = channels_last_format(tensor)
    if fmt is None or is_channels_last(tensor):
        return tensor
    return tensor.to(memory_format=fmt)


def to_channels_first(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` restrided to the default contiguous (NCHW / NCDHW) order; itself, without a
    copy, when it already has exactly those strides or is not 4D/5D.

    Example:
        >>> x = to_channels_last(torch.randn(2, 3, 4, 4))
        >>> layout_of(to_channels_first(x))
        <Layout.NCHW: 'NCHW'>
    """
    _require_tensor(tensor, 'to_channels_first')
    if channels_last_format(tensor) is None:
        return tensor
    if tensor.stride() == torch.empty(tensor.shape, device='meta').stride():
        return tensor
    return tensor.to(memory_format=torch.contiguous_format)


def batch_to_channels_last(batch: Batch) -> Batch:
    """Every 4D/5D tensor in ``batch`` (a tensor, or the containers
    :mod:`~channels_last_algo.core.batch_tree` opens: tuples, lists, dicts, dataclasses, ...)
    restrided to channels last; tensors that already are, and all other values, are passed
    through untouched, without a copy, and ``batch`` itself is never changed.

    Example:
        >>> x = torch.randn(2, 3, 8, 8)
        >>> out = batch_to_channels_last({'image': x, 'label': torch.tensor([0, 1])})
        >>> out['image'].stride()
        (192, 1, 24, 3)
    """
    return _restride_tensors(batch, to_channels_last)


def batch_to_channels_first(batch: Batch) -> Batch:
    """Every 4D/5D tensor in ``batch`` restrided to NCHW / NCDHW (see :func:`batch_to_channels_last`)."""
    return _restride_tensors(batch, to_channels_first)


def _restride_tensors(batch: Batch, restride: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
    """``batch`` with ``restride`` applied to each of its tensors."""
    return map_leaves(batch, lambda path, leaf: restride(leaf) if isinstance(leaf, torch.Tensor) else leaf)
