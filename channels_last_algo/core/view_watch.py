"""The mode a :class:`~channels_last_algo.core.viewed_outputs.ViewedOutputs` watch runs while it
watches: it follows which module's output each NHWC tensor derives from, runs the views NHWC strides
cannot take, and the ``.as_strided()`` reads that assume NCHW's memory, on channels-first copies,
draws random numbers in NCHW's memory order, and keeps in step the copies a ``.reshape()`` makes
where NCHW has a view, telling its owner where each was used.

Example:
    >>> import torch
    >>> class Owner:
    ...     found = []
    ...     def _found(self, origins, where, how):
    ...         self.found.append(sorted(type(m).__name__ for m in origins))
    ...     def _weights_viewed(self, why):
    ...         return False
    ...     def weight_gradient(self, tensor):
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
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch.autograd.function import BackwardCFunction, Function
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from channels_last_algo.core.aliased_copies import AliasedCopies
from channels_last_algo.core.audit import exit_copies
from channels_last_algo.core.batch_tree import BatchTensor
from channels_last_algo.core.extension_ops import OP_TYPES, extension_op, run_on_contiguous
from channels_last_algo.core.given_strides import first_element_only, read_as_in_nchw, written_for_nchw
from channels_last_algo.core.late_views import original, passing_through, refused_by_strides
from channels_last_algo.core.layout import is_4d_or_5d, readable, unreadable_among
from channels_last_algo.core.nchw_twins import CONVOLUTIONS, COPY_OR_VIEW, SHAPE_OPS, NchwTwins, laid_out_by_weight
from channels_last_algo.core.random_draws import DRAWS, drawn_in, nchw_draw_order

__all__ = [
    'GRADIENT_OPS',
    'VIEWS',
    'ViewWatch',
    'calling_code',
    'contiguous_gradient',
    'hook_watched',
    'nhwc',
    'watched_function',
]

VIEWS = (torch.Tensor.view, torch.Tensor.view_as)
_AS_STRIDED = (torch.Tensor.as_strided, torch.as_strided)  # strides given outright: they index NCHW's memory
GRADIENT_OPS = (torch.autograd.grad,)
"""Ops that return gradients: no module and no batch tensor makes them, whatever their inputs' makers."""

_INTERNAL = (os.path.dirname(torch.__file__), os.path.dirname(__file__))  # frames that are not the user's


def _caller() -> Any:
    """The frame of the code that called the view: the first one outside torch and this package's core."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame = frame.f_back
    return frame


def _op_caller() -> tuple[Any, bool]:
    """The frame of the code that called the op this watch handles, past the modes that passed it on
    and the late-view wrappers, and whether another view watch was among them (one entered above this one)."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code is not _HANDLER:
        frame = frame.f_back
    frame, above = frame.f_back, False
    while frame.f_back is not None and (frame.f_code.co_name == '__torch_function__' or passing_through(frame.f_code)):
        above = above or frame.f_code is _HANDLER
        frame = frame.f_back
    return frame, above


def calling_code() -> str:
    """``file:line`` of the code that called the op a mode handles (past torch and this package's core)."""
    frame = _caller()
    return f'{frame.f_code.co_filename}:{frame.f_lineno}'


def written_through(func: Any, report: Callable[[torch.Tensor, str, str], None]) -> Callable[..., Any]:
    r"""What :meth:`~channels_last_algo.core.aliased_copies.AliasedCopies.as_in_nchw` calls for a copy or view
    ``func`` made of a tensor, here: given the tensor and whether NCHW aliases it there, the call that ``report``\ s
    where and how, at the first write through either."""

    def on_write(tensor: torch.Tensor, in_step: bool) -> Callable[[], None]:
        where, name = calling_code(), getattr(func, '__name__', 'reshape')
        kind = '(a copy here, an alias in NCHW)' if in_step else '(an alias here, a copy in NCHW)'
        how = f'written in place through the .{name}() at {where} {kind}'
        return lambda: report(tensor, where, how)

    return on_write


