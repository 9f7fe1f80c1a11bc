"""The mode a :class:`~channels_last_algo.core.viewed_outputs.ViewedOutputs` watch runs while it
watches: it follows which module's output each NHWC tensor derives from, runs the views NHWC strides
cannot take on channels-first copies, and keeps in step the copies a ``.reshape()`` makes where NCHW
has a view, telling its owner where each was used.

Example:
    >>> import torch
    >>> class Owner:
    ...     found = []
    ...     def _found(self, origins, where, how):
    ...         self.found.append(sorted(type(m).__name__ for m in origins))
    ...     def _weights_viewed(self, why):
    ...         return False
    >>> conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    >>> x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    >>> owner = Owner()
    >>> with ViewWatch(owner) as watch:
    ...     z = conv(x)
    ...     watch.made[z] = conv          # what ViewedOutputs notes as a module call returns
    ...     flat = z.view(2, -1)          # NHWC strides cannot take it: runs on a copy
    >>> owner.found, flat.is_contiguous()
    ([['Conv2d']], True)
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from channels_last_algo.core.aliased_copies import AliasedCopies, same_memory
from channels_last_algo.core.layout import channels_last_format

__all__ = ['ViewWatch', 'nhwc']

_VIEWS = (torch.Tensor.view, torch.Tensor.view_as)
# ops that return a view of a contiguous tensor (or the tensor itself), and a copy where NHWC strides
# cannot take the shape
_COPY_OR_VIEW = frozenset(
    {torch.Tensor.reshape, torch.Tensor.reshape_as, torch.Tensor.flatten, torch.Tensor.unflatten}
    | {torch.reshape, torch.flatten, torch.unflatten, torch.Tensor.contiguous}
)
# ops whose result is contiguous where their input is: a view of a tensor contiguous in NCHW is too
_SHAPE_ONLY = _COPY_OR_VIEW | {*_VIEWS, torch.Tensor.squeeze, torch.Tensor.unsqueeze, torch.squeeze, torch.unsqueeze}


_INTERNAL = (os.path.dirname(torch.__file__), os.path.dirname(__file__))  # frames that are not the user's


def _caller() -> Any:
    """The frame of the code that called the view: the first one outside torch and this package's core."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame = frame.f_back
    return frame


def _where(frame: Any) -> str:
    return f'{frame.f_code.co_filename}:{frame.f_lineno}'


def nhwc(tensor: Any) -> bool:
    """A 4D/5D tensor that is not contiguous: NHWC, or a slice or other view of an NHWC tensor."""
    return isinstance(tensor, torch.Tensor) and channels_last_format(tensor) is not None and not tensor.is_contiguous()


