"""What NCHW would return for a shape op on an NHWC tensor: a view, or a copy.

``.reshape()``, ``.flatten()``, ``.unflatten()`` and ``.contiguous()`` return a view where the strides
allow one and a copy elsewhere, so NHWC and NCHW can differ: ``z.reshape(n, -1)`` copies an NHWC ``z``
where NCHW has a view, and ``z.permute(0, 2, 3, 1).reshape(-1, c)`` is a view of an NHWC ``z`` where
NCHW copies. An in-place write then reaches the other tensor in one layout only. :class:`NchwTwins`
keeps, for each tensor a watch follows, its NCHW twin: a meta tensor (no memory) with the strides
the tensor has in an NCHW run (contiguous for a dense NHWC tensor and a 4D/5D parameter, its own strides
for a tensor nothing NHWC made, and whatever the same view ops give from there), and runs each shape op on
the twin too. :meth:`NchwTwins.follow` runs every other
op there as well, so a map that is NHWC in NCHW too (``norm(z.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)``,
and the convolutions after it) has an NHWC twin, and its ``.contiguous()`` copies in both layouts.

Example:
    >>> import torch
    >>> z = torch.randn(2, 4, 3, 3).to(memory_format=torch.channels_last)
    >>> twins = NchwTwins()
    >>> rows = z.permute(0, 2, 3, 1)
    >>> twins.note(rows, twins.run(torch.Tensor.permute, (z, 0, 2, 3, 1), {})[1])
    >>> flat = rows.reshape(-1, 4)      # a view of z here
    >>> twin, twin_flat = twins.run(torch.Tensor.reshape, (rows, -1, 4), {})
    >>> flat._base is z, aliases(twin, twin_flat)     # NCHW copies
    (True, False)
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from channels_last_algo.core.layout import is_4d_or_5d, is_channels_last, layout_of

__all__ = ['CONVOLUTIONS', 'COPY_OR_VIEW', 'SHAPE_OPS', 'NchwTwins', 'aliases', 'laid_out_by_weight']


def _ops(*names: str) -> frozenset:
    """The Tensor methods and torch functions of these names."""
    found = {getattr(torch.Tensor, name, None) for name in names} | {getattr(torch, name, None) for name in names}
    return frozenset(found - {None})


COPY_OR_VIEW = _ops('reshape', 'reshape_as', 'flatten', 'unflatten', 'contiguous') | {torch.Tensor.to}
"""Ops that return a view (or the tensor itself) where the strides allow it, and a copy elsewhere
(``.to`` with a memory format only: :meth:`NchwTwins.run` passes over device and dtype moves)."""

_VIEW_OPS = _ops(
    'view',
    'view_as',
    'permute',
    'transpose',
    'swapaxes',
    'movedim',
    'moveaxis',
    'squeeze',
    'unsqueeze',
    'narrow',
    'select',
    '__getitem__',
    'expand',
    'expand_as',
    'unfold',
    'split',
    'chunk',
    'unbind',
    'tensor_split',
    'diagonal',
)  # ops that view in either layout, whose twins the copy-or-view ops after them need
SHAPE_OPS = COPY_OR_VIEW | _VIEW_OPS
"""The ops whose results :class:`NchwTwins` gives twins."""


def _overloads(namespace: Any, name: str) -> set:
    """The op packet ``namespace.name`` and its overloads; none where this torch lacks it (built without oneDNN)."""
    try:
        packet = getattr(namespace, name)
    except (AttributeError, RuntimeError):
        return set()
    return {packet, *(getattr(packet, overload) for overload in packet.overloads())}


FUNCTIONAL_CONVOLUTIONS = _ops('conv1d', 'conv2d', 'conv3d', 'conv_transpose1d', 'conv_transpose2d', 'conv_transpose3d')
"""The functional convolutions, whose output a channels-last weight lays out NHWC."""

FUSED_CONVOLUTIONS = frozenset(
    _overloads(torch.ops.mkldnn, '_convolution_pointwise')
    | _ops('cudnn_convolution_relu', 'cudnn_convolution_add_relu')
)
"""oneDNN's and cuDNN's fused convolutions, the fused inference copy's kernels: an NCHW run's weights are NCHW, so
the input alone says how its output is laid out there (the weight they are given may be an opaque prepacked one,
and oneDNN's has no meta kernel)."""

IN_PLACE_CONVOLUTIONS = frozenset(_overloads(torch.ops.mkldnn, '_convolution_pointwise_'))
"""oneDNN's fused convolution that adds into its first argument and returns it: that tensor's twin stands."""

CONVOLUTIONS = FUNCTIONAL_CONVOLUTIONS | FUSED_CONVOLUTIONS | IN_PLACE_CONVOLUTIONS
"""Every convolution op a watch may see: what it returns comes from the module, not from a batch tensor."""


def laid_out_by_weight(args: tuple, kwargs: dict) -> bool:
    """Whether a convolution's weight (its second argument) is channels last, which lays the output out NHWC
    whatever the input (oneDNN, cuDNN): making the input channels first would leave the output NHWC.

    Example:
        >>> weight = torch.randn(8, 3, 3, 3).to(memory_format=torch.channels_last)
        >>> x = torch.randn(1, 3, 8, 8)
        >>> laid_out_by_weight((x, weight), {}), laid_out_by_weight((x,), {'weight': weight.contiguous()})
        (True, False)
    """
    weight = _weight_of(args, kwargs)
    return is_4d_or_5d(weight) and weight.layout == torch.strided and is_channels_last(weight)


def _weight_of(args: tuple, kwargs: dict) -> Any:
    """A convolution call's weight: its second argument, given by position or by name."""
    return args[1] if len(args) > 1 else kwargs.get('weight')


def _as_convolution_lays_out(input: Any, weight: Any, twin_result: torch.Tensor) -> torch.Tensor:
    """A convolution's output NHWC where its input or weight is, as cuDNN and oneDNN lay it out (meta kernels of
    some torch versions give contiguous); ``weight`` None: the input alone decides."""
    if twin_result.dim() not in (4, 5):
        return twin_result
    fmt = torch.channels_last if twin_result.dim() == 4 else torch.channels_last_3d
    tensors = [t for t in (input, weight) if isinstance(t, torch.Tensor) and t.dim() == twin_result.dim()]
    if any(layout_of(t).is_channels_last for t in tensors):
        return twin_result.contiguous(memory_format=fmt)
    return twin_result.contiguous()


def _dense_nhwc(tensor: torch.Tensor) -> bool:
    # sparse and nested tensors have no NCHW twin
    return tensor.layout == torch.strided and layout_of(tensor).is_channels_last


def _laid_out_alike(tensors: list, twins: list) -> bool:
    """Whether each tensor has its twin's strides: an op's kernel then lays out its result in NCHW as here,
    which meta kernels do not always tell (a group norm or attention of a channels-last map gives contiguous)."""
    return len(tensors) == len(twins) and all(t.stride() == twin.stride() for t, twin in zip(tensors, twins))


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device='meta')