def contiguous_gradient(grad: torch.Tensor) -> Optional[torch.Tensor]:
    """A gradient as NCHW has it, for an extension op's backward or a weight's hooks."""
    if grad.is_contiguous():
        return None
    with exit_copies():
        return grad.contiguous()


def _no_twin(tensor: torch.Tensor) -> bool:
    return False


def nhwc(tensor: Any) -> bool:
    """A 4D/5D tensor that is not contiguous: NHWC, or a slice or other view of an NHWC tensor."""
    return is_4d_or_5d(tensor) and not tensor.is_contiguous()


class ViewWatch(TorchFunctionMode):
    """Follows which module's output each NHWC tensor derives from; runs failing views on copies.

    ``owner`` hears what is found: ``owner._found(modules, where, how)`` for a tensor the code at ``where`` uses in a
    way (``how``) that needs it channels first, ``owner._weights_viewed(why)`` for such a use of a weight or of a
    weight's gradient (``owner.weight_gradient(tensor)``; True where the weights are contiguous now),
    ``owner.gradient_hook_found(weight, how)`` for such a use of the gradient a hook on ``weight`` is given
    (``hooked``), and ``owner.extension_found(name, where)`` for an extension op given 4D/5D tensors. ``step``: the
    watch runs a backward hook or a custom Function's backward, which autograd calls outside every mode, during a
    step that ``step`` watches: a tensor the hook did not make has the origins and the NCHW twin ``step`` knows (an
    activation a forward hook kept; a map NHWC in NCHW too), and no origins where it saw none (a gradient, whose
    layout its consumers decide). ``light``: only extension ops are watched. ``batch_path(tensor)``: the path of a
    batch tensor made NHWC by the guard, an origin (:class:`BatchTensor`) of what derives from it.
    """

    def __init__(
        self,
        owner: Any,
        step: Optional[ViewWatch] = None,
        light: bool = False,
        hooked: Optional[tuple] = None,
        batch_path: Callable[[torch.Tensor], Optional[tuple]] = lambda tensor: None,
    ) -> None:
        super().__init__()
        self.owner = owner
        self.batch_path = batch_path
        self.step = step  # the watch of the step whose backward runs this one's hook
        self.hooked = hooked  # a hook on a weight: (the weight, the gradient the hook is given)
        self.light = light  # extension ops only: once the views and reshapes are placed
        self.made: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> the module that returned it
        self.derived: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> modules it derives from
        self.calls: dict[torch.nn.Module, int] = {}  # module -> its calls this step
        self.copies = AliasedCopies()  # copies of tensors NCHW aliases, kept in step with their originals
        self.flattened: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensors of other ranks strided by NHWC ones
        self.twins = NchwTwins() if step is None else step.twins  # what NCHW would have (a view or a copy)
        self.functions: dict[type, Optional[type]] = {}  # a custom autograd Function -> its watched subclass

    def origins(self, tensor: torch.Tensor) -> frozenset:
        made = self.made.get(tensor)
        return frozenset({made}) if made is not None else self._derived(tensor)

    def _derived(self, tensor: torch.Tensor) -> frozenset:
        """The origins ``tensor`` derives from, the batch tensor it is, or what the step's watch knows of it."""
        if tensor in self.derived:
            return self.derived[tensor]
        path = self.batch_path(tensor)
        if path is not None:
            return frozenset({BatchTensor(path)})
        return frozenset() if self.step is None else self.step.makers(tensor)

    def makers(self, tensor: torch.Tensor) -> frozenset:
        """Where to make ``tensor`` channels first: the module that returned it, unless that module runs
        more than once a step (a shared pool), then the modules (or batch tensors) its input came from."""
        made = self.made.get(tensor)
        if made is not None and (self.calls.get(made, 0) <= 1 or not self.derived.get(tensor)):
            return frozenset({made})
        return self._derived(tensor)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        func = original(func)  # torch's view, where a late-view wrapper is on (core/late_views.py)
        op = extension_op(func) if isinstance(func, OP_TYPES) else None
        if torch.compiler.is_compiling() or (self.light and op is None):
            return func(*args, **kwargs)  # a compiled graph: not followed
        caller, above = _op_caller()
        if above:
            return func(*args, **kwargs)  # a watch above this one follows it
        if caller.f_code.co_filename.startswith(_INTERNAL[1]) or unreadable_among(types, (args, kwargs)):
            self._watch_custom_backwards(args, kwargs)  # this package's own code runs it, or a tensor subclass's
            return func(*args, **kwargs)  # (a lazy parameter's initialization, an ExpandedWeight's op): not followed
        by_torch = caller.f_code.co_filename.startswith(_INTERNAL[0])  # torch's own code chose the op and its strides
        if op is not None and any(is_4d_or_5d(t) for t in tree_leaves((args, kwargs))):
            return self._extension(op, args, kwargs)
        if self.light:
            return func(*args, **kwargs)
        if func in VIEWS and self.strided_by_nhwc(args[0]):
            return self._view(func, args, kwargs, by_torch)
        if func in _AS_STRIDED and self.strided_by_nhwc(args[0]):
            return self._as_strided(func, args, kwargs, by_torch)
        self._watch_custom_backwards(args, kwargs)
        if func is torch.Tensor.register_hook and is_4d_or_5d(args[0]):
            args = (args[0], hook_watched(args[1], self.owner), *args[2:])
        order = self._nchw_draw_order(func, args, kwargs) if func in DRAWS and args else None
        if order is not None:  # random numbers NCHW puts on other elements
            with exit_copies():
                result = drawn_in(func, args, kwargs, order)
        else:
            result = self._as_in_nchw(func, args, kwargs, func(*args, **kwargs), by_torch)
        self.copies.written(func, args, kwargs)
        if func not in GRADIENT_OPS:
            self._follow(args, kwargs, result, func in SHAPE_OPS, func in CONVOLUTIONS)
            if func not in SHAPE_OPS:
                self.twins.follow(func, args, kwargs, result)
        return result

    def _as_in_nchw(self, func: Any, args: tuple, kwargs: dict, result: Any, by_torch: bool) -> Any:
        """``result`` of a shape op, aliasing ``args[0]`` where NCHW would: a copy NCHW would not make is
        kept in step with ``args[0]`` while the watch lasts; a view NCHW would not make is returned as
        a copy, kept apart. A write through either notes where the op ran."""
        ran = self.twins.run(func, args, kwargs)
        if ran is None or by_torch:
            return result
        twin, twin_result = ran
        if func in COPY_OR_VIEW:
            result = self.copies.as_in_nchw(
                args[0], result, twin, twin_result, written_through(func, self._written_through)
            )
        self.twins.note(result, twin_result)
        return result

    def _written_through(self, tensor: torch.Tensor, where: str, how: str) -> None:
        """A write went through what a shape op at ``where`` made of ``tensor``, or reached ``tensor``
        while that lives: from now on ``tensor`` should be channels first, where NCHW's views are."""
        if not self._weight_use(tensor, how):
            self.owner._found(self.makers(tensor), where, how)

    def _weight_use(self, tensor: torch.Tensor, how: str) -> bool:
        """Whether ``tensor``, used as ``how`` says, is a weight or a weight's gradient, and the owner made
        the weights (and their gradients) contiguous for it; or the gradient a hook on a weight is given,
        which the owner has reach that weight's hooks contiguous from the next step on."""
        if self.hooked is not None and tensor is self.hooked[1]:
            self.owner.gradient_hook_found(self.hooked[0], how)
            return True
        if isinstance(tensor, torch.nn.Parameter):
            return self.owner._weights_viewed(f'a weight is {how}')
        return self.owner.weight_gradient(tensor) and self.owner._weights_viewed(f"a weight's gradient is {how}")

    def _extension(self, op: Any, args: tuple, kwargs: dict) -> Any:
        """An extension op runs as in NCHW: on contiguous copies of the NHWC tensors it is given, and its
        backward on contiguous gradients. Autograd hands the op's backward whatever layout the layers
        after it give, so a light watch stays on for every step (``ViewedOutputs.extension_found``)."""
        self.owner.extension_found(op.name(), calling_code())
        strided = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and self.strided_by_nhwc(t)]
        with exit_copies():  # copies made on purpose: exits in the audit, not breaks
            result = run_on_contiguous(op, args, kwargs, strided)
        for tensor in tree_leaves(result):
            if is_4d_or_5d(tensor) and tensor.requires_grad:
                tensor.register_hook(contiguous_gradient)
        return result

    def _watch_custom_backwards(self, args: tuple, kwargs: dict) -> None:
        """The backward of each custom autograd Function that made a tensor among ``args`` runs under a watch of
        its own (autograd calls it outside every mode, as a hook), set on its node of this step's graph: the user's,
        and torch's written as a user's would be (``ExpandedWeight``'s per-sample gradients view theirs). torch's
        machinery runs as it is: a ``torch.library`` op's (its backward gets contiguous gradients as an extension
        op's), a compiled graph's, a checkpoint's."""
        for tensor in tree_leaves((args, kwargs)):
            node = tensor.grad_fn if isinstance(tensor, torch.Tensor) and readable(tensor) else None
            if isinstance(node, BackwardCFunction) and node._forward_cls is type(node)._forward_cls:
                function = node._forward_cls
                if function not in self.functions:
                    machinery = f'{function.__module__}.'.startswith(('torch._', 'torch.utils.checkpoint.'))
                    self.functions[function] = None if machinery else watched_function(function, self.owner)
                if self.functions[function] is not None:
                    node._forward_cls = self.functions[function]

    def strided_by_nhwc(self, tensor: Any) -> bool:
        """An NHWC tensor, or one of another rank whose strides an NHWC one set (``z.flatten(2)``)."""
        return nhwc(tensor) or (isinstance(tensor, torch.Tensor) and tensor in self.flattened)

    def _follow(self, args: tuple, kwargs: dict, result: Any, shape_op: bool, convolution: bool = False) -> None:
        """Note where ``result``'s strided tensors came from, and, after a shape op, those it made of
        an NHWC tensor (``z.permute(0, 2, 3, 1)``, contiguous); a convolution's not from batch tensors."""
        twinned = self.twins.__contains__ if shape_op else _no_twin
        outputs = [
            t for t in tree_leaves(result) if isinstance(t, torch.Tensor) and (not t.is_contiguous() or twinned(t))
        ]
        if not outputs:
            return
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not any(self.strided_by_nhwc(t) or twinned(t) for t in inputs):  # NHWC outputs start a line
            outputs = [t for t in outputs if nhwc(t)]
            if not outputs:
                return
        origins = frozenset().union(*(self.origins(t) for t in inputs))
        if convolution:  # from its module, not a batch tensor; from no input where a channels-last weight lays it out
            keep = not laid_out_by_weight(args, kwargs)
            origins = frozenset(o for o in origins if keep and not isinstance(o, BatchTensor))
        for tensor in outputs:
            if not nhwc(tensor) and not tensor.is_contiguous():
                self.flattened[tensor] = True
            if origins:
                self.derived[tensor] = origins

    def _as_strided(self, func: Any, args: tuple, kwargs: dict, by_torch: bool) -> Any:
        """``z.as_strided(size, stride)``: strides written for NCHW memory read other elements of NHWC
        memory, so it runs on a copy laid out as NCHW has it (writes through it land in ``z``), and
        ``z``'s module makes it channels first from the next step on. Strides built from ``z.stride()``, and
        any that read only ``z``'s first element, read the same elements in either layout: they run as they are."""
        tensor, given = args[0], dict(zip(('size', 'stride', 'storage_offset'), args[1:]), **kwargs)
        offset, twin = given.get('storage_offset'), self.twins.twin(tensor)
        known = twin is not None and twin.is_contiguous() and (offset is None or offset >= twin.storage_offset())
        same = not known or by_torch or first_element_only(tensor, given['size'], offset)
        if same or not written_for_nchw(twin, tensor, given['stride']):
            return func(*args, **kwargs)  # NCHW's memory is unknown, or the strides are this tensor's own
        where = calling_code()
        how = f'read through the .as_strided() at {where}'
        if not self._weight_use(tensor, how):
            self.owner._found(self.makers(tensor), where, how)
        elif not nhwc(tensor):
            return func(*args, **kwargs)  # the weights are contiguous now: their own memory is NCHW's
        shift = [] if offset is None else [offset - twin.storage_offset()]  # into a copy that starts at the tensor
        strides = read_as_in_nchw(twin, tensor, given['stride'])
        return self.copies.view(torch.Tensor.as_strided, tensor, (given['size'], strides, *shift), {})

    def _nchw_draw_order(self, func: Any, args: tuple, kwargs: dict) -> Optional[tuple]:
        """The order NCHW draws ``func``'s random numbers in, where it differs from this tensor's
        (:mod:`~channels_last_algo.core.random_draws`): the tensor's module makes it channels first from the
        next step on. Also where torch's own code draws (``nn.Dropout``): the numbers are the same either way."""
        twin = self.twins.twin(args[0])
        order = None if twin is None else nchw_draw_order(func, args, kwargs, twin)
        if order is None:
            return None
        where = calling_code()
        how = f'given random numbers by {getattr(func, "__name__", "a random op")} at {where}'
        if not self._weight_use(args[0], how):
            self.owner._found(self.makers(args[0]), where, how)
        return order

    def _view(self, func: Any, args: tuple, kwargs: dict, by_torch: bool) -> Any:
        try:
            result = func(*args, **kwargs)
        except RuntimeError as error:
            if not refused_by_strides(error):
                raise
        else:  # a view NHWC strides can take, whose own views may not (``z.view(n, c, h * w).view(n, -1)``)
            result = self._as_in_nchw(func, args, kwargs, result, by_torch)
            self._follow(args, kwargs, result, shape_op=True)
            return result
        where = calling_code()
        if not self._weight_use(args[0], f'viewed at {where}'):
            self.owner._found(self.makers(args[0]), where, f'viewed at {where}')
        elif not nhwc(args[0]):
            return func(*args, **kwargs)  # the weights (and their gradients) are contiguous now: a true view
        return self._as_in_nchw(func, args, kwargs, self.copies.view(func, args[0], args[1:], kwargs), by_torch)


