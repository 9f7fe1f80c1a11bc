"""Extension functions bound with pybind11, whose kernels may read their tensors' memory as NCHW lays it out.

A C++ or CUDA extension built with ``torch.utils.cpp_extension`` (``load``, ``load_inline``, a setup.py
``CppExtension``) or shipped by a package (mmcv's ``_ext``, detectron2's ``_C``) exposes its kernels as
pybind11 functions, ``ext.forward(input, weight)``. Many walk ``data_ptr()`` in memory order, as NCHW
hands them contiguous tensors: given an NHWC one they compute on permuted values, silently, and no
mode or audit sees them, as they are no torch op (``torch.library`` ops are
:mod:`~channels_last_algo.core.extension_ops`'). :func:`cover_extension_functions` finds them in the
extension modules imported and those a converted model's code reaches (one ``cpp_extension`` loaded
into a name of the model's file, its module's attribute or a closure, has no name in ``sys.modules``):
the builtins a compiled module outside torch defines whose pybind11 signature names ``torch.Tensor``. It
puts :func:`contiguous_call` in each one's place on its module, which gives the kernel contiguous copies
of its channels-last tensors, writes back into the caller's tensor what the kernel wrote into a copy
(as the kernel itself would: no version bump), and logs the function once, with where it was called.
Code that looks the function up on its module at each call (``ext.forward(...)``, as mmcv and detectron2
do) gets the wrapper; a name bound before (``from ext import forward``) keeps the kernel. The wrappers
stay while a model they were put in for lives (a model stays NHWC after training).

Example:
    >>> import types, torch
    >>> ext = types.ModuleType('ext')
    >>> def first_values(x):                    # a kernel that reads memory in order
    ...     return torch.as_strided(x, (3,), (1,)).clone()
    >>> ext.first_values = contiguous_call(first_values, 'ext.first_values')
    >>> x = torch.arange(16.0).reshape(1, 4, 2, 2).to(memory_format=torch.channels_last)
    >>> ext.first_values(x).tolist()            # as NCHW memory has them (NHWC's: 0, 4, 8)
    [0.0, 1.0, 2.0]
"""

from __future__ import annotations

import importlib.machinery
import logging
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from channels_last_algo.core.layout import is_4d_or_5d, layout_of
from channels_last_algo.core.view_watch import calling_code

__all__ = ['contiguous_call', 'cover_extension_functions']

log = logging.getLogger(__name__)

_SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)
_TORCH_PACKAGES = frozenset({'torch', 'torchvision', 'torchaudio', 'functorch'})  # kernels that follow strides
_covered: dict[tuple[int, str], tuple[types.ModuleType, Any]] = {}  # (module id, name) -> (module, kernel)
_holders = [0]  # how many times a model alive was covered: the wrappers come off at 0
_named: set[str] = set()  # functions logged
_imported: list = [-1, []]  # the length of sys.modules when last looked through, and its extension modules then


def _channels_last(value: Any) -> bool:
    """A dense channels-last 4D/5D tensor, whose memory order differs from NCHW's."""
    return is_4d_or_5d(value) and value.layout == torch.strided and layout_of(value).is_channels_last


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where NaN."""
    return torch.equal(a, b) or (a.is_floating_point() and bool(torch.isclose(a, b, 0, 0, equal_nan=True).all()))


def contiguous_call(kernel: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``kernel`` given contiguous copies of its channels-last tensor arguments (in lists and dicts too);
    what it wrote into a copy is written back to the tensor passed, and an output that is a copy is the
    tensor passed. Logs ``name`` and the calling code the first time it takes such a tensor."""

    def call(*args: Any, **kwargs: Any) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        copies = {id(leaf): (leaf, leaf.contiguous()) for leaf in leaves if _channels_last(leaf)}
        if not copies:
            return kernel(*args, **kwargs)
        if name not in _named:
            _named.add(name)
            log.warning(
                'channels last: the extension function %s at %s takes NHWC tensors: it is given contiguous copies, '
                'as in NCHW, and what it writes into them reaches the tensors passed',
                name,
                calling_code(),
            )
        args, kwargs = tree_unflatten([copies[id(x)][1] if id(x) in copies else x for x in leaves], spec)
        result = kernel(*args, **kwargs)
        with torch.no_grad():
            for original, copy in copies.values():
                if copy.shape != original.shape:  # resized, as an out= argument is: the caller's tensor takes it
                    original.data = copy
                elif not _same(original, copy):
                    original.data.copy_(copy)  # written as the kernel writes: autograd's version counter unmoved
        originals = {id(copy): original for original, copy in copies.values()}
        return tree_map_only(torch.Tensor, lambda t: originals.get(id(t), t), result)

    call.__name__, call.__qualname__ = getattr(kernel, '__name__', name), name
    return call


