"""The layout policy of one module's forward: torch calls that keep the layout of their NHWC operands.

A ``TorchFunctionMode`` that :mod:`~channels_last_algo.core.op_repair` puts in force while a
repaired module's own forward runs. Every torch call goes through it, and it keeps the op's output
and gradient in the layout of its NHWC operands:

- ``contiguous()`` (or ``clone`` to the contiguous format) of an NHWC tensor copies it to dense
  NHWC instead of NCHW: the same one copy. A ``view`` that needs the NCHW order then gets it,
  from an NCHW copy made there;
- a channel slice (``x[:, :k]``) of an NHWC tensor that needs a gradient is the same view, whose
  backward builds its zero-padded gradient in NHWC (``slice_backward`` builds it NCHW);
- ``x.new_zeros(x.shape)`` (``new_ones``, ``new_empty``) of an NHWC ``x`` is made NHWC;
- an op that meets NHWC and channels-first operands (a ``cat`` with an NCHW branch, an ``add`` of
  an attention output reshaped to N x C x H x W) gets its channels-first operands copied to NHWC,
  and so writes NHWC itself; a ``cat`` or ``stack`` copies a non-dense operand (an expanded pooled
  branch) too. Any other op that takes NHWC and returns channels first has its output copied;
- where the audit found an activation's backward breaking there (its input came channels first,
  its gradient NHWC), the functional activations run on an NHWC copy of their input;
- the gradient that arrives at an op's output, and the gradients it hands back to its NHWC
  inputs (the expanded gradient of a global ``mean``), are copied to NHWC where they are
  channels first, before they reach the next op.

Each copy runs as the op ``channels_last_algo::restore_channels_last`` naming the module, so the
audit lists it apart from breaks, with its bytes (``report.fallbacks``). An op that already keeps
NHWC costs only the policy's look at it.

Example:
    >>> import torch
    >>> x = torch.randn(2, 8, 4, 4).to(memory_format=torch.channels_last)
    >>> with OpLayoutPolicy('block', found=()):
    ...     y = x.contiguous()
    >>> y.is_contiguous(memory_format=torch.channels_last), y.is_contiguous()
    (True, False)
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

from channels_last_algo.core.audit import FALLBACK_OP
from channels_last_algo.core.layout import Layout, layout_of

__all__ = ['OpLayoutPolicy', 'restore_channels_last']

_FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}


@torch.library.custom_op(FALLBACK_OP, mutates_args=())
def restore_channels_last(x: torch.Tensor, where: str) -> torch.Tensor:
    """A channels-last copy of the 4D/5D tensor ``x``; ``where`` names the module, for the audit."""
    return x.clone(memory_format=_FORMATS[x.dim()])


@restore_channels_last.register_fake
def _restore_channels_last_fake(x: torch.Tensor, where: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=_FORMATS[x.dim()])


def _restore_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad, None


restore_channels_last.register_autograd(_restore_backward)


def _channels_last_ordered(t: Any) -> bool:
    """True for a 4D/5D tensor whose channels are its innermost dimension: NHWC, or a view of
    NHWC such as a channel slice (dense in neither order). Ambiguous tensors are not."""
    if not isinstance(t, torch.Tensor) or t.dim() not in _FORMATS or t.shape[1] < 2:
        return False
    layout = layout_of(t)
    if layout is not Layout.OTHER:
        return layout.is_channels_last
    spatial = [t.stride(d) for d in range(2, t.dim()) if t.shape[d] > 1]
    return t.stride(1) == 1 and bool(spatial) and min(spatial) >= t.shape[1]


def _late(t: torch.Tensor, join: bool) -> bool:
    """True for an operand the policy copies to NHWC: channels first, or (``join``) not NHWC-ordered
    and not ambiguous, such as an expanded tensor."""
    if _channels_first(t):
        return True
    return join and not _channels_last_ordered(t) and layout_of(t) is not Layout.AMBIGUOUS


def _tensors_in(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among an op's arguments and in their lists (``cat``'s): torch ops nest no deeper,
    and a pytree walk costs more than the op on small tensors."""
    found = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(item for item in value if isinstance(item, torch.Tensor))
    return found