_HANDLER = ViewWatch.__torch_function__.__code__  # where a view watch takes an op


def hook_watched(
    hook: Callable[..., Any], owner: Any, weight: Optional[torch.nn.Parameter] = None
) -> Callable[..., Any]:
    """``hook`` (a backward hook, which autograd calls outside every mode) run under a watch of its own
    that reports to ``owner``; ``weight``: the hook is on that weight, and given its gradient."""

    def watched(*args: Any, **kwargs: Any) -> Any:
        step = getattr(owner, 'watch', None)  # a ViewedOutputs' watch of the step under way
        with ViewWatch(owner, step=step, hooked=None if weight is None else (weight, args[0])):
            return hook(*args, **kwargs)

    return watched


def watched_function(function: type, owner: Any) -> type:
    """A subclass of the custom autograd Function ``function`` whose backward (or ``vjp``) runs as
    :func:`hook_watched` runs a hook: under a watch of its own that reports to ``owner``.

    Example:
        >>> class Double(torch.autograd.Function):
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         return 2 * x
        ...     @staticmethod
        ...     def backward(ctx, grad):
        ...         return 2 * grad
        >>> watched = watched_function(Double, owner=None)
        >>> issubclass(watched, Double), watched.backward is Double.backward
        (True, False)
    """
    name = 'vjp' if function.vjp is not Function.vjp else 'backward'  # autograd calls the one defined
    return type(function.__name__, (function,), {name: staticmethod(hook_watched(getattr(function, name), owner))})