class ViewWatch(TorchFunctionMode):
    """Follows which module's output each NHWC tensor derives from; runs failing views on copies.

    ``owner`` hears what is found: ``owner._found(modules, where, how)`` for a tensor the code at
    ``where`` uses in a way (``how``) that needs it channels first, and ``owner._weights_viewed(why)``
    for such a use of a weight (True where the weights are contiguous now). ``in_hook``: the watch runs
    a tensor hook, whose gradient no module made.
    """

    def __init__(self, owner: Any, in_hook: bool = False) -> None:
        super().__init__()
        self.owner = owner
        self.in_hook = in_hook  # in a tensor hook: its gradient's layout is its consumers', no module's
        self.made: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> the module that returned it
        self.derived: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> modules it derives from
        self.calls: dict[torch.nn.Module, int] = {}  # module -> its calls this step
        self.copies = AliasedCopies()  # copies of tensors NCHW aliases, kept in step with their originals
        self.flattened: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensors of other ranks strided by NHWC ones
        self.dense_in_nchw: WeakIdKeyDictionary = WeakIdKeyDictionary()  # views that NCHW has contiguous

    def origins(self, tensor: torch.Tensor) -> frozenset:
        made = self.made.get(tensor)
        return frozenset({made}) if made is not None else self.derived.get(tensor, frozenset())

    def makers(self, tensor: torch.Tensor) -> frozenset:
        """The modules to make ``tensor`` channels first at: the module that returned it, unless that
        module runs more than once a step (a shared pool), then the modules its input came from."""
        made = self.made.get(tensor)
        if made is not None and (self.calls.get(made, 0) <= 1 or not self.derived.get(tensor)):
            return frozenset({made})
        return self.derived.get(tensor, frozenset())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # a compiled graph: not followed
            return func(*args, **kwargs)
        if func in _VIEWS and self.strided_by_nhwc(args[0]):
            return self._view(func, args, kwargs)
        if func is torch.Tensor.register_hook and channels_last_format(args[0]) is not None:
            args = (args[0], self._watched_hook(args[1]), *args[2:])
        result = func(*args, **kwargs)
        self.copies.written(func, args, kwargs)
        if func in _SHAPE_ONLY and self.contiguous_in_nchw(args[0]):
            self._reshaped(func, args[0], result)
        self._follow(args, kwargs, result)
        return result

    def contiguous_in_nchw(self, tensor: Any) -> bool:
        """A dense NHWC tensor (whose NCHW twin is contiguous), or a view of one that NCHW has contiguous."""
        if not isinstance(tensor, torch.Tensor):
            return False
        fmt = channels_last_format(tensor)
        dense_nhwc = fmt is not None and tensor.is_contiguous(memory_format=fmt) and not tensor.is_contiguous()
        return dense_nhwc or tensor in self.dense_in_nchw

    def _reshaped(self, func: Any, tensor: torch.Tensor, result: Any) -> None:
        """``result = func(tensor, ...)`` changed only the shape of a tensor NCHW has contiguous: NCHW
        would return a view (or ``tensor`` itself). A view is followed; a copy is kept in step with
        ``tensor`` while the watch lasts, and a write through either notes where it was made."""
        if not isinstance(result, torch.Tensor):
            return
        if same_memory(result, tensor):
            if not result.is_contiguous():
                self.dense_in_nchw[result] = True
            return
        if func in _COPY_OR_VIEW:
            where = _where(_caller())
            name = getattr(func, '__name__', 'reshape')
            self.copies.pair(tensor, result, lambda: self._written_through(tensor, name, where))

    def _written_through(self, tensor: torch.Tensor, name: str, where: str) -> None:
        """A write went through the copy ``.{name}()`` made of ``tensor`` at ``where``, or reached ``tensor``
        while that copy lives: from now on the copy should be a view again."""
        how = f'written in place through the .{name}() at {where} (a copy here, an alias in NCHW)'
        if isinstance(tensor, torch.nn.Parameter) and self.owner._weights_viewed(f'a weight is {how}'):
            return
        self.owner._found(frozenset() if self.in_hook else self.makers(tensor), where, how)

    def _watched_hook(self, hook: Any) -> Any:
        """``hook`` run under a watch of its own: autograd calls tensor hooks outside this mode."""

        def watched(grad: torch.Tensor) -> Any:
            with ViewWatch(self.owner, in_hook=True):
                return hook(grad)

        return watched

    def strided_by_nhwc(self, tensor: Any) -> bool:
        """An NHWC tensor, or one of another rank whose strides an NHWC one set (``z.flatten(2)``)."""
        return nhwc(tensor) or (isinstance(tensor, torch.Tensor) and tensor in self.flattened)

    def _follow(self, args: tuple, kwargs: dict, result: Any) -> None:
        outputs = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor) and not t.is_contiguous()]
        if not outputs:
            return
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not any(self.strided_by_nhwc(t) for t in inputs):  # only NHWC outputs start a strided line
            outputs = [t for t in outputs if nhwc(t)]
            if not outputs:
                return
        origins = frozenset().union(*(self.origins(t) for t in inputs))
        for tensor in outputs:
            if not nhwc(tensor):
                self.flattened[tensor] = True
            if origins:
                self.derived[tensor] = origins

    def _view(self, func: Any, args: tuple, kwargs: dict) -> Any:
        try:
            result = func(*args, **kwargs)
        except RuntimeError as error:
            if 'view size is not compatible' not in str(error):
                raise
        else:  # a view NHWC strides can take, whose own views may not (``z.view(n, c, h * w).view(n, -1)``)
            if self.contiguous_in_nchw(args[0]):
                self._reshaped(func, args[0], result)
            self._follow(args, kwargs, result)
            return result
        where = _where(_caller())
        if isinstance(args[0], torch.nn.Parameter) and self.owner._weights_viewed(f'a weight is viewed at {where}'):
            return func(*args, **kwargs)  # the weights are contiguous now: a true view
        self.owner._found(frozenset() if self.in_hook else self.makers(args[0]), where, f'viewed at {where}')
        return self.copies.view(func, args[0], args[1:], kwargs)