def _view_of(tensor: torch.Tensor) -> Optional[tuple]:
    """What makes two tensors the same view of memory (its address, shape and strides); None for a tensor without
    storage (a batched tensor inside ``vmap``)."""
    try:
        return tensor.device, tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype
    except RuntimeError:
        return None


def _base(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor._base is None else tensor._base


class NchwTwins:
    """The NCHW twins of the tensors a watch follows, made by the shape ops that made them."""

    def __init__(self) -> None:
        self._twins: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> its NCHW twin (meta)
        self._views: dict[tuple, tuple] = {}  # a tensor's memory, shape and strides -> (its base, its twin)

    def __contains__(self, tensor: torch.Tensor) -> bool:
        """Whether a shape op made ``tensor``, and its twin is known."""
        return tensor in self._twins

    def twin(self, tensor: Any) -> Optional[torch.Tensor]:
        """``tensor``'s NCHW twin: known from the ops that made it or an alias of it (the same memory, shape and
        strides: what a module's full backward hook returns in place of its outputs, through a Function no mode
        sees), or contiguous for a dense NHWC tensor and for a 4D/5D parameter (a 1x1 kernel restrided to channels
        last is contiguous too, but not laid out as NCHW's)."""
        if not isinstance(tensor, torch.Tensor):
            return None
        known = self._twins.get(tensor)
        if known is None:
            known = self._twin_of_alias(tensor)
        if known is None and (
            _dense_nhwc(tensor) or (isinstance(tensor, torch.nn.Parameter) and tensor.dim() in (4, 5))
        ):
            with _disable_current_modes():
                known = torch.empty(tensor.shape, dtype=tensor.dtype, device='meta')
        return known

    def run(self, func: Any, args: tuple, kwargs: dict) -> Optional[tuple[torch.Tensor, Any]]:
        """``(twin, func(twin, ...))`` for ``twin`` the NCHW twin of ``args[0]`` (one of its own strides where none
        is known); None where the op is no shape op, or does not run on meta tensors (a boolean mask index)."""
        if func not in SHAPE_OPS or not args or not isinstance(args[0], torch.Tensor):
            return None  # not a tensor: an fx Proxy being traced
        if func is torch.Tensor.to and (len(args) > 1 or set(kwargs) != {'memory_format'}):
            return None  # a device or dtype move: the same in either layout
        try:
            with _disable_current_modes():
                twin = self._on_twins(args[0])  # untracked: NCHW has it as here (tokens of a contiguous map)
                others, twin_kwargs = self._on_twins((args[1:], kwargs))
                return twin, func(twin, *others, **twin_kwargs)
        except Exception:  # an op meta tensors cannot take (a boolean mask, a tensor subclass): unknown
            return None

    def follow(self, func: Any, args: tuple, kwargs: dict, result: Any) -> None:
        """Note the twins of what any other op made of followed tensors (``layer_norm`` of a permuted NHWC map, the
        convolution after it): ``func`` run on the twins of its tensor arguments, on meta tensors; where every
        argument has its twin's strides, the result's own strides. A map that is NHWC in NCHW too (permuted back
        from tokens) keeps that twin; nothing where the op takes no meta tensors."""
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not tensors:  # a factory given a channels-last memory format: the same in NCHW
            for made in [t for t in tree_leaves(result) if isinstance(t, torch.Tensor) and _dense_nhwc(t)]:
                self._noted(made, _meta_like(made))
            return
        if not any(t in self._twins or _dense_nhwc(t) for t in tensors):
            return
        if not any(isinstance(t, torch.Tensor) for t in tree_leaves(result)):
            return
        if func in IN_PLACE_CONVOLUTIONS:
            return
        try:
            with _disable_current_modes():  # an audit or a FLOP counter sees the real op only
                twin_args, twin_kwargs = self._on_twins((args, kwargs))
                if func in FUSED_CONVOLUTIONS and isinstance(result, torch.Tensor):
                    shaped = torch.empty(result.shape, dtype=result.dtype, device='meta')
                    self.note(result, _as_convolution_lays_out(twin_args[0], None, shaped))
                    return
                twins = [t for t in tree_leaves((twin_args, twin_kwargs)) if isinstance(t, torch.Tensor)]
                if _laid_out_alike(tensors, twins):
                    self.note(result, tree_map_only(torch.Tensor, _meta_like, result))  # what the kernel gave here
                    return
                twin_result = func(*twin_args, **twin_kwargs)
                if func in FUNCTIONAL_CONVOLUTIONS and isinstance(twin_result, torch.Tensor):
                    twin_result = _as_convolution_lays_out(
                        twin_args[0], _weight_of(twin_args, twin_kwargs), twin_result
                    )
        except Exception:  # no meta kernel, or an op that leaves the device (.cpu(), .numpy()): unknown
            return
        self.note(result, twin_result)

    def _on_twins(self, value: Any) -> Any:
        """``value`` with each tensor replaced by its twin, or by a meta tensor of its own strides where it has none."""

        def twin_or_meta(tensor: torch.Tensor) -> torch.Tensor:
            twin = self.twin(tensor)
            return twin if twin is not None else _meta_like(tensor)

        return tree_map_only(torch.Tensor, twin_or_meta, value)

    def note(self, result: Any, twin_result: Any) -> None:
        """``twin_result`` (what :meth:`run` gave) holds the twins of ``result``'s tensors."""
        tensors, twins = tree_leaves(result), tree_leaves(twin_result)
        if len(tensors) == len(twins):
            for tensor, twin in zip(tensors, twins):
                if isinstance(tensor, torch.Tensor) and isinstance(twin, torch.Tensor):
                    self._noted(tensor, twin)

    def _noted(self, tensor: torch.Tensor, twin: torch.Tensor) -> None:
        self._twins[tensor] = twin
        view = _view_of(tensor)
        if view is not None:
            self._views[view] = (weakref.ref(_base(tensor)), twin)

    def _twin_of_alias(self, tensor: torch.Tensor) -> Optional[torch.Tensor]:
        """The twin of a tensor noted with ``tensor``'s memory, shape and strides, and its base: the same view."""
        view = _view_of(tensor)
        base, twin = self._views.get(view, (None, None)) if view is not None else (None, None)
        return twin if base is not None and base() is _base(tensor) else None


def aliases(twin: torch.Tensor, twin_result: Any) -> bool:
    """Whether ``twin_result`` is ``twin`` itself or a view of the same memory: NCHW aliases there."""
    return isinstance(twin_result, torch.Tensor) and (twin_result is twin or _base(twin_result) is _base(twin))