def _image_like(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() in _FORMATS


def _hookable(t: torch.Tensor) -> bool:
    """True for an op's result whose gradient the policy keeps NHWC: not a view, or a view that keeps NHWC."""
    return not t._is_view() or _channels_last_ordered(t)


def _channels_first(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() in _FORMATS and layout_of(t).is_channels_first


class _ChannelSlice(torch.autograd.Function):
    """``x[index]`` of an NHWC tensor, whose backward pads the gradient with zeros in NHWC."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, index: Any) -> torch.Tensor:
        ctx.shape, ctx.dtype, ctx.device, ctx.index = x.shape, x.dtype, x.device, index
        return x[index]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        fmt = _FORMATS[len(ctx.shape)]
        padded = torch.empty(ctx.shape, dtype=ctx.dtype, device=ctx.device, memory_format=fmt).zero_()
        padded[ctx.index] = grad
        return padded, None


def _basic_index(index: Any) -> bool:
    """True for an index of slices and Ellipsis only (no tensors, lists or integers): a strided view."""
    items = index if isinstance(index, tuple) else (index,)
    return all(isinstance(item, slice) or item is Ellipsis for item in items)


class _ByIdentity:
    """Values keyed by tensor identity, dropped with the tensor (a WeakKeyDictionary compares tensors
    with ``==``, which is elementwise)."""

    def __init__(self):
        self._items: dict[int, tuple[weakref.ref, Any]] = {}

    def put(self, tensor: torch.Tensor, value: Any) -> None:
        key = id(tensor)
        self._items[key] = (weakref.ref(tensor, lambda _: self._items.pop(key, None)), value)

    def get(self, tensor: Any) -> Any:
        item = self._items.get(id(tensor))
        return item[1] if item is not None and item[0]() is tensor else None


class OpLayoutPolicy(TorchFunctionMode):
    """The layout policy of the module at path ``where``, whose audit found the aten ops ``found``
    (see the module docstring)."""

    def __init__(self, where: str, found: tuple[str, ...]):
        super().__init__()
        self.where = where
        # an activation's gradient came NHWC to its channels-first input: activations run on NHWC copies
        self.activate_nhwc = any(op.split('.')[1] in _ACTIVATION_BACKWARDS for op in found)
        self.actions = 0  # how many times it changed a layout, for pruning
        self.kept = _ByIdentity()  # NHWC copies made for contiguous()
        self.slices = _ByIdentity()  # channel slice -> (tensor, index)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        special = self._special(func, args, kwargs)
        if special is not _NOT_SPECIAL:
            return special
        args, kwargs = self._operands(func, args, kwargs)
        return self._follow(func(*args, **kwargs), args, kwargs)

    def _special(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """The calls the policy runs its own way; ``_NOT_SPECIAL`` for the others."""
        first = args[0] if args else None
        if func in _CONTIGUOUS and _channels_last_ordered(first) and _asks_contiguous(func, args, kwargs):
            return self._keep(first)
        if func is torch.Tensor.view and self.kept.get(first):
            return self._view(first, args[1:], kwargs)
        if func is torch.Tensor.__getitem__ and _sliceable(first, args[1]):
            return self._slice(first, args[1])
        sliced = self.slices.get(first)
        if sliced is not None and _in_place(func):  # on the plain view: the custom one may not change
            base, index = sliced
            return func(base[index], *args[1:], **kwargs)
        if func in _NEW_TENSORS and _channels_last_ordered(first):
            return self._new(func, first, args[1:], kwargs)
        if self.activate_nhwc and func in _ACTIVATIONS and _channels_first(first):
            return self._activate(func, first, args[1:], kwargs)
        return _NOT_SPECIAL

    def _activate(self, func: Any, x: torch.Tensor, rest: tuple, kwargs: dict) -> torch.Tensor:
        """An activation of a channels-first input (an attention block's output, reshaped from tokens)
        in a module whose breaks say its gradient comes NHWC: run on an NHWC copy, so that forward
        output and backward (``threshold_backward``, ``gelu_backward``) are NHWC. ``inplace=True``
        acts on the copy, whose result the functional form returns."""
        self.actions += 1
        return self._follow(func(restore_channels_last(x, self.where), *rest, **kwargs), (x, *rest), kwargs)

    def _new(self, func: Any, x: torch.Tensor, size: tuple, kwargs: dict) -> torch.Tensor:
        """``x.new_zeros(x.shape)`` and its kin: a new 4D/5D tensor in the layout of ``x``."""
        size = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        if len(size) != x.dim() or set(kwargs) - {'dtype', 'device', 'requires_grad'}:
            return func(x, *size, **kwargs)
        self.actions += 1
        options = {'dtype': kwargs.get('dtype') or x.dtype, 'device': kwargs.get('device') or x.device}
        out = torch.empty(size, memory_format=_FORMATS[x.dim()], **options)
        if _NEW_TENSORS[func] is not None:
            out.fill_(_NEW_TENSORS[func])
        return out.requires_grad_(kwargs.get('requires_grad', False))

    def _operands(self, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """An op that meets NHWC and channels-first operands (a ``cat``, an ``add`` of an attention
        output) gets them all NHWC, so that it writes NHWC; an in-place op's own tensor stays."""
        if func in _SHAPE_ONLY:
            return args, kwargs
        operands = [t for t in _tensors_in(args, kwargs) if _image_like(t)]
        if len(operands) < 2 or not any(map(_channels_last_ordered, operands)):
            return args, kwargs
        mine = args[0] if args and _in_place(func) else None
        late = [t for t in operands if t is not mine and _late(t, func in _JOINS)]
        if not late:
            return args, kwargs
        self.actions += len(late)

        def restore(t: torch.Tensor) -> torch.Tensor:
            return restore_channels_last(t, self.where) if any(t is x for x in late) else t

        return tree_map_only(torch.Tensor, restore, (args, kwargs))

    def _follow(self, out: Any, args: tuple, kwargs: dict) -> Any:
        """The op's result NHWC where it took NHWC, and its gradients hooked to stay NHWC."""
        results = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if _image_like(t)]
        if not results:
            return out
        inputs = [t for t in _tensors_in(args, kwargs) if _channels_last_ordered(t)]
        if not inputs:
            return out
        first = args[0] if args else None
        if out is results[0] and out is not first and not out._is_view() and _channels_first(out):
            self.actions += 1
            out = results[0] = restore_channels_last(out, self.where)
        if torch.is_grad_enabled():
            # a view's gradient is the gradient of what it views: hooked where the view keeps NHWC (split, chunk)
            nodes = {id(t.grad_fn): t.grad_fn for t in results if t.grad_fn is not None and _hookable(t)}
            for node in nodes.values():
                self._hook_gradients(node, {tuple(t.shape) for t in inputs})
        return out

    def _slice(self, x: torch.Tensor, index: tuple) -> torch.Tensor:
        self.actions += 1
        sliced = _ChannelSlice.apply(x, index)
        self.slices.put(sliced, (x, index))
        return sliced

    def _keep(self, x: torch.Tensor) -> torch.Tensor:
        self.actions += 1
        kept = x.clone(memory_format=_FORMATS[x.dim()])
        self.kept.put(kept, True)
        return kept

    def _view(self, x: torch.Tensor, shape: tuple, kwargs: dict) -> torch.Tensor:
        try:
            return x.view(*shape, **kwargs)
        except RuntimeError:  # the view needs the NCHW order the contiguous() asked for
            return x.contiguous().view(*shape, **kwargs)

    def _hook_gradients(self, node: Any, nhwc_shapes: set) -> None:
        where = self.where

        def restore(grads: tuple, shapes: Optional[set]) -> tuple:
            changed = [_channels_first(g) and (shapes is None or tuple(g.shape) in shapes) for g in grads]
            self.actions += sum(changed)
            return tuple(restore_channels_last(g, where) if c else g for g, c in zip(grads, changed))

        node.register_prehook(lambda grad_outputs: restore(grad_outputs, None))
        node.register_hook(lambda grad_inputs, grad_outputs: restore(grad_inputs, nhwc_shapes))


_NOT_SPECIAL = object()
# The aten ops of the activations' backward passes, as the audit names them ('aten.<name>.default').
_ACTIVATION_BACKWARDS = frozenset(
    {
        'threshold_backward',
        'gelu_backward',
        'silu_backward',
        'hardswish_backward',
        'hardsigmoid_backward',
        'sigmoid_backward',
        'tanh_backward',
        'elu_backward',
        'leaky_relu_backward',
        'hardtanh_backward',
        'mish_backward',
    }
)
# The functional activations (their backward is a pointwise op on the saved input or output).
_ACTIVATIONS = frozenset(
    {
        torch.nn.functional.relu,
        torch.nn.functional.relu6,
        torch.nn.functional.gelu,
        torch.nn.functional.silu,
        torch.nn.functional.hardswish,
        torch.nn.functional.hardsigmoid,
        torch.nn.functional.leaky_relu,
        torch.nn.functional.elu,
        torch.nn.functional.mish,
        torch.relu,
        torch.sigmoid,
        torch.tanh,
    }
)
_CONTIGUOUS = frozenset({torch.Tensor.contiguous, torch.Tensor.clone})
_NEW_TENSORS = {torch.Tensor.new_zeros: 0, torch.Tensor.new_ones: 1, torch.Tensor.new_empty: None}  # and the fill
# Ops whose output layout every operand decides: a non-dense operand (an expanded pooled branch) is copied too.
_JOINS = frozenset({torch.cat, torch.concat, torch.concatenate, torch.stack})
# Ops whose tensor arguments after the first give only a shape or a type: no copy of those to NHWC.
_SHAPE_ONLY = frozenset({torch.Tensor.expand_as, torch.Tensor.view_as, torch.Tensor.reshape_as, torch.Tensor.type_as})


def _asks_contiguous(func: Any, args: tuple, kwargs: dict) -> bool:
    """True when ``contiguous()`` / ``clone()`` asks for the channels-first contiguous format."""
    fmt = kwargs.get('memory_format', args[1] if len(args) > 1 else None)
    if func is torch.Tensor.contiguous:
        return fmt in (None, torch.contiguous_format)
    return fmt is torch.contiguous_format


def _sliceable(x: Any, index: Any) -> bool:
    """True for a channel slice of an NHWC tensor that needs a gradient."""
    return (
        torch.is_grad_enabled()
        and _channels_last_ordered(x)
        and x.requires_grad
        and isinstance(index, tuple)
        and len(index) >= 2
        and _basic_index(index)
        and index[1] != slice(None)
    )


def _in_place(func: Any) -> bool:
    name = getattr(func, '__name__', '')
    return (name.endswith('_') and not name.endswith('__')) or name.startswith('__i')
