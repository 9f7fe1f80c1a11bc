"""Copies that NCHW would have made aliases, kept in step with their originals while a watch follows the ops.

Where a watch (the view watch, the first batch's input search) runs a failing ``.view()`` on a
contiguous copy, or an NHWC tensor's ``.reshape()``, ``.flatten()`` or ``.contiguous()`` copies where
the NCHW tensor would have returned itself or a view, the result no longer shares memory with the
tensor the user holds. While that watch follows the ops, :class:`AliasedCopies` writes each in-place
change through: a write to the copy
(through the view: ``flat.mul_(2)``, ``flat[0] = 0``, ``torch.relu_(flat)``, ``out=flat``) is copied
back into the original, and a write to the original reaches the copy, so what either reads is what
NCHW would give, and autograd sees the write where NCHW has it. A copy can also be kept apart: the
watch returns a copy where NHWC has a view that NCHW would copy, and only hears of writes to it.

Example:
    >>> import torch
    >>> x = torch.arange(8.0).reshape(1, 2, 2, 2).to(memory_format=torch.channels_last)
    >>> copies = AliasedCopies()
    >>> flat = copies.view(torch.Tensor.view, x, (1, -1), {})
    >>> _ = flat.mul_(10)
    >>> copies.written(torch.Tensor.mul_, (flat, 10), {})
    >>> x.flatten().tolist()
    [0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.weak import TensorWeakRef

from channels_last_algo.core.nchw_twins import aliases

__all__ = ['AliasedCopies', 'same_memory', 'written_tensors']

_IN_PLACE_OPERATORS = frozenset(
    {'__setitem__'}
    | {
        f'__i{name}__'
        for name in ('add', 'sub', 'mul', 'truediv', 'floordiv', 'mod', 'pow', 'matmul', 'and', 'or', 'xor')
    }
    | {'__ilshift__', '__irshift__'}
)


def written_tensors(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func(*args, **kwargs)`` writes in place: the first argument of an in-place op
    (a name ending in ``_``, ``x[i] = v``, ``x += y``, ``inplace=True``) and the ``out=`` tensors.

    Example:
        >>> x = torch.zeros(2)
        >>> [t is x for t in written_tensors(torch.Tensor.add_, (x, 1), {})]
        [True]
        >>> written_tensors(torch.add, (x, 1), {})
        []
    """
    name = getattr(func, '__name__', '')
    in_place = (name.endswith('_') and not name.startswith('_')) or name in _IN_PLACE_OPERATORS
    first = [args[0]] if args and isinstance(args[0], torch.Tensor) else []
    written = first if in_place or kwargs.get('inplace') is True else []
    return written + [t for t in tree_leaves(kwargs.get('out')) if isinstance(t, torch.Tensor)]


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share one storage (one a view of the other, or both of a third)."""
    if a.device != b.device:
        return False
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() != 0
    except (RuntimeError, NotImplementedError):  # tensors with no storage of their own (sparse, fake)
        return False


class AliasedCopies:
    """The copies a watch made of tensors NCHW would have aliased, each kept in step with its original."""

    def __init__(self) -> None:
        # (original, copy, on_write, in_step): the copy lives as long as its views do, and holds its
        # original (``weight.data`` is a new tensor at each reading, gone as soon as it is viewed)
        self._pairs: list[tuple[torch.Tensor, TensorWeakRef, Optional[Callable[[], None]], bool]] = []

    def view(self, func: Any, tensor: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        """``func(tensor, *args, **kwargs)`` (a view) taken on a contiguous copy of ``tensor``. A view as another
        dtype (``.view(torch.int32)``) holds the copy's memory but not the copy itself: it is the one paired."""
        copy = tensor.contiguous()
        result = func(copy, *args, **kwargs)
        self.pair(tensor, result if isinstance(result, torch.Tensor) and result.dtype != copy.dtype else copy)
        return result

    def pair(
        self,
        original: torch.Tensor,
        copy: torch.Tensor,
        on_write: Optional[Callable[[], None]] = None,
        in_step: bool = True,
    ) -> None:
        """Keep ``copy`` in step with ``original`` from now on (``in_step``; else apart, as a copy NCHW
        makes of what NHWC aliases); ``on_write()`` runs the first time either is written."""
        self._pairs.append((original, TensorWeakRef(copy), on_write, in_step))

    def as_in_nchw(
        self,
        tensor: torch.Tensor,
        result: torch.Tensor,
        twin: torch.Tensor,
        twin_result: Any,
        on_write: Callable[[torch.Tensor, bool], Callable[[], None]],
    ) -> torch.Tensor:
        """``result`` of a shape op that views or copies (``tensor.reshape()``, ``.contiguous()``), aliasing ``tensor``
        where NCHW's op on ``tensor``'s NCHW ``twin`` gives an alias (``twin_result``): a copy NCHW would not make is
        kept in step with ``tensor``; a view NCHW would not make becomes a copy laid out as NCHW's, kept apart.
        ``on_write(tensor, in_step)`` gives what to call at the first write through either (see :meth:`pair`)."""
        in_nchw = aliases(twin, twin_result)
        if in_nchw == (result is tensor or same_memory(result, tensor)):
            return result
        if not in_nchw:  # autograd sees a copy
            shape, strides = twin_result.shape, twin_result.stride()
            result = torch.empty_strided(shape, strides, dtype=result.dtype, device=result.device).copy_(result)
        self.pair(tensor, result, on_write(tensor, in_nchw), in_step=in_nchw)
        return result

    def written(self, func: Any, args: tuple, kwargs: dict) -> None:
        """After ``func(*args, **kwargs)`` ran: where it wrote in place to a copy (or to an original),
        the same values go to the original (or to the copy). Called with the watch's mode off."""
        targets = written_tensors(func, args, kwargs) if self._pairs else []
        if not targets:
            return
        self._pairs = [pair for pair in self._pairs if pair[1]() is not None]
        for target in targets:
            for index, (original, reference, on_write, in_step) in enumerate(self._pairs):
                copy = reference()
                if copy is None:
                    continue
                values = copy if copy.dtype == original.dtype else copy.view(original.dtype)  # a dtype view's copy
                if same_memory(target, copy):
                    if in_step:
                        original.copy_(values.reshape(original.shape))
                elif same_memory(target, original):
                    if in_step:
                        values.copy_(original.reshape(values.shape))
                else:
                    continue
                if on_write is not None:
                    self._pairs[index] = (original, reference, None, in_step)
                    on_write()