def _top_package(module: types.ModuleType) -> str:
    return str(vars(module).get('__name__', '')).split('.')[0]


def _namespaces_of(value: Any) -> list[dict]:
    """Where code in ``value`` finds names: a function's globals and closure (as a namespace), a class's
    functions', a module's own; none for torch's. Types are read with ``type()``: no proxy's ``__class__`` runs."""
    kind = type(value)
    if issubclass(kind, type):
        if str(vars(value).get('__module__', '')).split('.')[0] in _TORCH_PACKAGES:
            return []
        functions = (getattr(attribute, '__func__', attribute) for attribute in list(vars(value).values()))
        return [n for f in functions if type(f) is types.FunctionType for n in _namespaces_of(f)]
    if kind is types.FunctionType:
        return [value.__globals__, _closure(value)]
    if issubclass(kind, types.ModuleType) and _top_package(value) not in _TORCH_PACKAGES:
        return [vars(value)]
    return []


def _closure(function: types.FunctionType) -> dict:
    """The values a function's closure holds, as a namespace."""
    values = {}
    for index, cell in enumerate(function.__closure__ or ()):
        try:
            values[str(index)] = cell.cell_contents
        except ValueError:  # a free variable not bound yet
            continue
    return values


def _extension_module(value: Any) -> bool:
    """A compiled module outside torch (its ``__file__`` read from its namespace: no lazy ``__getattr__`` runs)."""
    if not issubclass(type(value), types.ModuleType):
        return False
    path = vars(value).get('__file__')
    return isinstance(path, str) and path.endswith(_SUFFIXES) and _top_package(value) not in _TORCH_PACKAGES


def _reachable_extensions(model: torch.nn.Module) -> list[types.ModuleType]:
    """The extension modules the model's code reaches: in its modules' attributes and in the namespaces of their
    classes' code (globals, closures), and one step further (in those of a module, function or class found
    there: an ``autograd.Function`` whose ``forward`` calls ``ext.op``, a package's ops module that loaded ``_C``)."""
    nearest = [n for m in model.modules() for n in [vars(m), *_namespaces_of(type(m))]]
    seen, further, found = {id(n) for n in nearest}, [], {}
    for namespace in nearest:
        for value in list(namespace.values()):
            if _extension_module(value):
                found[id(value)] = value
                continue
            for inner in _namespaces_of(value):
                if id(inner) not in seen:
                    seen.add(id(inner))
                    further.append(inner)
    found.update((id(v), v) for namespace in further for v in list(namespace.values()) if _extension_module(v))
    return list(found.values())


def _imported_extensions() -> list[types.ModuleType]:
    """The extension modules in ``sys.modules`` (looked through again only when it changed)."""
    if len(sys.modules) != _imported[0]:
        _imported[:] = [len(sys.modules), [m for m in list(sys.modules.values()) if _extension_module(m)]]
    return _imported[1]


def _takes_tensors(function: Any, module: types.ModuleType) -> bool:
    """A builtin ``module`` defines whose pybind11 signature (its docstring's) names ``torch.Tensor``."""
    defined_in = getattr(function, '__module__', None)
    if not isinstance(function, types.BuiltinFunctionType) or defined_in not in (
        module.__name__,
        module.__name__.rpartition('.')[2],
    ):
        return False
    return 'torch.Tensor' in (function.__doc__ or '')


def cover_extension_functions(model: torch.nn.Module) -> list[str]:
    """Put :func:`contiguous_call` in place of every pybind11 function that takes tensors in the extension modules
    imported and those ``model``'s code reaches, while ``model`` lives; the names of those put now."""
    _holders[0] += 1
    weakref.finalize(model, _uncover)
    covered = []
    modules = {id(m): m for m in [*_imported_extensions(), *_reachable_extensions(model)]}
    for module in modules.values():
        for name, function in list(vars(module).items()):
            if (id(module), name) not in _covered and _takes_tensors(function, module):
                _covered[id(module), name] = (module, function)
                setattr(module, name, contiguous_call(function, f'{module.__name__}.{name}'))
                covered.append(f'{module.__name__}.{name}')
    return covered


def _uncover() -> None:
    """A model covered died; once none lives, every kernel back in its place."""
    _holders[0] -= 1
    if _holders[0]:
        return
    for (_, name), (module, kernel) in list(_covered.items()):
        setattr(module, name, kernel)
    _covered.clear()
